/* prepro/dataset_info.c — inspect .bin/.idx datasets and the GPT samples Megatron draws from them.
 *
 *   dataset_info PREFIX
 *       dtype, documents (and how many are empty), sequences, tokens, sequence-length statistics.
 *
 *   dataset_info --data-path [W1] P1 [[W2] P2 ...] --seq-length S [--split 969,30,1] [--seed 1234]
 *                [--show-split train|valid|test] [--samples K]
 *                [--num-samples N | --train-iters I --global-batch-size G [--eval-interval 1000]
 *                 [--eval-iters 100]]
 *                [--tokenizer-type TYPE and its flags, as preprocess_data takes them]
 *                [--output-dir DIR]
 *       builds the train/valid/test datasets exactly as Megatron does for these flags (megatron.h
 *       section 3: splits, epochs, document/sample/shuffle index, blending) and prints, for the split
 *       chosen with --show-split, how it was built and its first K samples, decoded as text when a
 *       tokenizer is given (token ids otherwise): --tokenizer-type GPT2BPETokenizer (--vocab-file,
 *       --merge-file), HuggingFaceTokenizer (--tokenizer-model), TikTokenizer, TiktokenFileTokenizer,
 *       Llama3Tokenizer, with the same flags as preprocess_data and train_gpt (prepro/args.h).
 *       --tokenizer-kind K, the old flag, still works: --tokenizer-type TiktokenFileTokenizer
 *       --tiktoken-encoding K (Llama3Tokenizer for llama3). Sample counts: --num-samples N asks the shown split
 *       for N samples (the other splits for 0); --train-iters/--global-batch-size/--eval-interval/
 *       --eval-iters give Megatron's counts for all three; with neither, each split is one epoch.
 *       --output-dir DIR writes that split's index arrays as Megatron caches them: for one dataset
 *       DIR/{document,sample,shuffle}_index.npy; for a blend DIR/dataset_index.npy,
 *       DIR/dataset_sample_index.npy and DIR/<k>-{document,sample,shuffle}_index.npy per dataset k.
 */
#define MEGATRON_IMPLEMENTATION
#include "../megatron.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "tokenizer.h"
#include "args.h" /* after tokenizer.h: the shared tokenizer flags */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static void usage(void) {
    fprintf(stderr,
            "usage: dataset_info PREFIX\n"
            "       dataset_info --data-path [W1] P1 [[W2] P2 ...] --seq-length S [options]\n"
            "  --split STR              train/valid/test weights (default \"969, 30, 1\")\n"
            "  --seed N                 dataset seed (default 1234)\n"
            "  --show-split NAME        train, valid or test (default train)\n"
            "  --samples K              samples to print (default 2)\n"
            "  --num-samples N          samples requested from the shown split (others: 0)\n"
            "  --train-iters I --global-batch-size G [--eval-interval 1000] [--eval-iters 100]\n"
            "                           Megatron's sample counts for all three splits\n"
            "  --tokenizer-type TYPE    decode the samples with this tokenizer (Megatron's names):\n"
            "                           GPT2BPETokenizer (--vocab-file F --merge-file M),\n"
            "                           HuggingFaceTokenizer (--tokenizer-model DIR|tokenizer.json),\n"
            "                           TikTokenizer, TiktokenFileTokenizer, Llama3Tokenizer\n"
            "                           (--tokenizer-model FILE), with preprocess_data's other tokenizer\n"
            "                           flags; NullTokenizer or none: token ids\n"
            "  --tokenizer-kind K       deprecated: --tokenizer-type TiktokenFileTokenizer --tiktoken-encoding K\n"
            "  --output-dir DIR         write the shown split's index arrays (.npy) to DIR\n");
}

static int fail(const char* msg) {
    fprintf(stderr, "dataset_info: error: %s\n", msg);
    return 1;
}

static int parse_num(const char* flag, const char* s, long long lo, long long hi, long long* out) {
    return mt_args_parse_int("dataset_info", flag, s, lo, hi, out);
}

