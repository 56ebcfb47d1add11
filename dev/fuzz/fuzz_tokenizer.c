/*
 * fuzz_tokenizer — encoding and decoding arbitrary bytes with the project's tokenizers, loaded from
 * the repository's files: GPT2BPETokenizer (dev/data/gpt2), the Hugging Face tokenizer.json files
 * of dev/data/tokenizers/ (GPT-2, Llama-2/Mistral sentencepiece BPE, Llama-3, Mistral-Nemo, Qwen2)
 * and Megatron's TikTokenizer (v1 and v2 patterns).
 *
 * Checks: every id is in [0, vocab); decode(encode(text)) gives the text back, where the tokenizer
 * promises it (the template's BOS taken off; invalid UTF-8 first replaced as Python's
 * errors='replace' does, by this file's own replacement; Qwen2's NFC normalizer and the
 * sentencepiece tokenizers' leading-space rules are exempt: their decode is not an inverse);
 * decoding the input's bytes read as ids never reads out of bounds and refuses unknown ids.
 *
 * Input: one byte choosing the tokenizer, then the text.
 */
#include "fuzz_common.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

typedef struct {
    const char* name;
    mt_tokenizer* tok;
    int round_trip; /* decode(encode(x)) == x for valid UTF-8 x */
} fz_tok;

static fz_tok fz_toks[16];
static int fz_num_toks;

static void fz_add(const char* name, mt_status st, mt_tokenizer* tok, const mt_error* err, int round_trip) {
    if (st != MT_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s: %s (run from the repository root)\n", name, err->message);
        abort();
    }
    fz_toks[fz_num_toks].name = name;
    fz_toks[fz_num_toks].tok = tok;
    fz_toks[fz_num_toks++].round_trip = round_trip;
}

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    mt_error err;
    mt_tokenizer* t = NULL;
    mt_status st = mt_tokenizer_load_gpt2(&t, "dev/data/gpt2/gpt2-vocab.json", "dev/data/gpt2/gpt2-merges.txt", &err);
    fz_add("GPT2BPETokenizer", st, t, &err, 1);
    static const struct { const char* dir; int round_trip; } hf[] = {
        {"dev/data/tokenizers/gpt2", 1},           {"dev/data/tokenizers/llama3", 1},
        {"dev/data/tokenizers/mistral_nemo", 1},   {"dev/data/tokenizers/qwen2", 0},
        {"dev/data/tokenizers/llama2_metaspace", 0}, {"dev/data/tokenizers/metaspace_split", 0},
        {"dev/data/tokenizers/mistral", 0},
    };
    for (size_t k = 0; k < sizeof(hf) / sizeof(hf[0]); k++) {
        st = mt_tokenizer_load_hf(&t, hf[k].dir, 1, &err);
        fz_add(hf[k].dir, st, t, &err, hf[k].round_trip);
    }
    mt_tiktokenizer_options o;
    mt_tiktokenizer_options_init(&o);
    o.vocab_size = 4096 + 1000; /* the test vocabulary holds 4096 ranks */
    o.pattern = "v1";
    st = mt_tokenizer_load_tiktokenizer(&t, "dev/data/tokenizers/tiktokenizer/vocab.json", &o, &err);
    fz_add("TikTokenizer v1", st, t, &err, 1);
    o.pattern = "v2";
    st = mt_tokenizer_load_tiktokenizer(&t, "dev/data/tokenizers/tiktokenizer/vocab.json", &o, &err);
    fz_add("TikTokenizer v2", st, t, &err, 1);
    return 0;
}

/* Python's bytes.decode('utf-8', errors='replace').encode(): each maximal invalid subpart (Unicode
 * Table 3-7's well-formed sequences) becomes EF BF BD. Written here afresh, not the tokenizer's. */
