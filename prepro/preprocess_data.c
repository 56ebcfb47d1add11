/*
 * prepro/preprocess_data.c — Megatron-LM's tools/preprocess_data.py in C: documents in, a tokenized
 * .bin/.idx dataset (MMIDIDX v1) out, readable by Megatron and by train_gpt.
 *
 *   prepro/preprocess_data --input corpus.jsonl --output-prefix data/corpus \
 *       --tokenizer-type GPT2BPETokenizer --vocab-file dev/data/gpt2/gpt2-vocab.json \
 *       --merge-file dev/data/gpt2/gpt2-merges.txt --append-eod --workers 8
 *   -> data/corpus_text_document.bin / .idx   (train with --data-path data/corpus_text_document)
 *
 * The work happens in prepro/tokenizer.h (mt_preprocess); this file parses the flags and prints
 * progress. Run with --help for the flags.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define MEGATRON_IMPLEMENTATION
#include "../megatron.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "tokenizer.h"
#include "args.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char* const usage =
    "usage: preprocess_data --input PATH... --output-prefix PREFIX --tokenizer-type TYPE [options]\n"
    "\n"
    "Tokenizes documents into Megatron datasets {PREFIX}_{KEY}_document.bin/.idx, one per JSON key,\n"
    "as Megatron's tools/preprocess_data.py does (token ids equal the reference tokenizer's; invalid\n"
    "UTF-8 is read as U+FFFD, like Python's errors='replace'). The output bytes do not depend on --workers.\n"
    "Outputs appear only when the whole run succeeded.\n"
    "\n"
    "input:\n"
    "  --input PATH...           input files, read in the order given; a directory stands for every\n"
    "                            file under it (depth first, sorted by name, hidden names skipped);\n"
    "                            .gz and .zst files are decompressed (when built with zlib / zstd)\n"
    "  --input-format FMT        jsonl (default: one JSON object per line, blank lines skipped) or\n"
    "                            text (each file is one document, its raw bytes)\n"
    "  --json-keys KEY...        keys to tokenize, one dataset each (default: text); text mode: the\n"
    "                            one key only names the output\n"
    "  --skip-bad-lines          skip malformed JSONL lines (bad JSON, missing key, value not a\n"
    "                            string), report each and count them, instead of stopping at the first\n"
    "  --max-line-bytes N        the longest JSONL line taken, in bytes (text input: the largest file;\n"
    "                            default 1073741824 = 1 GiB, at most 2^40); a longer one is an error\n"
    "                            naming its file and line, found before more than about N bytes of it\n"
    "                            are held in memory\n"
    "output:\n"
    "  --output-prefix PREFIX    output path prefix\n"
    "  --append-eod              append the end-of-document token to every non-empty document\n"
    "tokenizer (Megatron's --tokenizer-type names and meanings):\n"
    "  --tokenizer-type TYPE     GPT2BPETokenizer (--vocab-file, --merge-file: Hugging Face's GPT-2),\n"
    "                            HuggingFaceTokenizer (--tokenizer-model: a tokenizer.json or its\n"
    "                            directory; BOS as the tokenizer adds it, EOD its eos_token),\n"
    "                            TikTokenizer (--tokenizer-model: Megatron's JSON vocabulary); this\n"
    "                            build's own TiktokenFileTokenizer (a .tiktoken rank file, ids as\n"
    "                            tiktoken's encode_ordinary) and Llama3Tokenizer (Llama-3's tokenizer.model)\n"
    "  --vocab-file FILE         GPT-2 encoder.json (e.g. dev/data/gpt2/gpt2-vocab.json)\n"
    "  --merge-file FILE         GPT-2 vocab.bpe (e.g. dev/data/gpt2/gpt2-merges.txt)\n"
    "  --tokenizer-model PATH    see --tokenizer-type\n"
    "  --tokenizer-hf-no-include-special-tokens  HuggingFaceTokenizer: no BOS/EOS from the template\n"
    "  --tiktoken-pattern v1|v2  TikTokenizer's split pattern (default v2)\n"
    "  --tiktoken-num-special-tokens N  TikTokenizer: ids below N are special (default 1000)\n"
    "  --tokenizer-special-tokens TOK...  TikTokenizer's special tokens (default <unk> <s> </s>\n"
    "                            <mask> <pad> <cls> <sep>)\n"
    "  --vocab-size N            TikTokenizer's vocabulary size, specials included (default 131072)\n"
    "  --tiktoken-encoding NAME  TiktokenFileTokenizer: r50k_base, cl100k_base or o200k_base (default:\n"
    "                            from the --tokenizer-model file name)\n"
    "run:\n"
    "  --workers N               encoding threads (default: the number of CPUs)\n"
    "  --quiet                   no progress lines\n"
    "  --help\n"
    "SIGINT or SIGTERM stops the run within about 0.1 s at any point (a FIFO input waiting for its\n"
    "writer included), removes the temporary files and exits with 128 + the signal's number; the\n"
    "old datasets stay.\n"
    "accepted for compatibility, no effect on the output:\n"
    "  --log-interval N, --partitions 1, --keep-sequential-samples, --dataset-impl mmap\n"
    "not supported: --split-sentences (and --lang, --keep-newlines which go with it).\n";

typedef struct {
    const char** inputs;
    int num_inputs;
    const char** keys;
    int num_keys;
    const char* format;
    const char* output_prefix;
    mt_tokenizer_args tok;          /* the tokenizer flags */
    long long max_line_bytes;
    int append_eod, workers, skip_bad_lines, quiet;
} options;