/* One line per dataset: what is in the .idx. */
static void print_dataset(const mt_indexed_dataset* ds) {
    int64_t n = mt_indexed_dataset_num_sequences(ds), d = mt_indexed_dataset_num_documents(ds), empty = 0;
    int64_t minl = n ? INT64_MAX : 0, maxl = 0;
    for (int64_t k = 0; k < d; k++)
        empty += mt_indexed_dataset_document_start(ds, k) == mt_indexed_dataset_document_start(ds, k + 1);
    for (int64_t i = 0; i < n; i++) {
        int64_t l = mt_indexed_dataset_sequence_length(ds, i);
        if (l < minl) minl = l;
        if (l > maxl) maxl = l;
    }
    printf("%s: %s tokens, %lld documents (%lld empty), %lld sequences, %lld tokens; sequence length min %lld, "
           "mean %.1f, max %lld\n",
           mt_indexed_dataset_prefix(ds), mt_indexed_dtype_name(mt_indexed_dataset_dtype(ds)), (long long)d,
           (long long)empty, (long long)n, (long long)mt_indexed_dataset_num_tokens(ds), (long long)minl,
           n ? (double)mt_indexed_dataset_num_tokens(ds) / (double)n : 0.0, (long long)maxl);
}

static void print_mid(const mt_gpt_dataset* g, const char* indent) {
    mt_gpt_dataset_info in;
    mt_gpt_dataset_get_info(g, &in);
    char req[32];
    if (in.num_samples_requested < 0) snprintf(req, sizeof(req), "None");
    else snprintf(req, sizeof(req), "%lld", (long long)in.num_samples_requested);
    printf("%ssequences [%lld, %lld): %lld tokens per epoch; %s samples requested -> %lld epoch%s%s, %lld samples "
           "(sample_index %s, shuffle_index %s)\n",
           indent, (long long)in.begin, (long long)in.end, (long long)in.tokens_per_epoch, req, (long long)in.num_epochs,
           in.num_epochs == 1 ? "" : "s", in.separate_final_epoch ? " (final epoch shuffled separately)" : "",
           (long long)in.num_samples, in.sample_index_itemsize == 4 ? "int32" : "int64",
           in.shuffle_index_itemsize == 4 ? "uint32" : "int64");
}

/* Prints bytes as one quoted line: control characters escaped, UTF-8 as is. */
static void print_text(const char* s, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') fputs("\\n", stdout);
        else if (c == '\t') fputs("\\t", stdout);
        else if (c == '\r') fputs("\\r", stdout);
        else if (c == '"') fputs("\\\"", stdout);
        else if (c == '\\') fputs("\\\\", stdout);
        else if (c < 0x20 || c == 0x7f) printf("\\x%02x", c);
        else putchar(c);
    }
    putchar('"');
}

static int ensure_dir(const char* dir) {
    if (mkdir(dir, 0755) == 0 || errno == EEXIST) return 0;
    return -1;
}

