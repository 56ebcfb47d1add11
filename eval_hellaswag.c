/*
 * eval_hellaswag.c — HellaSwag accuracy of a megatron.c checkpoint, scored the way the standard harness
 * (EleutherAI's lm-evaluation-harness) scores a multiple-choice task on a causal language model.
 *
 *   make eval_hellaswag dev/data/hellaswag_val_full.txt
 *   ./eval_hellaswag --load checkpoints/builtin [--hellaswag dev/data/hellaswag_val_full.txt]
 *                    [--num-examples N] [--bf16] [--examples-per-batch K] [--per-example OUT.tsv]
 *                    [--vocab-file F --merge-file F | --tokenizer-model RANKS] [--no-verify]
 *
 * The items: six lines each (the format of llama.cpp's `perplexity --hellaswag`, dev/data/README in
 * DESIGN.md): the context ("activity label: context"), the gold ending's index 0-3, the four endings.
 * For each ending, as the harness's loglikelihood requests do: context = the context line,
 * continuation = " " + ending; the whole text is tokenized once and the continuation's tokens are
 * those past the context's own tokenization; the model reads (context + continuation) less its last
 * token (cut from the left to the sequence length), and the ending's log-likelihood is the sum of
 * log p(token) over the continuation's tokens, the softmax over the tokenizer's vocabulary (what the
 * model exported with `convert_hf --export` computes: the padded rows are not in it). acc: the
 * ending with the largest sum; acc_norm: the largest sum divided by the ending's length in characters
 * (Unicode code points, as Python's len), the harness's acc_norm. Ties go to the lower index (numpy's
 * argmax).
 *
 * The model's shape and flavour come from the checkpoint's header (prepro/hf_checkpoint.h reads it and
 * the fp32 master weights; tensor/pipeline parallel checkpoints are refused there), after megatron.h's
 * integrity rule (the manifest verified; a refusal names the file; --no-verify reads it anyway, with a
 * warning); the sequence length
 * is the longest item's, rounded up to 64 (at most the model's positions). The logits of each batch
 * come to the host (mt_trainer_logits) and the log-softmax is taken there, in double. fp32 by default
 * (the check against transformers, dev/hellaswag_check.py, wants it); --bf16 is faster.
 * Errors: one line on stderr and exit 1 (bad usage: exit 2).
 */
#include <stdint.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megatron.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"
#define MT_SAFETENSORS_IMPLEMENTATION
#include "prepro/safetensors.h"
#define MT_HF_IMPLEMENTATION
#include "prepro/hf_checkpoint.h"

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3), noreturn))
#endif
static void die(int code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "eval_hellaswag: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(code);
}

typedef struct {
    int label;
    int32_t* tokens[4]; /* context + continuation, whole */
    int length[4];      /* tokens in the row */
    int continuation[4];/* of which the last `continuation` are the ending's */
    int chars[4];       /* the ending's length in code points */
} item;

static int utf8_code_points(const char* s) {
    int n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xc0) != 0x80;
    return n;
}

static int32_t* encode(const mt_tokenizer* tok, const char* text, size_t* count) {
    int32_t* tokens = NULL;
    size_t cap = 0;
    *count = 0;
    if (mt_tokenizer_encode(tok, text, strlen(text), &tokens, count, &cap) < 0) die(1, "out of memory");
    return tokens;
}