static uint8_t* fz_utf8_replace(const uint8_t* s, size_t n, size_t* out_n, int* changed) {
    uint8_t* out = (uint8_t*)malloc(3 * n + 1);
    size_t o = 0;
    *changed = 0;
    for (size_t i = 0; i < n;) {
        uint8_t b = s[i];
        size_t need = 0;
        uint8_t lo = 0x80, hi = 0xBF;
        if (b < 0x80) { out[o++] = b; i++; continue; }
        if (b >= 0xC2 && b <= 0xDF) need = 1;
        else if (b >= 0xE0 && b <= 0xEF) { need = 2; lo = b == 0xE0 ? 0xA0 : 0x80; hi = b == 0xED ? 0x9F : 0xBF; }
        else if (b >= 0xF0 && b <= 0xF4) { need = 3; lo = b == 0xF0 ? 0x90 : 0x80; hi = b == 0xF4 ? 0x8F : 0xBF; }
        size_t k = 1;
        while (need && k <= need && i + k < n) {
            uint8_t c = s[i + k];
            if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
            k++;
        }
        if (need && k == need + 1) { memcpy(out + o, s + i, k); o += k; i += k; continue; }
        out[o++] = 0xEF; out[o++] = 0xBF; out[o++] = 0xBD;
        *changed = 1;
        i += k; /* the lead byte and the continuation bytes that were still valid */
    }
    *out_n = o;
    return out;
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1 || size > 1 << 16) return 0;
    const fz_tok* T = &fz_toks[data[0] % fz_num_toks];
    const uint8_t* text = data + 1;
    size_t n = size - 1;
    /* the text in its own allocation, so that a read past its end is seen */
    char* copy = (char*)malloc(n ? n : 1);
    memcpy(copy, text, n);
    int32_t* ids = NULL;
    size_t count = 0, cap = 0;
    int64_t got = mt_tokenizer_encode(T->tok, copy, n, &ids, &count, &cap);
    FZ_ASSERT(got >= 0 && (size_t)got == count, "%s: encode returned %lld for %zu ids", T->name, (long long)got, count);
    const int64_t vocab = mt_tokenizer_vocab_size(T->tok);
    for (size_t i = 0; i < count; i++) FZ_ASSERT(ids[i] >= 0 && ids[i] < vocab, "%s: id %d at %zu", T->name, ids[i], i);
    /* the template's prefix: what an empty text encodes to (BOS), when the text's ids start with it */
    int32_t* empty = NULL;
    size_t nempty = 0, cap_empty = 0;
    mt_tokenizer_encode(T->tok, "", 0, &empty, &nempty, &cap_empty);
    size_t skip = nempty <= count && (nempty == 0 || !memcmp(ids, empty, nempty * sizeof(int32_t))) ? nempty : 0;
    char* back = NULL;
    size_t back_n = 0;
    mt_error err;
    FZ_ASSERT(mt_tokenizer_decode(T->tok, ids + skip, count - skip, &back, &back_n, &err) == MT_OK, "%s: decode: %s", T->name,
              err.message);
    if (T->round_trip) {
        size_t want_n = 0;
        int changed = 0;
        uint8_t* want = fz_utf8_replace(text, n, &want_n, &changed);
        FZ_ASSERT(back_n == want_n && !memcmp(back, want, want_n), "%s: decode(encode(text)) is not the text (%zu bytes, %zu back)",
                  T->name, want_n, back_n);
        free(want);
    }
    free(back);
    free(empty);
    /* the input's bytes as ids: in range decodes, out of range is refused */
    size_t nids = n / 4;
    int32_t* raw = (int32_t*)malloc((nids ? nids : 1) * sizeof(int32_t));
    memcpy(raw, text, nids * 4);
    int in_range = 1;
    for (size_t i = 0; i < nids; i++) {
        if (raw[i] % 2 == 0) raw[i] = (int32_t)(((uint32_t)raw[i] >> 1) % (uint32_t)(vocab + 2)) - 1; /* mostly in range */
        in_range &= raw[i] >= 0 && raw[i] < vocab;
    }
    mt_status st = mt_tokenizer_decode(T->tok, raw, nids, &back, &back_n, &err);
    if (st == MT_OK) {
        fz_touch(back, back_n + 1);
        free(back);
    } else {
        fz_check_error(&err);
    }
    free(raw);
    free(ids);
    free(copy);
    return 0;
}