int main(int argc, char** argv) {
    argv = mt_args_split_equals(argc, argv, &argc); /* --flag=value is --flag value, as argparse */
    if (!argv) return 1;
    const char** data_args = (const char**)calloc((size_t)argc, sizeof(char*));
    int num_data_args = 0, seq_length = 0, show = MT_SPLIT_TRAIN, samples_to_print = 2;
    const char *split = "969, 30, 1", *kind_name = NULL, *out_dir = NULL;
    mt_tokenizer_args tok_args;
    mt_tokenizer_args_init(&tok_args);
    long long seed = 1234, num_samples = -1, train_iters = -1, gbs = -1, eval_interval = 1000, eval_iters = 100;
    long long v;
    mt_error err;
    char msg[1024];

    /* usage errors (a bad flag or value, no dataset) exit 2; failures reading the data exit 1 */
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        int has = i + 1 < argc;
        int tf = mt_args_tokenizer_flag("dataset_info", argc, argv, &i, &tok_args);
        if (tf < 0) return 1;
        if (tf > 0) continue;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage();
            return 0;
        } else if (strcmp(a, "--data-path") == 0) {
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) data_args[num_data_args++] = argv[++i];
        } else if (strcmp(a, "--seq-length") == 0 && has) { if (!parse_num(a, argv[++i], 1, INT32_MAX, &v)) return 2; seq_length = (int)v; }
        else if (strcmp(a, "--split") == 0 && has) split = argv[++i];
        else if (strcmp(a, "--seed") == 0 && has) { if (!parse_num(a, argv[++i], 0, 4294967295LL, &seed)) return 2; }
        else if (strcmp(a, "--samples") == 0 && has) { if (!parse_num(a, argv[++i], 0, INT32_MAX, &v)) return 2; samples_to_print = (int)v; }
        else if (strcmp(a, "--num-samples") == 0 && has) { if (!parse_num(a, argv[++i], 0, INT64_MAX, &num_samples)) return 2; }
        else if (strcmp(a, "--train-iters") == 0 && has) { if (!parse_num(a, argv[++i], 0, INT64_MAX, &train_iters)) return 2; }
        else if (strcmp(a, "--global-batch-size") == 0 && has) { if (!parse_num(a, argv[++i], 1, INT64_MAX, &gbs)) return 2; }
        else if (strcmp(a, "--eval-interval") == 0 && has) { if (!parse_num(a, argv[++i], 0, INT64_MAX, &eval_interval)) return 2; }
        else if (strcmp(a, "--eval-iters") == 0 && has) { if (!parse_num(a, argv[++i], 0, INT64_MAX, &eval_iters)) return 2; }
        else if (strcmp(a, "--tokenizer-kind") == 0 && has) kind_name = argv[++i];
        else if (strcmp(a, "--output-dir") == 0 && has) out_dir = argv[++i];
        else if (strcmp(a, "--show-split") == 0 && has) {
            const char* s = argv[++i];
            show = strcmp(s, "train") == 0 ? MT_SPLIT_TRAIN : strcmp(s, "valid") == 0 ? MT_SPLIT_VALID
                   : strcmp(s, "test") == 0 ? MT_SPLIT_TEST : -1;
            if (show < 0) return 1 + fail("--show-split must be train, valid or test");
        } else if (a[0] != '-') {
            data_args[num_data_args++] = a;
        } else {
            usage();
            snprintf(msg, sizeof(msg), "unknown or incomplete argument %s", a);
            return 1 + fail(msg);
        }
    }
    if (num_data_args == 0) {
        usage();
        return 1 + fail("no dataset given");
    }
    if (seed < 0 || seed > 4294967295LL) return 1 + fail("--seed must be in [0, 2^32)");

    /* The tokenizer that decodes the samples, loaded first so that a wrong flag fails at once. */
    mt_tokenizer* tok = NULL;
    if (kind_name) { /* the old flag: a tiktoken rank file of this encoding */
        if (tok_args.type) return fail("--tokenizer-kind is the old name of --tokenizer-type TiktokenFileTokenizer --tiktoken-encoding: give one of them");
        fprintf(stderr, "dataset_info: --tokenizer-kind is deprecated; use --tokenizer-type %s --tiktoken-encoding %s\n",
                strcmp(kind_name, "llama3") ? "TiktokenFileTokenizer" : "Llama3Tokenizer", kind_name);
        tok_args.type = strcmp(kind_name, "llama3") ? "TiktokenFileTokenizer" : "Llama3Tokenizer";
        tok_args.tiktoken_encoding = kind_name;
    }
    if (tok_args.type && strcmp(tok_args.type, "NullTokenizer") != 0) {
        if (mt_tokenizer_load_by_type(&tok, &tok_args, &err) != MT_OK) return fail(err.message);
    } else if (!tok_args.type && (tok_args.model || tok_args.vocab_file || tok_args.merge_file)) {
        return fail("tokenizer files given without --tokenizer-type (GPT2BPETokenizer for --vocab-file/--merge-file, "
                    "HuggingFaceTokenizer for a tokenizer.json, ...; see --help)");
    }

    const char** prefixes = (const char**)calloc((size_t)num_data_args, sizeof(char*));
    double* weights = (double*)calloc((size_t)num_data_args, sizeof(double));
    int num_prefixes = 0, weighted = 0;
    if (mt_data_path_parse(num_data_args, data_args, prefixes, weights, &num_prefixes, &weighted, &err) != MT_OK)
        return 1 + fail(err.message); /* a malformed --data-path list */

    /* What is in each dataset. */
    for (int k = 0; k < num_prefixes; k++) {
        mt_indexed_dataset* ds = NULL;
        if (mt_indexed_dataset_open(&ds, prefixes[k], &err) != MT_OK) return fail(err.message);
        print_dataset(ds);
        mt_indexed_dataset_close(ds);
    }
    if (seq_length <= 0) {
        if (out_dir || num_samples >= 0 || train_iters >= 0) return 1 + fail("--seq-length is needed to build samples");
        return 0;
    }

    /* Samples requested per split. */
    int64_t ns[3] = {-1, -1, -1};
    if (num_samples >= 0) {
        ns[0] = ns[1] = ns[2] = 0;
        ns[show] = num_samples;
    } else if (train_iters >= 0) {
        if (gbs <= 0) return fail("--train-iters needs --global-batch-size");
        if (mt_gpt_num_samples(train_iters, eval_interval, eval_iters, gbs, ns, &err) != MT_OK) return fail(err.message);
    }
    mt_gpt_data* d = NULL;
    if (mt_gpt_data_open(&d, num_prefixes, prefixes, weighted ? weights : NULL, split, seq_length, (uint32_t)seed, ns,
                         &err) != MT_OK)
        return fail(err.message);

    const mt_split_matrix* m = mt_gpt_data_split_matrix(d);
    printf("--split \"%s\" -> train %.6g, valid %.6g, test %.6g; --seq-length %d, --seed %lld\n", split,
           m->end[0] - m->begin[0], m->end[1] - m->begin[1], m->end[2] - m->begin[2], seq_length, seed);
    for (int s = 0; s < 3; s++) {
        char req[32];
        if (ns[s] < 0) snprintf(req, sizeof(req), "None");
        else snprintf(req, sizeof(req), "%lld", (long long)ns[s]);
        if (!m->present[s]) {
            printf("%s: empty split\n", mt_split_name(s));
            continue;
        }
        printf("%s: %lld samples (requested %s)%s\n", mt_split_name(s), (long long)mt_gpt_data_num_samples(d, s), req,
               mt_gpt_data_is_blended(d) ? ", blended from:" : "");
        for (int k = 0; k < num_prefixes; k++) {
            const mt_gpt_dataset* g = mt_gpt_data_dataset(d, s, k);
            if (mt_gpt_data_is_blended(d)) {
                int64_t drawn = 0;
                const int16_t* di = mt_gpt_data_blend_dataset_index(d, s);
                for (int64_t i = 0; i < mt_gpt_data_num_samples(d, s); i++) drawn += di[i] == k;
                printf("  [%d] %s: %lld samples drawn%s", k, prefixes[k], (long long)drawn,
                       weighted ? "" : "\n");
                if (weighted) printf(" (weight %g)\n", weights[k]);
                print_mid(g, "      ");
            } else {
                print_mid(g, "  ");
            }
        }
    }

    /* Decode the first samples of the shown split. */
    int32_t* tokens = (int32_t*)malloc(((size_t)seq_length + 1) * sizeof(int32_t));
    int64_t n = mt_gpt_data_num_samples(d, show);
    for (int64_t i = 0; i < samples_to_print && i < n; i++) {
        if (mt_gpt_data_get(d, show, i, tokens, &err) != MT_OK) return fail(err.message);
        printf("%s sample %lld (%d tokens): ", mt_split_name(show), (long long)i, seq_length + 1);
        char* text = NULL;
        size_t len = 0;
        if (tok && mt_tokenizer_decode(tok, tokens, (size_t)seq_length + 1, &text, &len, &err) == MT_OK) {
            print_text(text, len);
            free(text);
        } else {
            if (tok) printf("(cannot decode: %s) ", err.message);
            int show_ids = seq_length + 1 < 32 ? seq_length + 1 : 32;
            for (int j = 0; j < show_ids; j++) printf("%s%d", j ? " " : "[", tokens[j]);
            printf("%s]", show_ids < seq_length + 1 ? " ..." : "");
        }
        printf("\n");
    }
    free(tokens);
    if (tok) mt_tokenizer_free(tok);

    /* The shown split's arrays, as Megatron caches them. */
    if (out_dir) {
        if (!m->present[show]) return fail("the shown split is empty; nothing to write");
        if (ensure_dir(out_dir) != 0) {
            snprintf(msg, sizeof(msg), "cannot create directory %s: %s", out_dir, strerror(errno));
            return fail(msg);
        }
        if (!mt_gpt_data_is_blended(d)) {
            if (mt_gpt_dataset_save_indices(mt_gpt_data_dataset(d, show, 0), out_dir, NULL, &err) != MT_OK)
                return fail(err.message);
            printf("wrote %s/{document,sample,shuffle}_index.npy\n", out_dir);
        } else {
            int64_t size = mt_gpt_data_num_samples(d, show);
            char path[4096], name[32];
            snprintf(path, sizeof(path), "%s/dataset_index.npy", out_dir);
            if (mt_npy_write(path, "<i2", 1, &size, mt_gpt_data_blend_dataset_index(d, show), &err) != MT_OK)
                return fail(err.message);
            snprintf(path, sizeof(path), "%s/dataset_sample_index.npy", out_dir);
            if (mt_npy_write(path, "<i8", 1, &size, mt_gpt_data_blend_sample_index(d, show), &err) != MT_OK)
                return fail(err.message);
            for (int k = 0; k < num_prefixes; k++) {
                snprintf(name, sizeof(name), "%d-", k);
                if (mt_gpt_dataset_save_indices(mt_gpt_data_dataset(d, show, k), out_dir, name, &err) != MT_OK)
                    return fail(err.message);
            }
            printf("wrote %s/dataset_index.npy, dataset_sample_index.npy and <k>-{document,sample,shuffle}_index.npy\n",
                   out_dir);
        }
    }
    mt_gpt_data_close(d);
    free(prefixes);
    free(weights);
    free(data_args);
    return 0;
}