/* Reads up to max_items items of the six-line format; returns how many. */
static int read_items(const char* path, const mt_tokenizer* tok, int max_items, item** out) {
    FILE* f = fopen(path, "rb");
    if (!f) die(1, "cannot open %s (make dev/data/hellaswag_val_full.txt unpacks the one in the repository)", path);
    int cap = 1024, n = 0;
    item* items = (item*)malloc(sizeof(item) * (size_t)cap);
    char* lines[6] = {0};
    size_t line_caps[6] = {0};
    long line_no = 0;
    while (n < max_items || max_items <= 0) {
        int got = 0;
        for (; got < 6; got++) {
            ssize_t len = getline(&lines[got], &line_caps[got], f);
            if (len < 0) break;
            line_no++;
            while (len > 0 && (lines[got][len - 1] == '\n' || lines[got][len - 1] == '\r')) lines[got][--len] = 0;
        }
        if (got == 0) break;
        if (got < 6) die(1, "%s: the last item is cut short at line %ld (six lines per item)", path, line_no);
        char* end = NULL;
        long label = strtol(lines[1], &end, 10);
        if (end == lines[1] || *end || label < 0 || label > 3)
            die(1, "%s: line %ld: the label must be 0, 1, 2 or 3", path, line_no - 4);
        if (n == cap) items = (item*)realloc(items, sizeof(item) * (size_t)(cap *= 2));
        if (!items) die(1, "out of memory");
        item* it = &items[n++];
        it->label = (int)label;
        /* the harness's _encode_pair: trailing spaces of the context move to the continuation */
        size_t ctx_len = strlen(lines[0]), spaces = 0;
        while (spaces < ctx_len && lines[0][ctx_len - 1 - spaces] == ' ') spaces++;
        size_t context_count;
        lines[0][ctx_len - spaces] = 0;
        int32_t* context = encode(tok, lines[0], &context_count);
        for (int e = 0; e < 4; e++) {
            size_t whole_len = ctx_len + 1 + strlen(lines[2 + e]) + 1, count;
            char* whole = (char*)malloc(whole_len);
            snprintf(whole, whole_len, "%s%*s %s", lines[0], (int)spaces, "", lines[2 + e]);
            it->tokens[e] = encode(tok, whole, &count);
            free(whole);
            if (count <= context_count || memcmp(it->tokens[e], context, sizeof(int32_t) * context_count) != 0) {
                /* the whole text's tokens do not start with the context's: the harness still takes the
                 * tokens past the context's count as the continuation; so do we, and say so */
                fprintf(stderr, "eval_hellaswag: note: item %d ending %d: the context's tokens are not a prefix\n",
                        n - 1, e);
            }
            if (count <= context_count) die(1, "%s: an ending before line %ld tokenizes to nothing", path, line_no);
            it->length[e] = (int)count;
            it->continuation[e] = (int)(count - context_count);
            it->chars[e] = utf8_code_points(lines[2 + e]);
            if (it->chars[e] == 0) die(1, "%s: an empty ending at line %ld", path, line_no - 3 + e);
        }
        free(context);
    }
    for (int k = 0; k < 6; k++) free(lines[k]);
    fclose(f);
    *out = items;
    return n;
}