/* The signal that asked the run to stop (0: none): mt_preprocess's cancellation flag. */
static volatile sig_atomic_t g_interrupted = 0;

static void on_signal(int sig) { g_interrupted = sig; }

/* SIGINT and SIGTERM set g_interrupted. Without SA_RESTART a blocking call the signal lands in
 * returns EINTR instead of going on; SA_RESETHAND: a second signal ends the process at once (the
 * temporaries it leaves are removed by the next writer of the prefix). */
static void install_signal_handlers(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

static int die(const char* fmt, const char* a) {
    fprintf(stderr, "preprocess_data: ");
    fprintf(stderr, fmt, a);
    fprintf(stderr, "\n");
    return 1;
}

/* ---- progress ---- */

typedef struct {
    int quiet, tty;
    double last;
    int64_t bad_reported;
} progress_state;

static double now_seconds(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void print_progress(const mt_preprocess_stats* s, int final, int tty) {
    double mb = (double)s->bytes_read / 1e6, total = (double)s->bytes_total / 1e6;
    double rate = s->seconds > 0 ? mb / s->seconds : 0.0;
    double eta = rate > 0 && total > mb ? (total - mb) / rate : 0.0;
    if (mb > total) /* compressed input: the decompressed size is not known ahead */
        fprintf(stderr, "%s%lld docs, %.1f MB (from %.1f MB of files), %.1f MB/s, %.2fM tokens%s%.0fs%s", tty ? "\r" : "",
                (long long)s->documents, mb, total, rate, (double)s->tokens / 1e6, final ? ", took " : ", for ", s->seconds,
                tty ? "\033[K" : "\n");
    else
        fprintf(stderr, "%s%lld docs, %.1f/%.1f MB (%.0f%%), %.1f MB/s, %.2fM tokens%s%.0fs%s", tty ? "\r" : "",
                (long long)s->documents, mb, total, total > 0 ? 100.0 * mb / total : 100.0, rate, (double)s->tokens / 1e6,
                final ? ", took " : ", ETA ", final ? s->seconds : eta, tty ? "\033[K" : "\n");
    if (final && tty) fprintf(stderr, "\n");
    fflush(stderr);
}

static void on_progress(void* user, const mt_preprocess_stats* s) {
    progress_state* p = (progress_state*)user;
    if (p->quiet) return;
    double t = now_seconds();
    if (t - p->last < (p->tty ? 0.25 : 5.0)) return;
    p->last = t;
    print_progress(s, 0, p->tty);
}

static void on_bad_line(void* user, const char* message) {
    progress_state* p = (progress_state*)user;
    if (p->bad_reported++ < 20) fprintf(stderr, "%sskipped %s\n", p->tty && !p->quiet ? "\r\033[K" : "", message);
    else if (p->bad_reported == 21) fprintf(stderr, "(more skipped lines not shown)\n");
}

/* ---- flags ---- */

/* Collects the values after a flag up to the next "--" flag (argparse nargs='+'). */
static int take_list(int argc, char** argv, int* i, const char*** list, int* n) {
    int start = *i + 1, end = start;
    while (end < argc && strncmp(argv[end], "--", 2) != 0) end++;
    if (end == start) return -1;
    const char** l = (const char**)realloc((void*)*list, (size_t)(*n + end - start) * sizeof(char*));
    if (!l) return -1;
    for (int k = start; k < end; k++) l[(*n)++] = argv[k];
    *list = l;
    *i = end - 1;
    return 0;
}

static int parse_args(int argc, char** argv, options* o) {
    for (int i = 1; i < argc; i++) {
        char* a = argv[i];
#define VALUE(dst)                                                                       \
    do {                                                                                 \
        if (i + 1 >= argc) return die("%s needs a value", a);                          \
        dst = argv[++i];                                                                 \
    } while (0)
        int tf = mt_args_tokenizer_flag("preprocess_data", argc, argv, &i, &o->tok);
        if (tf < 0) return 1;
        if (tf > 0) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(usage, stdout); exit(0); }
        else if (!strcmp(a, "--input")) { if (take_list(argc, argv, &i, &o->inputs, &o->num_inputs)) return die("%s needs a value", a); }
        else if (!strcmp(a, "--json-keys")) { if (take_list(argc, argv, &i, &o->keys, &o->num_keys)) return die("%s needs a value", a); }
        else if (!strcmp(a, "--input-format")) VALUE(o->format);
        else if (!strcmp(a, "--output-prefix")) VALUE(o->output_prefix);
        else if (!strcmp(a, "--max-line-bytes")) {
            const char* v;
            VALUE(v);
            if (!mt_args_parse_int("preprocess_data", a, v, 1, (long long)1 << 40, &o->max_line_bytes)) return 1;
        }
        else if (!strcmp(a, "--append-eod")) o->append_eod = 1;
        else if (!strcmp(a, "--skip-bad-lines")) o->skip_bad_lines = 1;
        else if (!strcmp(a, "--quiet")) o->quiet = 1;
        else if (!strcmp(a, "--workers")) {
            const char* v;
            VALUE(v);
            char* end;
            long w = strtol(v, &end, 10);
            if (*end || w < 1 || w > 4096) return die("--workers must be a positive integer, not '%s'", v);
            o->workers = (int)w;
        } else if (!strcmp(a, "--log-interval") || !strcmp(a, "--dataset-impl")) {
            const char* v;
            VALUE(v);
            if (!strcmp(a, "--dataset-impl") && strcmp(v, "mmap") != 0) return die("--dataset-impl %s: only mmap is written", v);
        } else if (!strcmp(a, "--partitions")) {
            const char* v;
            VALUE(v);
            if (strcmp(v, "1") != 0)
                return die("--partitions %s: not supported (use --workers for parallelism; partitions > 1 also reorder documents in Megatron)", v);
        } else if (!strcmp(a, "--keep-sequential-samples")) {
            /* only matters with --partitions > 1 */
        } else if (!strcmp(a, "--split-sentences") || !strcmp(a, "--keep-newlines") || !strcmp(a, "--lang")) {
            return die("%s: sentence splitting (NLTK punkt) is not supported; documents are tokenized whole, as Megatron does without it", a);
        } else {
            return die("unknown argument '%s' (see --help)", a);
        }
#undef VALUE
    }
    return 0;
}

/* 0, or the exit status: 2 for flags that name no tokenizer (usage), 1 for one that cannot be read */
static int load_tokenizer(const options* o, mt_tokenizer** tok) {
    mt_error err;
    if (!o->tok.type) return 1 + die("%s", "--tokenizer-type is required (GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer, ...; see --help)");
    if (!strcmp(o->tok.type, "NullTokenizer")) return 1 + die("%s", "NullTokenizer has no text tokenizer: nothing to preprocess with it");
    mt_status st = mt_tokenizer_load_by_type(tok, &o->tok, &err);
    if (st != MT_OK) return (st == MT_ERR_ARG) + die("%s", err.message);
    return 0;
}

int main(int argc, char** argv) {
    options o;
    memset(&o, 0, sizeof(o));
    mt_tokenizer_args_init(&o.tok);
    /* usage errors (no arguments, a bad flag or value, a missing required flag) exit 2, failures 1 */
    if (argc < 2) { fputs(usage, stderr); return 2; }
    int nargs = 0;
    char** args = mt_args_split_equals(argc, argv, &nargs); /* --flag=value is --flag value */
    if (!args) return die("%s", "out of memory");
    if (parse_args(nargs, args, &o)) return 2;
    if (!o.num_inputs) return 1 + die("%s", "--input is required");
    if (!o.output_prefix) return 1 + die("%s", "--output-prefix is required");
    mt_input_format format = MT_INPUT_JSONL;
    if (o.format && !strcmp(o.format, "text")) format = MT_INPUT_TEXT;
    else if (o.format && strcmp(o.format, "jsonl") != 0 && strcmp(o.format, "json") != 0)
        return 1 + die("--input-format %s: use jsonl or text", o.format);
    if (!o.workers) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        o.workers = n > 0 ? (int)n : 1;
    }

    mt_tokenizer* tok = NULL;
    int tokenizer_status = load_tokenizer(&o, &tok);
    if (tokenizer_status) return tokenizer_status;

    progress_state ps;
    memset(&ps, 0, sizeof(ps));
    ps.quiet = o.quiet;
    ps.tty = isatty(2);
    ps.last = now_seconds();

    mt_preprocess_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.inputs = o.inputs;
    cfg.num_inputs = o.num_inputs;
    cfg.format = format;
    cfg.output_prefix = o.output_prefix;
    cfg.json_keys = o.keys;
    cfg.num_json_keys = o.num_keys;
    cfg.tokenizer = tok;
    cfg.append_eod = o.append_eod;
    cfg.workers = o.workers;
    cfg.skip_bad_lines = o.skip_bad_lines;
    cfg.progress = on_progress;
    cfg.bad_line = on_bad_line;
    cfg.user = &ps;
    cfg.max_line_bytes = (size_t)o.max_line_bytes;
    cfg.cancel = &g_interrupted;
    install_signal_handlers();

    if (!o.quiet)
        fprintf(stderr, "preprocess_data: tokenizer %s (vocab %lld, eod %d), %d workers\n", mt_tokenizer_kind_name(mt_tokenizer_get_kind(tok)),
                (long long)mt_tokenizer_vocab_size(tok), mt_tokenizer_eod(tok), o.workers);
    mt_preprocess_stats stats;
    mt_error err;
    mt_status st = mt_preprocess(&cfg, &stats, &err);
    if (!o.quiet && stats.documents > 0 && ps.tty) fprintf(stderr, "\r\033[K");
    if (st != MT_OK) {
        int sig = g_interrupted;
        if (sig) fprintf(stderr, "preprocess_data: interrupted by signal %d (%s); no output written\n", sig,
                         sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "?");
        else fprintf(stderr, "preprocess_data: %s\n", err.message);
        mt_tokenizer_free(tok);
        free((void*)o.inputs);
        free((void*)o.keys);
        free(args);
        return sig ? 128 + sig : 1;
    }
    if (!o.quiet) print_progress(&stats, 1, 0);
    int nk = o.num_keys ? o.num_keys : 1;
    for (int k = 0; k < nk; k++)
        printf("wrote %s_%s_document.bin/.idx\n", o.output_prefix, o.num_keys ? o.keys[k] : "text");
    printf("%lld documents, %lld tokens (%s%s), %.1f MB in %.1f s\n", (long long)stats.documents, (long long)stats.tokens,
           mt_indexed_dtype_name(mt_indexed_dtype_for_vocab(mt_tokenizer_vocab_size(tok))), nk > 1 ? ", all keys" : "",
           (double)stats.bytes_read / 1e6, stats.seconds);
    if (stats.bad_lines) fprintf(stderr, "preprocess_data: skipped %lld malformed lines\n", (long long)stats.bad_lines);
    if (stats.empty_docs) fprintf(stderr, "preprocess_data: %lld documents encoded to no tokens (kept as empty documents)\n", (long long)stats.empty_docs);
    mt_tokenizer_free(tok);
    free((void*)o.inputs);
    free((void*)o.keys);
    free(args);
    return 0;
}
