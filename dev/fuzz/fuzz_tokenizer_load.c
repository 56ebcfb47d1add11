/*
 * fuzz_tokenizer_load — the tokenizer loaders on hostile files, then encoding and decoding with
 * whatever they accept: GPT2BPETokenizer (encoder.json + vocab.bpe), HuggingFaceTokenizer (a
 * directory with tokenizer.json and tokenizer_config.json), a tiktoken rank file (as r50k, cl100k,
 * o200k or Llama-3) and Megatron's TikTokenizer JSON list (pattern, vocabulary size and special
 * token count from the input).
 *
 * Input: one byte (bits 0-1 the loader; bits 2-3 the tiktoken encoding; bit 4 the TikTokenizer
 * pattern v1; bit 5 Hugging Face without special tokens), then the parts joined by FZ_SEP:
 *   GPT-2:        encoder.json, vocab.bpe, text
 *   Hugging Face: tokenizer.json, tokenizer_config.json, text (an empty config part: no such file)
 *   tiktoken:     rank file, text
 *   TikTokenizer: vocab.json, options (vocab size and special tokens, 2 bytes each), text
 */
#include "fuzz_common.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

static void fz_use(mt_tokenizer* tok, const uint8_t* text, size_t n) {
    const int64_t vocab = mt_tokenizer_vocab_size(tok);
    FZ_ASSERT(vocab > 0, "a tokenizer of %lld ids", (long long)vocab);
    char* copy = (char*)malloc(n ? n : 1);
    memcpy(copy, text, n);
    int32_t* ids = NULL;
    size_t count = 0, cap = 0;
    int64_t got = mt_tokenizer_encode(tok, copy, n, &ids, &count, &cap);
    FZ_ASSERT(got >= 0 && (size_t)got == count, "encode returned %lld for %zu ids", (long long)got, count);
    for (size_t i = 0; i < count; i++) FZ_ASSERT(ids[i] >= 0 && ids[i] < vocab, "id %d of %lld at %zu", ids[i], (long long)vocab, i);
    char* back = NULL;
    size_t back_n = 0;
    mt_error err;
    FZ_ASSERT(mt_tokenizer_decode(tok, ids, count, &back, &back_n, &err) == MT_OK, "decode of encoded ids: %s", err.message);
    fz_touch(back, back_n + 1);
    free(back);
    for (int32_t id = -1; id <= (vocab < 300 ? vocab : 300); id++) {
        const char* bytes = NULL;
        size_t len = mt_tokenizer_token_bytes(tok, id, &bytes);
        if (len) {
            fz_touch(bytes, len);
            int32_t again = mt_tokenizer_token_id(tok, bytes, len);
            FZ_ASSERT(again >= -1 && again < vocab, "token_id %d", again);
        }
    }
    int32_t eod = mt_tokenizer_eod(tok), bos = mt_tokenizer_bos(tok);
    FZ_ASSERT(eod >= -1 && eod < vocab && bos >= -1 && bos < vocab, "eod %d, bos %d of %lld", eod, bos, (long long)vocab);
    free(ids);
    free(copy);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const uint8_t opt = data[0];
    fz_parts p;
    fz_split(data + 1, size - 1, &p);
    size_t n0, n1, n2;
    const uint8_t* a = fz_part(&p, 0, &n0);
    const uint8_t* b = fz_part(&p, 1, &n1);
    const uint8_t* c = fz_part(&p, 2, &n2);
    fz_reset();
    char pa[4200], pb[4200];
    mt_tokenizer* tok = NULL;
    mt_error err;
    mt_status st;
    const uint8_t* text = c;
    size_t ntext = n2;
    switch (opt & 3) {
    case 0:
        fz_write("encoder.json", a, n0, pa, sizeof(pa));
        fz_write("vocab.bpe", b, n1, pb, sizeof(pb));
        st = mt_tokenizer_load_gpt2(&tok, pa, pb, &err);
        break;
    case 1:
        fz_write("hf/tokenizer.json", a, n0, pa, sizeof(pa));
        if (n1) fz_write("hf/tokenizer_config.json", b, n1, pb, sizeof(pb));
        fz_path("hf", pb, sizeof(pb));
        st = mt_tokenizer_load_hf(&tok, pb, !((opt >> 5) & 1), &err);
        break;
    case 2: {
        static const mt_tokenizer_kind kinds[4] = {MT_TOKENIZER_GPT2, MT_TOKENIZER_CL100K, MT_TOKENIZER_O200K, MT_TOKENIZER_LLAMA3};
        fz_write("ranks.tiktoken", a, n0, pa, sizeof(pa));
        st = mt_tokenizer_load_tiktoken(&tok, pa, kinds[(opt >> 2) & 3], &err);
        text = b;
        ntext = n1;
        break;
    }
    default: {
        fz_write("vocab.json", a, n0, pa, sizeof(pa));
        fz_bytes o = {b, n1};
        mt_tiktokenizer_options to;
        mt_tiktokenizer_options_init(&to);
        to.pattern = (opt >> 4) & 1 ? "v1" : "v2";
        to.vocab_size = (int64_t)fz_take(&o, 2) + 1;   /* 1 .. 65536 */
        to.num_special_tokens = (int64_t)fz_take(&o, 2); /* 0 .. 65535 */
        st = mt_tokenizer_load_tiktokenizer(&tok, pa, &to, &err);
        break;
    }
    }
    if (st == MT_OK) {
        fz_use(tok, text, ntext);
        mt_tokenizer_free(tok);
    } else {
        FZ_ASSERT(tok == NULL, "a failed load left a tokenizer");
        fz_check_error(&err);
    }
    return 0;
}