int main(int argc, char** argv) {
    const char* load = NULL;
    const char* data_path = "dev/data/hellaswag_val_full.txt";
    const char* vocab_file = "dev/data/gpt2/gpt2-vocab.json";
    const char* merge_file = "dev/data/gpt2/gpt2-merges.txt";
    const char* tokenizer_model = NULL;
    const char* per_example = NULL;
    long num_examples = 0, per_batch = 2;
    int bf16 = 0, no_verify = 0;
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: eval_hellaswag --load CKPT_DIR [--hellaswag FILE] [--num-examples N] [--bf16]\n"
                   "                      [--examples-per-batch K] [--per-example OUT.tsv]\n"
                   "                      [--vocab-file F --merge-file F | --tokenizer-model RANKS] [--no-verify]\n"
                   "  --no-verify  read a checkpoint whose manifest check fails (or that lost the manifest it was\n"
                   "               saved with) anyway, with a warning\n");
            return 0;
        }
        if (!strcmp(a, "--bf16")) { bf16 = 1; continue; }
        if (!strcmp(a, "--no-verify")) { no_verify = 1; continue; }
        /* the flags below, each with a value: an unknown one is named as such, not as missing its value */
        static const char* const known[] = {"--load", "--hellaswag", "--vocab-file", "--merge-file", "--tokenizer-model",
                                            "--per-example", "--num-examples", "--examples-per-batch"};
        int is_known = 0;
        for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++) is_known |= !strcmp(a, known[k]);
        if (!is_known) die(2, "unknown flag %s (see --help)", a);
        if (i + 1 >= argc) die(2, "%s needs a value", a);
        const char* v = argv[++i];
        char* end = NULL;
        if (!strcmp(a, "--load")) load = v;
        else if (!strcmp(a, "--hellaswag")) data_path = v;
        else if (!strcmp(a, "--vocab-file")) vocab_file = v;
        else if (!strcmp(a, "--merge-file")) merge_file = v;
        else if (!strcmp(a, "--tokenizer-model")) tokenizer_model = v;
        else if (!strcmp(a, "--per-example")) per_example = v;
        else if (!strcmp(a, "--num-examples")) {
            num_examples = strtol(v, &end, 10);
            if (end == v || *end || num_examples < 1 || num_examples > 1000000) die(2, "--num-examples %s: must be in [1, 1000000]", v);
        } else if (!strcmp(a, "--examples-per-batch")) {
            per_batch = strtol(v, &end, 10);
            if (end == v || *end || per_batch < 1 || per_batch > 256) die(2, "--examples-per-batch %s: must be in [1, 256]", v);
        }
    }
    if (!load) die(2, "--load CKPT_DIR is required");

    mt_error err;
    mt_tokenizer* tok = NULL;
    mt_tokenizer_kind kind = MT_TOKENIZER_GPT2;
    if (tokenizer_model) {
        if (!mt_tokenizer_kind_from_path(tokenizer_model, &kind))
            die(2, "--tokenizer-model %s: cannot tell the encoding from the name", tokenizer_model);
        if (mt_tokenizer_load_tiktoken(&tok, tokenizer_model, kind, &err) != MT_OK) die(1, "%s", err.message);
    } else if (mt_tokenizer_load_gpt2(&tok, vocab_file, merge_file, &err) != MT_OK) {
        die(1, "%s", err.message);
    }
    int64_t V = mt_tokenizer_vocab_size(tok);

    mt_config c;
    float* params = NULL;
    int64_t header[MT_CK_HEADER_WORDS];
    mt_error warning;
    mt_status read = mt_hf_checkpoint_read(load, -1, no_verify, &c, &params, header, &warning, &err);
    if (warning.message[0]) fprintf(stderr, "eval_hellaswag: warning: %s\n", warning.message);
    if (read != MT_OK) die(1, "%s", err.message);
    if (header[MT_CK_TRUE_VOCAB] > 0 && header[MT_CK_TRUE_VOCAB] != V) {
        die(1, "the checkpoint was trained with a vocabulary of %lld, the tokenizer has %lld",
            (long long)header[MT_CK_TRUE_VOCAB], (long long)V);
    }
    if (V > c.padded_vocab_size) die(1, "the tokenizer's vocabulary is larger than the model's");

    item* items = NULL;
    int n = read_items(data_path, tok, (int)num_examples, &items);
    if (n == 0) die(1, "%s holds no items", data_path);
    int longest = 0;
    for (int i = 0; i < n; i++)
        for (int e = 0; e < 4; e++) if (items[i].length[e] - 1 > longest) longest = items[i].length[e] - 1;
    int S = (longest + 63) / 64 * 64;
    if (S > c.max_position_embeddings) S = c.max_position_embeddings;
    for (int i = 0; i < n; i++)
        for (int e = 0; e < 4; e++)
            if (items[i].continuation[e] > S)
                die(1, "item %d: ending %d has %d tokens, more than the model's %d positions", i, e, items[i].continuation[e], S);
    int B = 4 * (int)per_batch;
    c.seq_length = S;
    c.micro_batch_size = B;
    c.global_batch_size = B;
    c.train_iters = 1;
    c.lr = 1e-4;
    c.precision = bf16 ? MT_BF16 : MT_FP32;
    int gpus = 0; /* the inputs are checked: a machine without a GPU or driver is told so in our words */
    if (mt_device_check(&gpus, &err) != MT_OK) die(1, "%s", err.message);
    mt_trainer* t = NULL;
    if (mt_config_finalize(&c, &err) != MT_OK || mt_trainer_create(&t, &c, &err) != MT_OK ||
        mt_trainer_set_parameters(t, params, &err) != MT_OK)
        die(1, "%s", err.message);
    free(params);
    int64_t Vp = c.padded_vocab_size;
    printf("hellaswag: %d items of %s; model %d layers, hidden %d, %s; sequence %d, %d rows a batch\n", n, data_path,
           c.num_layers, c.hidden_size, bf16 ? "bf16" : "fp32", S, B);

    int32_t* rows = (int32_t*)calloc((size_t)B * S, sizeof(int32_t));
    float* logits = (float*)malloc(sizeof(float) * (size_t)B * S * (size_t)Vp);
    double* loglik = (double*)malloc(sizeof(double) * (size_t)n * 4);
    if (!rows || !logits || !loglik) die(1, "out of memory for a batch of %d rows", B);
    for (int first = 0; first < n; first += (int)per_batch) {
        int count = n - first < per_batch ? n - first : (int)per_batch;
        memset(rows, 0, sizeof(int32_t) * (size_t)B * S);
        for (int r = 0; r < 4 * count; r++) { /* inputs: the row less its last token, cut from the left */
            const item* it = &items[first + r / 4];
            int e = r % 4, len = it->length[e] - 1, skip = len > S ? len - S : 0;
            memcpy(rows + (size_t)r * S, it->tokens[e] + skip, sizeof(int32_t) * (size_t)(len - skip));
        }
        if (mt_trainer_logits(t, rows, logits, &err) != MT_OK) die(1, "%s", err.message);
        for (int r = 0; r < 4 * count; r++) {
            const item* it = &items[first + r / 4];
            int e = r % 4, len = it->length[e] - 1, skip = len > S ? len - S : 0;
            double sum = 0.0;
            for (int k = it->length[e] - it->continuation[e]; k < it->length[e]; k++) {
                const float* x = logits + ((size_t)r * S + (size_t)(k - 1 - skip)) * (size_t)Vp; /* predicts token k */
                double mx = -INFINITY, z = 0.0;
                for (int64_t v = 0; v < V; v++) if (x[v] > mx) mx = x[v];
                for (int64_t v = 0; v < V; v++) z += exp((double)x[v] - mx);
                sum += (double)x[it->tokens[e][k]] - mx - log(z);
            }
            loglik[(size_t)(first + r / 4) * 4 + e] = sum;
        }
        if ((first / per_batch + 1) % 250 == 0) {
            printf("  %d/%d items\n", first + count, n);
            fflush(stdout);
        }
    }

    FILE* out = per_example ? fopen(per_example, "w") : NULL;
    if (per_example && !out) die(1, "cannot write %s", per_example);
    if (out) fprintf(out, "item\tlabel\tpred\tpred_norm\tloglik0\tloglik1\tloglik2\tloglik3\ttokens0\ttokens1\ttokens2\ttokens3\tchars0\tchars1\tchars2\tchars3\n");
    int correct = 0, correct_norm = 0;
    for (int i = 0; i < n; i++) {
        const double* ll = loglik + (size_t)i * 4;
        int pred = 0, pred_norm = 0;
        for (int e = 1; e < 4; e++) {
            if (ll[e] > ll[pred]) pred = e;
            if (ll[e] / items[i].chars[e] > ll[pred_norm] / items[i].chars[pred_norm]) pred_norm = e;
        }
        correct += pred == items[i].label;
        correct_norm += pred_norm == items[i].label;
        if (out) {
            fprintf(out, "%d\t%d\t%d\t%d", i, items[i].label, pred, pred_norm);
            for (int e = 0; e < 4; e++) fprintf(out, "\t%.9g", ll[e]);
            for (int e = 0; e < 4; e++) fprintf(out, "\t%d", items[i].continuation[e]);
            for (int e = 0; e < 4; e++) fprintf(out, "\t%d", items[i].chars[e]);
            fprintf(out, "\n");
        }
    }
    if (out && fclose(out) != 0) die(1, "cannot write %s", per_example);
    printf("hellaswag: %d items | acc %.4f (%d) | acc_norm %.4f (%d)\n", n, (double)correct / n, correct,
           (double)correct_norm / n, correct_norm);
    for (int i = 0; i < n; i++)
        for (int e = 0; e < 4; e++) free(items[i].tokens[e]);
    free(items);
    free(rows);
    free(logits);
    free(loglik);
    mt_trainer_free(t);
    mt_tokenizer_free(tok);
    return 0;
}
