/* tests/test_tokenizer.h — host tests of prepro/tokenizer.h: every tokenizer against its reference
 * library's ids (tiktoken for the rank files, Hugging Face's tokenizers for tokenizer.json and
 * GPT2BPETokenizer, tiktoken with Megatron's settings for TikTokenizer; vectors from
 * dev/gen_tokenizer_vectors.py and dev/gen_hf_tokenizer_vectors.py), on hundreds of short hostile
 * cases and on large held-out texts (tiny shakespeare, 1.1 MB, always; four Gutenberg books, 3.3 MB,
 * when the shared data is there); decoding; thread safety; load errors and refusals; the JSONL
 * parser and the preprocess_data pipeline (worker-count independence, empty documents, bad lines,
 * .gz/.zst input, the --max-line-bytes limit, cancellation inside the encoder and of a whole run). The rank files and books are read from the shared data directory
 * ($MT_SHARED_DATA, else ../shared/data) and those tests skip without it. Run from the repo root. */
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#define TT_GPT2_VOCAB "dev/data/gpt2/gpt2-vocab.json"
#define TT_GPT2_MERGES "dev/data/gpt2/gpt2-merges.txt"
#define TT_VECTORS "dev/data/tokenizer/"
#define TT_HF "dev/data/tokenizers/"

typedef struct {
    const char* name;  /* vector file name */
    const char* rank_file; /* under the shared data directory */
    mt_tokenizer_kind kind;
    int64_t vocab;
    int32_t eod;
} tt_spec;

static const tt_spec tt_specs[4] = {
    {"gpt2", "tiktoken/r50k_base.tiktoken", MT_TOKENIZER_GPT2, 50257, 50256},
    {"cl100k_base", "tiktoken/cl100k_base.tiktoken", MT_TOKENIZER_CL100K, 100277, 100257},
    {"o200k_base", "tiktoken/o200k_base.tiktoken", MT_TOKENIZER_O200K, 200019, 199999},
    {"llama3", "llama3/tokenizer.model", MT_TOKENIZER_LLAMA3, 128256, 128001},
};

static int tt_exists(const char* path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* A file of the shared data: $MT_SHARED_DATA/rel, else ../shared/data/rel. */
static const char* tt_shared(const char* rel, char* buf, size_t n) {
    const char* env = getenv("MT_SHARED_DATA");
    snprintf(buf, n, "%s/%s", env && env[0] ? env : "../shared/data", rel);
    return buf;
}

static uint32_t tt_u32(const char* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static uint64_t tt_u64(const char* p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static uint64_t tt_fnv(const void* data, size_t n) {
    const uint8_t* p = (const uint8_t*)data;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001B3ull;
    return h;
}

/* Checks every case of a vector file ("MTTOKV1": text, expected ids); returns the number of
 * mismatches (printing the first few), or -1 if the file is unreadable. */
static int tt_check_cases(const mt_tokenizer* tok, const char* path, int* num_cases) {
    size_t size = 0;
    char* buf = test_read_file(path, &size);
    if (!buf || size < 12 || memcmp(buf, "MTTOKV1", 8) != 0) { free(buf); return -1; }
    uint32_t n = tt_u32(buf + 8);
    size_t o = 12;
    int bad = 0;
    int32_t* toks = NULL;
    size_t count = 0, cap = 0;
    for (uint32_t c = 0; c < n; c++) {
        if (o + 4 > size) { bad = -1; break; }
        uint32_t bl = tt_u32(buf + o);
        const char* text = buf + o + 4;
        o += 4 + bl;
        if (o + 4 > size) { bad = -1; break; }
        uint32_t nt = tt_u32(buf + o);
        const char* ids = buf + o + 4;
        o += 4 + 4 * (size_t)nt;
        if (o > size) { bad = -1; break; }
        count = 0;
        int64_t got = mt_tokenizer_encode(tok, text, bl, &toks, &count, &cap);
        if (got != (int64_t)nt || (nt && memcmp(toks, ids, 4 * (size_t)nt) != 0)) {
            if (bad < 3) {
                size_t k = 0;
                while (k < count && k < nt && toks[k] == (int32_t)tt_u32(ids + 4 * k)) k++;
                printf("    %s case %u (%u bytes '%.40s...'): %lld tokens, expected %u; first difference at token %zu\n", path, c,
                       bl, text, (long long)got, nt, k);
            }
            bad++;
        }
    }
    free(toks);
    free(buf);
    *num_cases = (int)n;
    return bad;
}

/* Checks the large texts of a texts file ("MTTOKH1": name, byte length and hash, token count, a
 * hash per block of ids) whose text can be read: dev/data files, and "gutenberg:<member>" from
 * gut_dir (NULL: skipped). Each text is encoded in one call. Returns the mismatches (printing the
 * first block that differs), or -1 if unreadable; *checked gets the texts compared, *bytes their size. */
static int tt_check_texts(const mt_tokenizer* tok, const char* path, const char* gut_dir, int* checked, size_t* bytes) {
    size_t size = 0;
    char* buf = test_read_file(path, &size);
    *checked = 0;
    *bytes = 0;
    if (!buf || size < 12 || memcmp(buf, "MTTOKH1", 8) != 0) { free(buf); return -1; }
    uint32_t n = tt_u32(buf + 8);
    size_t o = 12, cap = 0, count = 0;
    int bad = 0;
    int32_t* ids = NULL;
    for (uint32_t t = 0; t < n && bad >= 0; t++) {
        if (o + 4 > size) { bad = -1; break; }
        uint32_t nl = tt_u32(buf + o);
        char name[512], file[1024];
        snprintf(name, sizeof(name), "%.*s", (int)(nl < 500 ? nl : 500), buf + o + 4);
        o += 4 + nl;
        if (o + 32 > size) { bad = -1; break; }
        uint64_t blen = tt_u64(buf + o), bhash = tt_u64(buf + o + 8), ntok = tt_u64(buf + o + 16);
        uint32_t block = tt_u32(buf + o + 24), nblocks = tt_u32(buf + o + 28);
        const char* hashes = buf + o + 32;
        o += 32 + 8 * (size_t)nblocks;
        if (o > size || block == 0) { bad = -1; break; }
        if (!strncmp(name, "gutenberg:", 10)) {
            if (!gut_dir) continue;
            snprintf(file, sizeof(file), "%s/%s", gut_dir, name + 10);
        } else {
            snprintf(file, sizeof(file), "%s", name);
        }
        size_t tl = 0;
        char* text = test_read_file(file, &tl);
        if (!text || tl != blen || tt_fnv(text, tl) != bhash) {
            printf("    %s: %s is missing or not the text the vectors were made from\n", path, file);
            free(text);
            bad++;
            continue;
        }
        count = 0;
        int64_t got = mt_tokenizer_encode(tok, text, tl, &ids, &count, &cap);
        int ok = got == (int64_t)ntok;
        for (uint32_t b = 0; b < nblocks && ok; b++) {
            size_t s0 = (size_t)b * block, s1 = s0 + block < count ? s0 + block : count;
            if (s0 >= count || tt_fnv(ids + s0, 4 * (s1 - s0)) != tt_u64(hashes + 8 * (size_t)b)) {
                printf("    %s: %s: tokens %zu..%zu differ\n", path, name, s0, s1);
                ok = 0;
            }
        }
        if (!ok) {
            if (got != (int64_t)ntok) printf("    %s: %s: %lld tokens, expected %llu\n", path, name, (long long)got, (unsigned long long)ntok);
            bad++;
        }
        (*checked)++;
        *bytes += tl;
        free(text);
    }
    free(ids);
    free(buf);
    return bad;
}

static int tt_check_vectors(const mt_tokenizer* tok, const char* name, int* num_cases) {
    char path[256];
    snprintf(path, sizeof(path), TT_VECTORS "%s.bin", name);
    return tt_check_cases(tok, path, num_cases);
}

/* A tiktoken rank file against tiktoken's encode_ordinary ids. */
static test_result tt_vectors(int which) {
    const tt_spec* s = &tt_specs[which];
    mt_tokenizer* tok = NULL;
    mt_error err;
    char path[512];
    if (!tt_exists(tt_shared(s->rank_file, path, sizeof(path)))) SKIP("%s not found (shared data absent)", path);
    EXPECT_OK(mt_tokenizer_load_tiktoken(&tok, path, s->kind, &err), &err);
    int64_t vocab = mt_tokenizer_vocab_size(tok);
    int32_t eod = mt_tokenizer_eod(tok);
    mt_tokenizer_kind kind = mt_tokenizer_get_kind(tok);
    int cases = 0;
    int bad = tt_check_vectors(tok, s->name, &cases);
    mt_tokenizer_free(tok);
    EXPECT(vocab == s->vocab, "vocab size %lld, expected %lld", (long long)vocab, (long long)s->vocab);
    EXPECT(eod == s->eod, "eod %d, expected %d", eod, s->eod);
    EXPECT(kind == s->kind, "kind %d", (int)kind);
    EXPECT(bad >= 0, "cannot read " TT_VECTORS "%s.bin", s->name);
    EXPECT(bad == 0, "%d of %d %s cases differ from tiktoken", bad, cases, s->name);
    EXPECT(cases > 300, "only %d cases", cases);
    return TEST_PASS;
}

static test_result test_tokenizer_r50k_base(void) { return tt_vectors(0); }
static test_result test_tokenizer_cl100k_base(void) { return tt_vectors(1); }
static test_result test_tokenizer_o200k_base(void) { return tt_vectors(2); }
static test_result test_tokenizer_llama3(void) { return tt_vectors(3); }

/* A tokenizer's cases and large texts from dev/data/tokenizers/<dir>/ (cases_file, texts_file). */
static test_result tt_check_dir(const mt_tokenizer* tok, const char* dir, const char* cases_file, const char* texts_file, const char* gut_dir,
                                int min_texts) {
    char path[256];
    int cases = 0, texts = 0;
    size_t bytes = 0;
    snprintf(path, sizeof(path), TT_HF "%s/%s", dir, cases_file);
    int bad = tt_check_cases(tok, path, &cases);
    EXPECT(bad >= 0, "cannot read %s", path);
    EXPECT(bad == 0, "%d of %d cases of %s differ from the reference library", bad, cases, path);
    EXPECT(cases > 400, "only %d cases in %s", cases, path);
    snprintf(path, sizeof(path), TT_HF "%s/%s", dir, texts_file);
    bad = tt_check_texts(tok, path, gut_dir, &texts, &bytes);
    EXPECT(bad >= 0, "cannot read %s", path);
    EXPECT(bad == 0, "%d large texts of %s differ from the reference library", bad, path);
    EXPECT(texts >= min_texts && bytes >= 1000000, "%d texts (%zu bytes) checked from %s", texts, bytes, path);
    return TEST_PASS;
}

/* GPT2BPETokenizer (encoder.json + vocab.bpe) gives Hugging Face's GPT-2 ids: the same vectors as
 * the GPT-2 tokenizer.json, "<|endoftext|>" in text included. */
static test_result test_tokenizer_gpt2_bpe_files(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    test_result r = tt_check_dir(tok, "gpt2", "cases.bin", "texts.bin", NULL, 1);
    int ok = mt_tokenizer_vocab_size(tok) == 50257 && mt_tokenizer_eod(tok) == 50256 && mt_tokenizer_get_kind(tok) == MT_TOKENIZER_GPT2;
    mt_tokenizer_free(tok);
    EXPECT(ok, "vocab size, eod or kind wrong");
    return r;
}

/* Special-token text: GPT2BPETokenizer (Hugging Face's GPT-2) cuts "<|endoftext|>" out as 50256;
 * a tiktoken rank file encodes it as plain text (encode_ordinary). */
static test_result test_tokenizer_special_tokens(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    const char* b = NULL;
    int32_t* ids = NULL;
    size_t count = 0, cap = 0;
    char path[512];
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    size_t n = mt_tokenizer_token_bytes(tok, 50256, &b);
    EXPECT(n == 13 && memcmp(b, "<|endoftext|>", 13) == 0, "token 50256 is not <|endoftext|>");
    EXPECT(mt_tokenizer_token_id(tok, "<|endoftext|>", 13) == 50256, "lookup of <|endoftext|>");
    EXPECT(mt_tokenizer_token_id(tok, " the", 4) == 262, "' the' is %d", mt_tokenizer_token_id(tok, " the", 4));
    EXPECT(mt_tokenizer_token_bytes(tok, 50257, &b) == 0 && mt_tokenizer_token_bytes(tok, -1, &b) == 0, "out-of-range ids");
    mt_tokenizer_encode(tok, "a<|endoftext|>b", 15, &ids, &count, &cap);
    EXPECT(count == 3 && ids[1] == 50256, "GPT2BPETokenizer: <|endoftext|> inside text gave %zu tokens", count);
    mt_tokenizer_free(tok);
    if (!tt_exists(tt_shared(tt_specs[0].rank_file, path, sizeof(path)))) { free(ids); SKIP("%s not found", path); }
    EXPECT_OK(mt_tokenizer_load_tiktoken(&tok, path, MT_TOKENIZER_GPT2, &err), &err);
    count = 0;
    mt_tokenizer_encode(tok, "<|endoftext|>", 13, &ids, &count, &cap);
    EXPECT(count > 1, "<|endoftext|> encoded to %zu tokens", count);
    for (size_t k = 0; k < count; k++) EXPECT(ids[k] != 50256, "special token produced by ordinary encoding");
    free(ids);
    mt_tokenizer_free(tok);
    if (!tt_exists(tt_shared(tt_specs[3].rank_file, path, sizeof(path)))) SKIP("Llama-3 tokenizer.model not found");
    EXPECT_OK(mt_tokenizer_load_tiktoken(&tok, path, MT_TOKENIZER_LLAMA3, &err), &err);
    EXPECT(mt_tokenizer_token_id(tok, "<|begin_of_text|>", 17) == 128000, "<|begin_of_text|>");
    EXPECT(mt_tokenizer_bos(tok) == 128000, "Llama-3 bos %d", mt_tokenizer_bos(tok));
    EXPECT(mt_tokenizer_token_id(tok, "<|eot_id|>", 10) == 128009, "<|eot_id|>");
    EXPECT(mt_tokenizer_token_id(tok, "<|reserved_special_token_245|>", 30) == 128255, "last reserved token");
    mt_tokenizer_free(tok);
    return TEST_PASS;
}

/* decode(encode(text)) == text for valid UTF-8; invalid UTF-8 encodes like its U+FFFD replacement. */
static test_result test_tokenizer_decode_round_trip(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    size_t size = 0, count = 0, cap = 0, out_len = 0;
    int32_t* ids = NULL;
    char* out = NULL;
    char* text = test_read_file("dev/data/tinyshakespeare.txt", &size);
    EXPECT(text != NULL, "cannot read dev/data/tinyshakespeare.txt");
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    const char* extra = "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd  \r\n\t x";
    const char* texts[2] = {text, extra};
    size_t lens[2] = {size, strlen(extra)};
    for (int t = 0; t < 2; t++) {
        count = 0;
        EXPECT(mt_tokenizer_encode(tok, texts[t], lens[t], &ids, &count, &cap) > 0, "encode failed");
        EXPECT_OK(mt_tokenizer_decode(tok, ids, count, &out, &out_len, &err), &err);
        EXPECT(out_len == lens[t] && memcmp(out, texts[t], out_len) == 0, "round trip %d differs", t);
        free(out);
    }
    int32_t unknown = 0x7fffffff;
    EXPECT(mt_tokenizer_decode(tok, &unknown, 1, &out, &out_len, &err) == MT_ERR_RANGE, "decoding an unknown id must fail");
    /* Invalid UTF-8: each maximal invalid subpart becomes U+FFFD, as Python's errors='replace'. */
    const char* bad = "a\xff" "b\xe2\x82" "c\xed\xa0\x80" "d";
    const char* fixed = "a\xef\xbf\xbd" "b\xef\xbf\xbd" "c\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd" "d";
    int32_t* ids2 = NULL;
    size_t count2 = 0, cap2 = 0;
    count = 0;
    mt_tokenizer_encode(tok, bad, strlen(bad), &ids, &count, &cap);
    mt_tokenizer_encode(tok, fixed, strlen(fixed), &ids2, &count2, &cap2);
    EXPECT(count == count2 && memcmp(ids, ids2, count * sizeof(int32_t)) == 0, "invalid UTF-8 not replaced like Python");
    /* Appending: a second encode adds after the first. */
    count = 0;
    int64_t a = mt_tokenizer_encode(tok, "hello", 5, &ids, &count, &cap);
    int64_t b2 = mt_tokenizer_encode(tok, " world", 6, &ids, &count, &cap);
    EXPECT(a == 1 && b2 == 1 && count == 2 && ids[0] == 31373 && ids[1] == 995, "append: %lld %lld %zu", (long long)a,
           (long long)b2, count);
    EXPECT(mt_tokenizer_encode(tok, NULL, 0, &ids, &count, &cap) == 0 && count == 2, "empty text");
    free(ids);
    free(ids2);
    free(text);
    mt_tokenizer_free(tok);
    return TEST_PASS;
}

typedef struct {
    const mt_tokenizer* tok;
    const char* text;
    size_t len;
    int32_t* ids;
    size_t count;
} tt_thread_arg;

static void* tt_encode_thread(void* p) {
    tt_thread_arg* a = (tt_thread_arg*)p;
    size_t cap = 0;
    for (int rep = 0; rep < 2; rep++) {
        a->count = 0;
        mt_tokenizer_encode(a->tok, a->text, a->len, &a->ids, &a->count, &cap);
    }
    return NULL;
}

/* Four threads encoding one text with one tokenizer get the ids one thread gets: GPT-2, and the
 * Qwen2 (NFC normalizer) and Mistral (whole documents as one piece) tokenizer.json. */
static test_result test_tokenizer_threads(void) {
    mt_error err;
    size_t size = 0;
    char* text = test_read_file("dev/data/tinyshakespeare.txt", &size);
    EXPECT(text != NULL, "cannot read dev/data/tinyshakespeare.txt");
    for (int which = 0; which < 3; which++) {
        mt_tokenizer* tok = NULL;
        size_t count = 0, cap = 0;
        int32_t* ref = NULL;
        if (which == 0) EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
        else EXPECT_OK(mt_tokenizer_load_hf(&tok, which == 1 ? TT_HF "qwen2" : TT_HF "mistral", 1, &err), &err);
        mt_tokenizer_encode(tok, text, size, &ref, &count, &cap);
        EXPECT(count > 300000, "tiny shakespeare: %zu tokens", count);
        enum { NT = 4 };
        pthread_t th[NT];
        tt_thread_arg args[NT];
        for (int t = 0; t < NT; t++) {
            args[t].tok = tok;
            args[t].text = text;
            args[t].len = size;
            args[t].ids = NULL;
            args[t].count = 0;
            EXPECT(pthread_create(&th[t], NULL, tt_encode_thread, &args[t]) == 0, "pthread_create");
        }
        int same = 1;
        for (int t = 0; t < NT; t++) {
            pthread_join(th[t], NULL);
            if (args[t].count != count || memcmp(args[t].ids, ref, count * sizeof(int32_t)) != 0) same = 0;
            free(args[t].ids);
        }
        free(ref);
        mt_tokenizer_free(tok);
        EXPECT(same, "tokenizer %d: threads encoding one text at once got different ids", which);
    }
    free(text);
    return TEST_PASS;
}

/* A scratch directory for files written by a test. */
static int tt_tmpdir(char* dir, size_t n) {
    snprintf(dir, n, "/tmp/mt_tokenizer_test_XXXXXX");
    return mkdtemp(dir) != NULL;
}

static int tt_write(const char* path, const char* content, size_t len) {
    FILE* f = fopen(path, "wb");
    if (!f) return 0;
    size_t w = fwrite(content, 1, len, f);
    fclose(f);
    return w == len;
}

static void tt_rmtree(const char* dir) {
    char cmd[600];
    if (strncmp(dir, "/tmp/mt_tokenizer_test_", 23) != 0) return;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("    (could not remove %s)\n", dir);
}

static test_result test_tokenizer_load_errors(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    char dir[64], path[128], path2[128];
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    mt_status st = mt_tokenizer_load_tiktoken(&tok, "/nonexistent/r50k.tiktoken", MT_TOKENIZER_GPT2, &err);
    EXPECT(st == MT_ERR_IO && strstr(err.message, "/nonexistent/r50k.tiktoken") && tok == NULL, "missing file: %s", err.message);
    st = mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, "/nonexistent/merges.txt", &err);
    EXPECT(st == MT_ERR_IO && strstr(err.message, "/nonexistent/merges.txt"), "missing merges: %s", err.message);

    snprintf(path, sizeof(path), "%s/bad.tiktoken", dir);
    const char* bad = "IQ== 0\nnot-base64! 1\n";
    EXPECT(tt_write(path, bad, strlen(bad)), "write");
    st = mt_tokenizer_load_tiktoken(&tok, path, MT_TOKENIZER_GPT2, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "bad.tiktoken:2:"), "corrupt line: %s", err.message);
    const char* badrank = "IQ== 0\nIg== x1\n";
    EXPECT(tt_write(path, badrank, strlen(badrank)), "write");
    st = mt_tokenizer_load_tiktoken(&tok, path, MT_TOKENIZER_GPT2, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, ":2: bad rank"), "bad rank: %s", err.message);
    const char* few = "IQ== 0\nIg== 1\n"; /* not every byte has a token */
    EXPECT(tt_write(path, few, strlen(few)), "write");
    st = mt_tokenizer_load_tiktoken(&tok, path, MT_TOKENIZER_GPT2, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "single byte"), "incomplete vocabulary: %s", err.message);
    { /* every byte, the last at a rank near 2^31: refused before it sizes the id tables (a fuzz finding:
       * malloc of 8 GB; a single byte needs no merge, so the merges' own limit does not catch it) */
        static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        char sparse[256 * 16 + 64];
        size_t at = 0;
        for (int b = 0; b < 256; b++)
            at += (size_t)snprintf(sparse + at, sizeof(sparse) - at, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4],
                                   b < 255 ? b : 2111111111);
        EXPECT(tt_write(path, sparse, at), "write");
        st = mt_tokenizer_load_tiktoken(&tok, path, MT_TOKENIZER_GPT2, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "2111111111") && strstr(err.message, "sparse"),
               "sparse ranks: %s", err.message);
    }
    char cl100k[512];
    if (tt_exists(tt_shared(tt_specs[1].rank_file, cl100k, sizeof(cl100k)))) { /* cl100k's ranks as GPT-2: <|endoftext|> 50256 is taken */
        st = mt_tokenizer_load_tiktoken(&tok, cl100k, MT_TOKENIZER_GPT2, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "50256"), "wrong encoding: %s", err.message);
    }
    snprintf(path2, sizeof(path2), "%s/vocab.json", dir);
    const char* badjson = "{\"a\": 1, \"b\" 2}";
    EXPECT(tt_write(path2, badjson, strlen(badjson)), "write");
    st = mt_tokenizer_load_gpt2(&tok, path2, TT_GPT2_MERGES, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "vocab.json") && strstr(err.message, "':'"), "bad JSON: %s", err.message);
    snprintf(path, sizeof(path), "%s/merges.txt", dir);
    const char* badmerge = "#version: 0.2\nt h\nqqqqqq zzzzzz\n";
    EXPECT(tt_write(path, badmerge, strlen(badmerge)), "write");
    st = mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, path, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "merges.txt:3:"), "bad merge: %s", err.message);
    mt_tokenizer_kind kind;
    EXPECT(mt_tokenizer_kind_from_name("p50k_base", &kind, &err) == MT_ERR_ARG, "unknown encoding name accepted");
    EXPECT(mt_tokenizer_kind_from_path("/x/cl100k_base.tiktoken", &kind) && kind == MT_TOKENIZER_CL100K, "kind from path");
    EXPECT(mt_tokenizer_kind_from_path("/x/llama3/tokenizer.model", &kind) && kind == MT_TOKENIZER_LLAMA3, "kind from path");
    tt_rmtree(dir);
    return TEST_PASS;
}

/* ---- Hugging Face tokenizer.json and Megatron's TikTokenizer ---- */

typedef struct {
    const char* dir;   /* under dev/data/tokenizers/ */
    int64_t vocab;
    int32_t eod, bos;
    int prefix;        /* tokens the template puts before a text (BOS) */
} tt_hf_spec;

static const tt_hf_spec tt_hf_specs[7] = {
    {"gpt2", 50257, 50256, 50256, 0},         {"llama3", 8448, 8193, 8192, 1},          {"qwen2", 4100, 4096, -1, 0},
    {"mistral_nemo", 5096, 2, 1, 1},          {"mistral", 2051, 2, 1, 1},               {"llama2_metaspace", 2051, 2, 1, 1},
    {"metaspace_split", 2051, 2, 1, 1},
};

/* Each tokenizer.json against the tokenizers library's ids: the cases and tiny shakespeare (the
 * Gutenberg books are test_tokenizer_hf_gutenberg's), its vocabulary size, eos and bos. */
static test_result tt_hf(int which) {
    const tt_hf_spec* s = &tt_hf_specs[which];
    mt_tokenizer* tok = NULL;
    mt_error err;
    char path[256];
    int32_t* ids = NULL;
    size_t count = 0, cap = 0;
    snprintf(path, sizeof(path), TT_HF "%s", s->dir);
    EXPECT_OK(mt_tokenizer_load_hf(&tok, path, 1, &err), &err);
    test_result r = tt_check_dir(tok, s->dir, "cases.bin", "texts.bin", NULL, 1);
    int64_t vocab = mt_tokenizer_vocab_size(tok);
    int32_t eod = mt_tokenizer_eod(tok), bos = mt_tokenizer_bos(tok);
    mt_tokenizer_kind kind = mt_tokenizer_get_kind(tok);
    int64_t empty = mt_tokenizer_encode(tok, "", 0, &ids, &count, &cap);
    int bos_first = empty == s->prefix && (s->prefix == 0 || ids[0] == bos);
    mt_tokenizer_free(tok);
    /* --tokenizer-hf-no-include-special-tokens: the template adds nothing */
    EXPECT_OK(mt_tokenizer_load_hf(&tok, path, 0, &err), &err);
    count = 0;
    int64_t plain = mt_tokenizer_encode(tok, "Hello", 5, &ids, &count, &cap);
    int no_bos = plain > 0 && ids[0] != bos;
    free(ids);
    mt_tokenizer_free(tok);
    if (r != TEST_PASS) return r;
    EXPECT(vocab == s->vocab && eod == s->eod && bos == s->bos, "vocab %lld eod %d bos %d, expected %lld %d %d", (long long)vocab, eod, bos,
           (long long)s->vocab, s->eod, s->bos);
    EXPECT(kind == MT_TOKENIZER_HUGGINGFACE, "kind %d", (int)kind);
    EXPECT(bos_first, "an empty text gave %lld tokens, expected the template's %d", (long long)empty, s->prefix);
    EXPECT(no_bos || s->prefix == 0, "include_special_tokens = 0 still added BOS");
    return TEST_PASS;
}

static test_result test_tokenizer_hf_gpt2(void) { return tt_hf(0); }
static test_result test_tokenizer_hf_llama3(void) { return tt_hf(1); }
static test_result test_tokenizer_hf_qwen2(void) { return tt_hf(2); }
static test_result test_tokenizer_hf_mistral_nemo(void) { return tt_hf(3); }
static test_result test_tokenizer_hf_mistral(void) { return tt_hf(4); }
static test_result test_tokenizer_hf_llama2_metaspace(void) { return tt_hf(5); }
static test_result test_tokenizer_hf_metaspace_split(void) { return tt_hf(6); }

/* Megatron's TikTokenizer: 1000 special tokens, the JSON vocabulary's ranks after them. */
static test_result tt_tiktokenizer(const char* pattern) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    mt_tiktokenizer_options opt;
    char cases[64], texts[64];
    mt_tiktokenizer_options_init(&opt);
    opt.pattern = pattern;
    opt.vocab_size = 4096 + 1000;
    EXPECT_OK(mt_tokenizer_load_tiktokenizer(&tok, TT_HF "tiktokenizer/vocab.json", &opt, &err), &err);
    snprintf(cases, sizeof(cases), "cases_%s.bin", pattern);
    snprintf(texts, sizeof(texts), "texts_%s.bin", pattern);
    test_result r = tt_check_dir(tok, "tiktokenizer", cases, texts, NULL, 1);
    int ok = mt_tokenizer_vocab_size(tok) == 5096 && mt_tokenizer_eod(tok) == 2 && mt_tokenizer_bos(tok) == 1 &&
             mt_tokenizer_token_id(tok, "<SPECIAL_999>", 13) == 999 && mt_tokenizer_token_id(tok, "\x00", 1) == 1000 &&
             mt_tokenizer_get_kind(tok) == MT_TOKENIZER_TIKTOKENIZER;
    mt_tokenizer_free(tok);
    EXPECT(ok, "TikTokenizer's vocab size, eod, bos or ids are not Megatron's");
    return r;
}
static test_result test_tokenizer_tiktokenizer_v1(void) { return tt_tiktokenizer("v1"); }
static test_result test_tokenizer_tiktokenizer_v2(void) { return tt_tiktokenizer("v2"); }

/* The four held-out Gutenberg books (3.3 MB), each encoded whole, with every tokenizer.json,
 * GPT2BPETokenizer and TikTokenizer. Extracted once from the shared data's books.tar.xz. */
static test_result test_tokenizer_hf_gutenberg(void) {
    char tar[512], dir[64], cmd[1200];
    mt_error err;
    if (!tt_exists(tt_shared("gutenberg/books.tar.xz", tar, sizeof(tar)))) SKIP("%s not found (shared data absent)", tar);
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    snprintf(cmd, sizeof(cmd),
             "tar -xJf '%s' -C '%s' gutenberg/data/books/4300-0.txt gutenberg/data/books/pg48731.txt gutenberg/data/books/pg4657.txt "
             "gutenberg/data/books/11-0.txt 2>/dev/null",
             tar, dir);
    if (system(cmd) != 0) { tt_rmtree(dir); SKIP("cannot extract the books from %s (tar/xz missing?)", tar); }
    test_result r = TEST_PASS;
    for (int k = 0; k < 10 && r == TEST_PASS; k++) {
        mt_tokenizer* tok = NULL;
        mt_status st;
        const char* name;
        const char* texts = "texts.bin";
        if (k < 7) {
            char path[256];
            name = tt_hf_specs[k].dir;
            snprintf(path, sizeof(path), TT_HF "%s", name);
            st = mt_tokenizer_load_hf(&tok, path, 1, &err);
        } else if (k == 7) {
            name = "gpt2"; /* GPT2BPETokenizer's files give the GPT-2 tokenizer.json's ids */
            st = mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err);
        } else {
            mt_tiktokenizer_options opt;
            mt_tiktokenizer_options_init(&opt);
            opt.pattern = k == 8 ? "v1" : "v2";
            opt.vocab_size = 5096;
            name = "tiktokenizer";
            texts = k == 8 ? "texts_v1.bin" : "texts_v2.bin";
            st = mt_tokenizer_load_tiktokenizer(&tok, TT_HF "tiktokenizer/vocab.json", &opt, &err);
        }
        if (st != MT_OK) { printf("    %s: %s\n", name, err.message); r = TEST_FAIL; break; }
        char path[256], books[128];
        int checked = 0;
        size_t bytes = 0;
        snprintf(path, sizeof(path), TT_HF "%s/%s", name, texts);
        snprintf(books, sizeof(books), "%s", dir);
        int bad = tt_check_texts(tok, path, books, &checked, &bytes);
        mt_tokenizer_free(tok);
        if (bad != 0 || checked != 5 || bytes < 4000000) {
            printf("    %s: %d of %d texts (%zu bytes) differ\n", path, bad, checked, bytes);
            r = TEST_FAIL;
        }
    }
    tt_rmtree(dir);
    return r;
}

/* decode(encode(text)) == text (the template's BOS left out), for every tokenizer.json whose
 * decoder gives text back; NFC text comes back composed; the decoders' own rules. */
static test_result test_tokenizer_hf_decode(void) {
    mt_error err;
    size_t size = 0;
    char* shakes = test_read_file("dev/data/tinyshakespeare.txt", &size);
    EXPECT(shakes != NULL, "tiny shakespeare");
    const char* extra = "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd  \r\n\t x "; /* (not a U+2581, nor a leading space: sentencepiece decoders give them back as spaces / drop it) */
    for (int k = 0; k < 6; k++) { /* metaspace_split's Metaspace decoder has no byte fallback */
        mt_tokenizer* tok = NULL;
        char path[256];
        snprintf(path, sizeof(path), TT_HF "%s", tt_hf_specs[k].dir);
        EXPECT_OK(mt_tokenizer_load_hf(&tok, path, 1, &err), &err);
        const char* texts[2] = {shakes, extra};
        size_t lens[2] = {size, strlen(extra)};
        for (int t = 0; t < 2; t++) {
            int32_t* ids = NULL;
            size_t count = 0, cap = 0, out_len = 0;
            char* out = NULL;
            mt_tokenizer_encode(tok, texts[t], lens[t], &ids, &count, &cap);
            int p = tt_hf_specs[k].prefix;
            EXPECT_OK(mt_tokenizer_decode(tok, ids + p, count - (size_t)p, &out, &out_len, &err), &err);
            int same = out_len == lens[t] && memcmp(out, texts[t], lens[t]) == 0;
            free(out);
            free(ids);
            EXPECT(same, "%s: text %d does not decode back", tt_hf_specs[k].dir, t);
        }
        mt_tokenizer_free(tok);
    }
    free(shakes);
    struct { const char* dir; const char* text; const char* want; } cases[] = {
        {"qwen2", "cafe\xcc\x81 A\xcc\x8a \xe1\x84\x80\xe1\x85\xa1", "caf\xc3\xa9 \xc3\x85 \xea\xb0\x80"}, /* NFC: é Å 가 */
        {"mistral", "Hello  world", "Hello  world"},             /* Strip drops the Prepend's space */
        {"metaspace_split", "Hello world", "Hello world"},       /* Metaspace: the first token loses its U+2581 */
        {"mistral", "\xe2\x82\xac", "\xe2\x82\xac"},              /* byte fallback <0xE2><0x82><0xAC> */
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        mt_tokenizer* tok = NULL;
        char path[256];
        int32_t* ids = NULL;
        size_t count = 0, cap = 0, out_len = 0;
        char* out = NULL;
        snprintf(path, sizeof(path), TT_HF "%s", cases[c].dir);
        EXPECT_OK(mt_tokenizer_load_hf(&tok, path, 0, &err), &err);
        mt_tokenizer_encode(tok, cases[c].text, strlen(cases[c].text), &ids, &count, &cap);
        EXPECT_OK(mt_tokenizer_decode(tok, ids, count, &out, &out_len, &err), &err);
        int same = out_len == strlen(cases[c].want) && memcmp(out, cases[c].want, out_len) == 0;
        if (!same) printf("    %s: '%s' decodes to '%.*s'\n", cases[c].dir, cases[c].text, (int)out_len, out);
        free(out);
        free(ids);
        mt_tokenizer_free(tok);
        EXPECT(same, "decode case %zu", c);
    }
    return TEST_PASS;
}

/* A small valid tokenizer.json, and one-line refusals of what this build does not implement. */
static test_result test_tokenizer_hf_refusals(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    char dir[64], path[128], cfg[160];
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
    snprintf(cfg, sizeof(cfg), "%s/tokenizer_config.json", dir);
#define TT_PRE "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":true}"
#define TT_MODEL "{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"ab\":2,\"<s>\":3},\"merges\":[\"a b\"]}"
#define TT_JSON(added, norm, pre, model, dec)                                                                               \
    "{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,\"added_tokens\":" added ",\"normalizer\":" norm            \
    ",\"pre_tokenizer\":" pre ",\"post_processor\":null,\"decoder\":" dec ",\"model\":" model "}"
    const char* good = TT_JSON("[{\"id\":3,\"content\":\"<s>\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
                               "\"normalized\":false,\"special\":true}]",
                               "null", TT_PRE, TT_MODEL, "{\"type\":\"ByteLevel\"}");
    EXPECT(tt_write(path, good, strlen(good)), "write");
    EXPECT(tt_write(cfg, "{\"eos_token\": {\"content\": \"<s>\"}}", 33), "write");
    EXPECT_OK(mt_tokenizer_load_hf(&tok, dir, 1, &err), &err);
    int32_t* ids = NULL;
    size_t count = 0, cap = 0;
    mt_tokenizer_encode(tok, "ab<s>ba", 7, &ids, &count, &cap);
    int ok = count == 4 && ids[0] == 2 && ids[1] == 3 && ids[2] == 1 && ids[3] == 0 && mt_tokenizer_eod(tok) == 3;
    mt_tokenizer_free(tok);
    EXPECT(ok, "the small tokenizer.json: %zu tokens", count);
    /* tokenizer_config.json's add_bos_token / add_eos_token make the template [bos] text [eos] */
    const char* cfgs[2] = {"{\"bos_token\": \"<s>\", \"eos_token\": \"<s>\", \"add_eos_token\": true}",
                           "{\"bos_token\": \"<s>\", \"add_bos_token\": true, \"add_eos_token\": false}"};
    for (int k = 0; k < 2; k++) {
        EXPECT(tt_write(cfg, cfgs[k], strlen(cfgs[k])), "write");
        EXPECT_OK(mt_tokenizer_load_hf(&tok, dir, 1, &err), &err);
        count = 0;
        mt_tokenizer_encode(tok, "ab", 2, &ids, &count, &cap);
        ok = count == 2 && ids[k ? 0 : 1] == 3 && ids[k ? 1 : 0] == 2;
        mt_tokenizer_free(tok);
        EXPECT(ok, "%s: %zu tokens", cfgs[k], count);
    }
    free(ids);
    struct { const char* json; const char* msg; } bad[] = {
        {TT_JSON("[]", "null", TT_PRE, "{\"type\":\"WordPiece\",\"vocab\":{}}", "null"), "model type WordPiece is not supported"},
        {TT_JSON("[]", "null", "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\w+\"},\"behavior\":\"Isolated\",\"invert\":false}", TT_MODEL,
                 "null"),
         "regex '\\w+' is not one this build implements"},
        {TT_JSON("[]", "null", "{\"type\":\"Whitespace\"}", TT_MODEL, "null"), "the Whitespace pre-tokenizer is not supported"},
        {TT_JSON("[]", "{\"type\":\"Lowercase\"}", TT_PRE, TT_MODEL, "null"), "the Lowercase normalizer is not supported"},
        {TT_JSON("[{\"id\":3,\"content\":\"<s>\",\"single_word\":true,\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":true}]",
                 "null", TT_PRE, TT_MODEL, "null"),
         "single_word"},
        {TT_JSON("[]", "null", TT_PRE, "{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[\"a b\"]}", "null"), "not in the vocab"},
        {TT_JSON("[]", "null", TT_PRE, "{\"type\":\"BPE\",\"dropout\":0.1,\"vocab\":{\"a\":0},\"merges\":[]}", "null"), "dropout"},
        {TT_JSON("[]", "null", TT_PRE, TT_MODEL, "{\"type\":\"WordPiece\",\"prefix\":\"##\"}"), "the WordPiece decoder is not supported"},
        {"{\"model\": ", "malformed JSON"},
    };
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        EXPECT(tt_write(path, bad[k].json, strlen(bad[k].json)), "write");
        mt_status st = mt_tokenizer_load_hf(&tok, path, 1, &err);
        EXPECT(st != MT_OK && strstr(err.message, bad[k].msg) && strstr(err.message, "tokenizer.json") && tok == NULL,
               "case %zu: %s (want '%s')", k, st == MT_OK ? "accepted" : err.message, bad[k].msg);
    }
    EXPECT(tt_write(path, good, strlen(good)), "write");
    EXPECT(tt_write(cfg, "{\"eos_token\": \"<nope>\"}", 23), "write");
    mt_status st = mt_tokenizer_load_hf(&tok, dir, 1, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "eos_token '<nope>' is not a token"), "unknown eos: %s", st ? err.message : "accepted");
    st = mt_tokenizer_load_hf(&tok, "/nonexistent/dir", 1, &err);
    EXPECT(st == MT_ERR_IO && strstr(err.message, "/nonexistent/dir"), "missing: %s", err.message);

    /* Megatron's TikTokenizer and the --tokenizer-type names */
    mt_tiktokenizer_options opt;
    mt_tiktokenizer_options_init(&opt);
    opt.vocab_size = 5096;
    opt.pattern = "v3";
    st = mt_tokenizer_load_tiktokenizer(&tok, TT_HF "tiktokenizer/vocab.json", &opt, &err);
    EXPECT(st == MT_ERR_ARG && strstr(err.message, "v3"), "pattern v3: %s", st ? err.message : "accepted");
    opt.pattern = "v2";
    opt.vocab_size = 9000;
    st = mt_tokenizer_load_tiktokenizer(&tok, TT_HF "tiktokenizer/vocab.json", &opt, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "fewer than vocab size"), "short vocabulary: %s", st ? err.message : "accepted");
    const char* few[3] = {"<unk>", "<s>", "</s>"};
    opt.vocab_size = 5096;
    opt.special_tokens = few;
    opt.num_given_special_tokens = 3;
    st = mt_tokenizer_load_tiktokenizer(&tok, TT_HF "tiktokenizer/vocab.json", &opt, &err);
    EXPECT(st == MT_ERR_ARG && strstr(err.message, "<mask>"), "specials without <mask>: %s", st ? err.message : "accepted");
    st = mt_tokenizer_load_tiktokenizer(&tok, TT_GPT2_MERGES, NULL, &err);
    EXPECT(st == MT_ERR_FORMAT, "merges.txt as a TikTokenizer vocabulary accepted");
    snprintf(path, sizeof(path), "%s/r50k.tiktoken", dir);
    EXPECT(tt_write(path, "IQ== 0\nIg== 1\n", 14), "write");
    st = mt_tokenizer_load_tiktokenizer(&tok, path, NULL, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "tiktoken rank file"), "a rank file as vocabulary: %s", st ? err.message : "accepted");
    snprintf(path, sizeof(path), "%s/ranks.json", dir);
    EXPECT(tt_write(path, "{\"a\": 1}", 8), "write");
    st = mt_tokenizer_load_tiktokenizer(&tok, path, NULL, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "TiktokenFileTokenizer"), "an object as vocabulary: %s", st ? err.message : "accepted");
    mt_tokenizer_args a;
    mt_tokenizer_args_init(&a);
    a.type = "TikTokenizer";
    a.model = TT_HF "tiktokenizer/vocab.json";
    a.vocab_size = 5096;
    EXPECT_OK(mt_tokenizer_load_by_type(&tok, &a, &err), &err);
    ids = NULL;
    count = cap = 0;
    mt_tokenizer_encode(tok, "<s>", 3, &ids, &count, &cap);
    ok = count == 1 && ids[0] == 1;
    free(ids);
    mt_tokenizer_free(tok);
    EXPECT(ok, "TikTokenizer by type: <s> is not the special token 1");
    struct { const char* type; const char* msg; } types[] = {
        {"Llama2Tokenizer", "SentencePiece"}, {"SentencePieceTokenizer", "HuggingFaceTokenizer"}, {"BertWordPieceCase", "WordPiece"},
        {"MultimodalTokenizer", "not implemented"}, {"Foo", "unknown"}, {"HuggingFaceTokenizer", "needs --tokenizer-model"},
        {"GPT2BPETokenizer", "needs --vocab-file"},
    };
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
        mt_tokenizer_args_init(&a);
        a.type = types[k].type;
        st = mt_tokenizer_load_by_type(&tok, &a, &err);
        EXPECT(st == MT_ERR_ARG && strstr(err.message, types[k].msg), "%s: %s", types[k].type, st ? err.message : "accepted");
    }
    mt_tokenizer_args_init(&a);
    a.type = "NullTokenizer";
    a.vocab_size = 1000;
    EXPECT(mt_tokenizer_load_by_type(&tok, &a, &err) == MT_OK && tok == NULL, "NullTokenizer");
    tt_rmtree(dir);
    return TEST_PASS;
}

static test_result test_tokenizer_json_lines(void) {
    const char* keys[2] = {"text", "title"};
    const char* v[2];
    size_t l[2], cap = 0;
    char* scratch = NULL;
    mt_error err;
    const char* ok = " {\"id\": [1, {\"x\": null}, -2.5e3, true], \"text\": \"a\\\"b\\n\\u00e9\\ud83d\\ude00\\ud800!\", \"title\": \"T\", "
                     "\"n\": NaN}\r\n";
    EXPECT_OK(mt_json_object_strings(ok, strlen(ok), keys, 2, v, l, &scratch, &cap, &err), &err);
    const char* want = "a\"b\n\xc3\xa9\xf0\x9f\x98\x80\xef\xbf\xbd!";
    EXPECT(l[0] == strlen(want) && memcmp(v[0], want, l[0]) == 0, "escapes decoded wrongly: '%.*s'", (int)l[0], v[0]);
    EXPECT(l[1] == 1 && v[1][0] == 'T', "title");
    const char* dup = "{\"text\": \"first\", \"te\\u0078t\": \"second\"}"; /* an escaped key; the last duplicate wins */
    EXPECT_OK(mt_json_object_strings(dup, strlen(dup), keys, 1, v, l, &scratch, &cap, &err), &err);
    EXPECT(l[0] == 6 && memcmp(v[0], "second", 6) == 0, "duplicate key: '%.*s'", (int)l[0], v[0]);
    struct { const char* line; const char* msg; } bad[] = {
        {"{\"text\": \"x\"", "expected ',' or '}'"},
        {"{\"text\": 5}", "is a number, not a string"},
        {"{\"text\": null}", "is null, not a string"},
        {"{\"other\": \"x\"}", "missing key 'text'"},
        {"[1, 2]", "not a JSON object"},
        {"{\"text\": \"x\"} extra", "extra data"},
        {"{\"text\": \"a\tb\"}", "control character"},
        {"{\"text\": \"\\q\"}", "bad escape"},
        {"{\"text\": \"\\u12\"}", "bad \\u escape"},
        {"{text: \"x\"}", "expected a key"},
        {"{\"a\": 01, \"text\": \"x\"}", "expected ',' or '}'"},
        {"{\"a\": [1,], \"text\": \"x\"}", "expected a value"},
    };
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        mt_status st = mt_json_object_strings(bad[k].line, strlen(bad[k].line), keys, 1, v, l, &scratch, &cap, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, bad[k].msg), "'%s': %s (want '%s')", bad[k].line,
               st == MT_OK ? "accepted" : err.message, bad[k].msg);
    }
    free(scratch);
    return TEST_PASS;
}

/* Reads a whole dataset's tokens back with megatron.h's reader. */
static int tt_read_dataset(const char* prefix, int64_t* docs, int64_t* seqs, int32_t** tokens, int64_t* ntok) {
    mt_indexed_dataset* ds = NULL;
    mt_error err;
    if (mt_indexed_dataset_open(&ds, prefix, &err) != MT_OK) { printf("    %s\n", err.message); return 0; }
    *docs = mt_indexed_dataset_num_documents(ds);
    *seqs = mt_indexed_dataset_num_sequences(ds);
    *ntok = mt_indexed_dataset_num_tokens(ds);
    *tokens = (int32_t*)malloc((size_t)(*ntok + 1) * sizeof(int32_t));
    int64_t o = 0;
    for (int64_t s = 0; s < *seqs; s++) {
        int64_t n = mt_indexed_dataset_sequence_length(ds, s);
        if (mt_indexed_dataset_read(ds, s, 0, n, *tokens + o, &err) != MT_OK) { mt_indexed_dataset_close(ds); return 0; }
        o += n;
    }
    mt_indexed_dataset_close(ds);
    return 1;
}

static int tt_same_files(const char* a, const char* b) {
    size_t na = 0, nb = 0;
    char* x = test_read_file(a, &na);
    char* y = test_read_file(b, &nb);
    int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

/* The pipeline: --workers 1 and 4 (with tiny batches) write identical bytes; the tokens equal the
 * tokenizer's, EOD after each non-empty document, an empty document stays as a zero-sequence one. */
static test_result test_tokenizer_preprocess_workers(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    char dir[64], input[128], prefix[2][128], path_a[160], path_b[160];
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    size_t size = 0;
    char* shakes = test_read_file("dev/data/tinyshakespeare.txt", &size);
    EXPECT(shakes != NULL, "tiny shakespeare");
    /* JSONL: 300 documents of tiny shakespeare paragraphs (JSON-escaped), one empty, one blank line. */
    size_t jcap = size * 2 + 4096, jl = 0, p = 0;
    char* jsonl = (char*)malloc(jcap);
    int ndocs = 0;
    while (ndocs < 300 && p < size) {
        size_t e = p;
        while (e < size && !(shakes[e] == '\n' && e + 1 < size && shakes[e + 1] == '\n')) e++;
        jl += (size_t)snprintf(jsonl + jl, jcap - jl, "{\"id\": %d, \"text\": \"", ndocs);
        for (size_t k = p; k < e; k++) {
            if (shakes[k] == '\n') { memcpy(jsonl + jl, "\\n", 2); jl += 2; }
            else if (shakes[k] == '"' || shakes[k] == '\\') { jsonl[jl++] = '\\'; jsonl[jl++] = shakes[k]; }
            else jsonl[jl++] = shakes[k];
        }
        jl += (size_t)snprintf(jsonl + jl, jcap - jl, "\"}\n");
        ndocs++;
        if (ndocs == 10) { jl += (size_t)snprintf(jsonl + jl, jcap - jl, "{\"text\": \"\"}\n  \n"); ndocs++; }
        p = e + 2;
    }
    snprintf(input, sizeof(input), "%s/in.jsonl", dir);
    EXPECT(tt_write(input, jsonl, jl), "write %s", input);
    const char* inputs[1] = {input};
    int workers[2] = {1, 4};
    mt_preprocess_stats stats[2];
    for (int r = 0; r < 2; r++) {
        mt_preprocess_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        snprintf(prefix[r], sizeof(prefix[r]), "%s/out%d", dir, r);
        cfg.inputs = inputs;
        cfg.num_inputs = 1;
        cfg.output_prefix = prefix[r];
        cfg.tokenizer = tok;
        cfg.append_eod = 1;
        cfg.workers = workers[r];
        cfg.batch_bytes = r ? 3000 : 0; /* many small batches for 4 workers */
        EXPECT_OK(mt_preprocess(&cfg, &stats[r], &err), &err);
    }
    EXPECT(stats[0].documents == ndocs && stats[1].documents == ndocs, "documents %lld %lld, expected %d",
           (long long)stats[0].documents, (long long)stats[1].documents, ndocs);
    EXPECT(stats[0].blank_lines == 1 && stats[0].empty_docs == 1, "blank %lld empty %lld", (long long)stats[0].blank_lines,
           (long long)stats[0].empty_docs);
    for (int f = 0; f < 2; f++) {
        snprintf(path_a, sizeof(path_a), "%s_text_document.%s", prefix[0], f ? "idx" : "bin");
        snprintf(path_b, sizeof(path_b), "%s_text_document.%s", prefix[1], f ? "idx" : "bin");
        EXPECT(tt_same_files(path_a, path_b), "%s and %s differ", path_a, path_b);
    }
    /* Read back: the tokens are the tokenizer's, plus EOD; the empty document has no sequence. */
    int64_t docs = 0, seqs = 0, ntok = 0;
    int32_t* got = NULL;
    snprintf(path_a, sizeof(path_a), "%s_text_document", prefix[0]);
    EXPECT(tt_read_dataset(path_a, &docs, &seqs, &got, &ntok), "read back %s", path_a);
    EXPECT(docs == ndocs && seqs == ndocs - 1, "docs %lld seqs %lld", (long long)docs, (long long)seqs);
    int32_t* want = NULL;
    size_t count = 0, cap = 0;
    p = 0;
    for (int d = 0; d < ndocs - 1; d++) {
        size_t e = p;
        while (e < size && !(shakes[e] == '\n' && e + 1 < size && shakes[e + 1] == '\n')) e++;
        mt_tokenizer_encode(tok, shakes + p, e - p, &want, &count, &cap);
        if (count == cap) want = (int32_t*)realloc(want, (cap *= 2) * sizeof(int32_t));
        want[count++] = 50256;
        p = e + 2;
    }
    int same = (int64_t)count == ntok && memcmp(got, want, count * sizeof(int32_t)) == 0;
    free(got);
    free(want);
    free(jsonl);
    free(shakes);
    mt_tokenizer_free(tok);
    tt_rmtree(dir);
    EXPECT(same, "dataset tokens differ from the tokenizer's (%lld vs %zu)", (long long)ntok, count);
    return TEST_PASS;
}

/* Bad input: a clear "file:line:" error and no output; --skip-bad-lines counts instead. Several
 * keys give several datasets. Text mode: a directory is its files, sorted, one document each. */
static test_result test_tokenizer_preprocess_inputs(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    char dir[64], input[128], prefix[128], path[200];
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    snprintf(input, sizeof(input), "%s/in.jsonl", dir);
    const char* lines = "\xef\xbb\xbf{\"text\": \"hello\", \"title\": \"A\"}\n{\"text\": \"world\", \"title\": \"B\"}\n{\"text\": 3, \"title\": \"C\"}\n"
                        "{\"text\": \"again\", \"title\": \"\"}";
    EXPECT(tt_write(input, lines, strlen(lines)), "write");
    const char* inputs[1] = {input};
    const char* keys[2] = {"text", "title"};
    mt_preprocess_config cfg;
    mt_preprocess_stats stats;
    memset(&cfg, 0, sizeof(cfg));
    snprintf(prefix, sizeof(prefix), "%s/out", dir);
    cfg.inputs = inputs;
    cfg.num_inputs = 1;
    cfg.output_prefix = prefix;
    cfg.json_keys = keys;
    cfg.num_json_keys = 2;
    cfg.tokenizer = tok;
    cfg.workers = 2;
    mt_status st = mt_preprocess(&cfg, &stats, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "in.jsonl:3:") && strstr(err.message, "not a string"), "bad line: %s",
           st == MT_OK ? "accepted" : err.message);
    snprintf(path, sizeof(path), "%s_text_document.bin", prefix);
    EXPECT(!tt_exists(path), "%s left behind by a failed run", path);
    cfg.skip_bad_lines = 1;
    EXPECT_OK(mt_preprocess(&cfg, &stats, &err), &err);
    EXPECT(stats.documents == 3 && stats.bad_lines == 1, "documents %lld bad %lld", (long long)stats.documents,
           (long long)stats.bad_lines);
    int64_t docs = 0, seqs = 0, ntok = 0;
    int32_t* got = NULL;
    snprintf(path, sizeof(path), "%s_title_document", prefix);
    EXPECT(tt_read_dataset(path, &docs, &seqs, &got, &ntok), "read %s", path);
    free(got);
    EXPECT(docs == 3 && seqs == 2 && ntok == 2, "title dataset: %lld docs %lld seqs %lld tokens", (long long)docs,
           (long long)seqs, (long long)ntok);
    snprintf(path, sizeof(path), "%s_text_document", prefix);
    EXPECT(tt_read_dataset(path, &docs, &seqs, &got, &ntok), "read %s", path);
    EXPECT(docs == 3 && ntok == 3 && got[0] == 31373 && got[1] == 6894, "text dataset: %lld docs %lld tokens", (long long)docs,
           (long long)ntok);
    free(got);

    /* Text mode over a directory: b.txt, sub/a.txt sorted by path ("b.txt" < "sub/..."). */
    char tdir[128], sub[160];
    snprintf(tdir, sizeof(tdir), "%s/texts", dir);
    snprintf(sub, sizeof(sub), "%s/sub", tdir);
    EXPECT(mkdir(tdir, 0755) == 0 && mkdir(sub, 0755) == 0, "mkdir");
    snprintf(path, sizeof(path), "%s/b.txt", tdir);
    EXPECT(tt_write(path, "hello", 5), "write");
    snprintf(path, sizeof(path), "%s/a.txt", sub);
    EXPECT(tt_write(path, " world", 6), "write");
    snprintf(path, sizeof(path), "%s/.hidden", tdir);
    EXPECT(tt_write(path, "x", 1), "write");
    const char* tin[1] = {tdir};
    memset(&cfg, 0, sizeof(cfg));
    snprintf(prefix, sizeof(prefix), "%s/txt", dir);
    cfg.inputs = tin;
    cfg.num_inputs = 1;
    cfg.format = MT_INPUT_TEXT;
    cfg.output_prefix = prefix;
    cfg.tokenizer = tok;
    cfg.append_eod = 1;
    cfg.workers = 3;
    EXPECT_OK(mt_preprocess(&cfg, &stats, &err), &err);
    snprintf(path, sizeof(path), "%s_text_document", prefix);
    EXPECT(tt_read_dataset(path, &docs, &seqs, &got, &ntok), "read %s", path);
    int ok = docs == 2 && ntok == 4 && got[0] == 31373 && got[1] == 50256 && got[2] == 995 && got[3] == 50256;
    free(got);
    EXPECT(ok, "text mode: %lld docs %lld tokens", (long long)docs, (long long)ntok);
    const char* missing[1] = {"/nonexistent/input.jsonl"};
    cfg.inputs = missing;
    cfg.format = MT_INPUT_JSONL;
    st = mt_preprocess(&cfg, &stats, &err);
    EXPECT(st == MT_ERR_IO && strstr(err.message, "/nonexistent/input.jsonl"), "missing input: %s", err.message);
    mt_tokenizer_free(tok);
    tt_rmtree(dir);
    return TEST_PASS;
}

/* Megatron's preprocess_data with a Hugging Face tokenizer: each document is tokenizer(text)
 * (BOS first), then EOD; an empty document is [BOS, EOD], as Megatron writes it. */
static test_result test_tokenizer_preprocess_hf(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    char dir[64], input[128], prefix[128];
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    EXPECT_OK(mt_tokenizer_load_hf(&tok, TT_HF "llama3", 1, &err), &err);
    snprintf(input, sizeof(input), "%s/in.jsonl", dir);
    const char* lines = "{\"text\": \"Hello world\"}\n{\"text\": \"\"}\n{\"text\": \"<|begin_of_text|>x\"}\n";
    EXPECT(tt_write(input, lines, strlen(lines)), "write");
    const char* inputs[1] = {input};
    mt_preprocess_config cfg;
    mt_preprocess_stats stats;
    memset(&cfg, 0, sizeof(cfg));
    snprintf(prefix, sizeof(prefix), "%s/out", dir);
    cfg.inputs = inputs;
    cfg.num_inputs = 1;
    cfg.output_prefix = prefix;
    cfg.tokenizer = tok;
    cfg.append_eod = 1;
    cfg.workers = 2;
    EXPECT_OK(mt_preprocess(&cfg, &stats, &err), &err);
    int64_t docs = 0, seqs = 0, ntok = 0;
    int32_t* got = NULL;
    char path[160];
    snprintf(path, sizeof(path), "%s_text_document", prefix);
    EXPECT(tt_read_dataset(path, &docs, &seqs, &got, &ntok), "read back %s", path);
    int32_t* want = NULL;
    size_t count = 0, cap = 0;
    const char* texts[3] = {"Hello world", "", "<|begin_of_text|>x"};
    for (int d = 0; d < 3; d++) {
        mt_tokenizer_encode(tok, texts[d], strlen(texts[d]), &want, &count, &cap);
        if (count == cap) want = (int32_t*)realloc(want, (cap = cap * 2 + 8) * sizeof(int32_t));
        want[count++] = mt_tokenizer_eod(tok);
    }
    int same = (int64_t)count == ntok && memcmp(got, want, count * sizeof(int32_t)) == 0;
    int bos_eod = ntok >= 6 && got[0] == 8192 && got[ntok - 1] == 8193;
    free(got);
    free(want);
    mt_tokenizer_free(tok);
    tt_rmtree(dir);
    EXPECT(docs == 3 && seqs == 3, "docs %lld seqs %lld (the empty document is [BOS, EOD])", (long long)docs, (long long)seqs);
    EXPECT(same && bos_eod, "dataset tokens differ from tokenizer(text) + EOD");
    return TEST_PASS;
}

/* .gz and .zst input (when the build has zlib / zstd) give the bytes the plain file gives;
 * corrupt or truncated data fails with a line naming the file; a build without the library
 * refuses the file in one line. */
static test_result test_tokenizer_preprocess_compressed(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    char dir[64], plain[128], prefix[3][128], path[3][200];
    size_t size = 0;
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    char* shakes = test_read_file("dev/data/tinyshakespeare.txt", &size);
    EXPECT(shakes != NULL, "tiny shakespeare");
    /* JSONL: 2000-byte slices of tiny shakespeare as documents (about 550 lines, 2 MB escaped). */
    size_t jcap = size * 2 + 65536, jl = 0;
    char* jsonl = (char*)malloc(jcap);
    for (size_t p = 0; p < size; p += 2000) {
        jl += (size_t)snprintf(jsonl + jl, jcap - jl, "{\"text\": \"");
        for (size_t k = p; k < p + 2000 && k < size; k++) {
            if (shakes[k] == '\n') { memcpy(jsonl + jl, "\\n", 2); jl += 2; }
            else if (shakes[k] == '"' || shakes[k] == '\\') { jsonl[jl++] = '\\'; jsonl[jl++] = shakes[k]; }
            else jsonl[jl++] = shakes[k];
        }
        jl += (size_t)snprintf(jsonl + jl, jcap - jl, "\"}\n");
    }
    free(shakes);
    snprintf(plain, sizeof(plain), "%s/in.jsonl", dir);
    EXPECT(tt_write(plain, jsonl, jl), "write");
    const char* names[3] = {plain, NULL, NULL};
    char gz[128], zst[128];
    snprintf(gz, sizeof(gz), "%s/in.jsonl.gz", dir);
    snprintf(zst, sizeof(zst), "%s/in.jsonl.zst", dir);
    int have_gz = strstr(mt_preprocess_compressions(), ".gz") != NULL, have_zst = strstr(mt_preprocess_compressions(), ".zst") != NULL;
#if defined(MT_HAVE_ZLIB)
    {
        gzFile f = gzopen(gz, "wb");
        EXPECT(f && gzwrite(f, jsonl, (unsigned)jl) == (int)jl && gzclose(f) == Z_OK, "gzip %s", gz);
        names[1] = gz;
    }
#endif
#if defined(MT_HAVE_ZSTD)
    {
        size_t bound = ZSTD_compressBound(jl);
        char* z = (char*)malloc(bound);
        size_t zn = ZSTD_compress(z, bound, jsonl, jl, 3);
        EXPECT(!ZSTD_isError(zn) && tt_write(zst, z, zn), "zstd %s", zst);
        names[2] = zst;
        snprintf(path[0], sizeof(path[0]), "%s/cut.jsonl.zst", dir); /* a truncated frame */
        EXPECT(tt_write(path[0], z, zn / 2), "write");
        free(z);
    }
#endif
    free(jsonl);
    mt_preprocess_config cfg;
    mt_preprocess_stats stats[3];
    for (int r = 0; r < 3; r++) {
        if (!names[r]) continue;
        memset(&cfg, 0, sizeof(cfg));
        snprintf(prefix[r], sizeof(prefix[r]), "%s/out%d", dir, r);
        cfg.inputs = &names[r];
        cfg.num_inputs = 1;
        cfg.output_prefix = prefix[r];
        cfg.tokenizer = tok;
        cfg.append_eod = 1;
        cfg.workers = 3;
        cfg.batch_bytes = 100000;
        EXPECT_OK(mt_preprocess(&cfg, &stats[r], &err), &err);
        EXPECT(stats[r].documents == stats[0].documents && stats[r].tokens == stats[0].tokens, "input %d: %lld documents", r,
               (long long)stats[r].documents);
        for (int f = 0; f < 2 && r > 0; f++) {
            snprintf(path[1], sizeof(path[1]), "%s_text_document.%s", prefix[0], f ? "idx" : "bin");
            snprintf(path[2], sizeof(path[2]), "%s_text_document.%s", prefix[r], f ? "idx" : "bin");
            EXPECT(tt_same_files(path[1], path[2]), "%s and %s differ", path[1], path[2]);
        }
    }
    /* Refusals and corrupt data. */
    memset(&cfg, 0, sizeof(cfg));
    snprintf(prefix[0], sizeof(prefix[0]), "%s/bad", dir);
    cfg.num_inputs = 1;
    cfg.output_prefix = prefix[0];
    cfg.tokenizer = tok;
    cfg.workers = 1;
    const char* one[1];
    if (!have_gz) {
        EXPECT(tt_write(gz, "x", 1), "write");
        one[0] = gz;
        cfg.inputs = one;
        mt_status st = mt_preprocess(&cfg, NULL, &err);
        EXPECT(st == MT_ERR_IO && strstr(err.message, "no zlib") && strstr(err.message, gz), "gz without zlib: %s", st ? err.message : "accepted");
    } else {
        snprintf(path[1], sizeof(path[1]), "%s/junk.jsonl.gz", dir);
        EXPECT(tt_write(path[1], "\x1f\x8b\x08\x00garbage-that-is-not-deflate", 31), "write");
        one[0] = path[1];
        cfg.inputs = one;
        mt_status st = mt_preprocess(&cfg, NULL, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "junk.jsonl.gz"), "corrupt gzip: %s", st ? err.message : "accepted");
    }
    if (!have_zst) {
        EXPECT(tt_write(zst, "x", 1), "write");
        one[0] = zst;
        cfg.inputs = one;
        mt_status st = mt_preprocess(&cfg, NULL, &err);
        EXPECT(st == MT_ERR_IO && strstr(err.message, "no zstd"), "zst without zstd: %s", st ? err.message : "accepted");
    } else {
        one[0] = path[0];
        cfg.inputs = one;
        mt_status st = mt_preprocess(&cfg, NULL, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "truncated zstd"), "truncated zstd: %s", st ? err.message : "accepted");
    }
    snprintf(path[2], sizeof(path[2]), "%s_text_document.bin", prefix[0]);
    EXPECT(!tt_exists(path[2]), "a failed run left %s", path[2]);
    mt_tokenizer_free(tok);
    tt_rmtree(dir);
    if (!have_gz || !have_zst) SKIP("built without %s: only its refusal was checked", have_gz ? "zstd" : have_zst ? "zlib" : "zlib and zstd");
    return TEST_PASS;
}

/* A token whose decoded bytes are none at all (a Replace decoder that removes U+2581, so the token
 * "\u2581" decodes to nothing) is still a token: text encoded into it decodes (a fuzz finding:
 * decode called it "not in the vocabulary"), and an id outside the vocabulary is still refused. */
static test_result test_tokenizer_empty_token(void) {
    size_t size = 0;
    char* json = test_read_file(TT_HF "llama2_metaspace/tokenizer.json", &size);
    if (!json) SKIP_OR_FAIL_STRICT("dev/data/tokenizers not found (run from the root)");
    const char* from = "\"content\":\" \""; /* the Replace decoder's (the file is compact JSON) */
    char* at = strstr(json, from);
    EXPECT(at != NULL, "the Replace decoder's content");
    char dir[64], path[160];
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
    FILE* f = fopen(path, "wb");
    EXPECT(f != NULL, "write");
    fwrite(json, 1, (size_t)(at - json), f);
    fputs("\"content\":\"\"", f); /* U+2581 -> nothing */
    fputs(at + strlen(from), f);
    fclose(f);
    free(json);
    mt_tokenizer* tok = NULL;
    mt_error err;
    EXPECT_OK(mt_tokenizer_load_hf(&tok, dir, 0, &err), &err);
    const char* text = "First Citizen , ; :  \\t ( ) ! ?"; /* a lone U+2581 before punctuation */
    int32_t* ids = NULL;
    size_t count = 0, cap = 0, n = 0;
    char* out = NULL;
    EXPECT(mt_tokenizer_encode(tok, text, strlen(text), &ids, &count, &cap) > 0, "encode");
    const int32_t space = mt_tokenizer_token_id(tok, "\xe2\x96\x81", 3);
    int used = 0;
    for (size_t i = 0; i < count; i++) used |= ids[i] == space;
    mt_status st = mt_tokenizer_decode(tok, ids, count, &out, &n, &err);
    int32_t outside = (int32_t)mt_tokenizer_vocab_size(tok);
    char* none = NULL;
    const int bad = mt_tokenizer_decode(tok, &outside, 1, &none, &n, &err) != MT_ERR_RANGE;
    free(none);
    free(ids);
    mt_tokenizer_free(tok);
    tt_rmtree(dir);
    EXPECT(space >= 0 && used, "the text does not use the U+2581 token (id %d)", space);
    EXPECT(st == MT_OK && out && !strstr(out, " "), "decode: %s", st == MT_OK ? out : err.message);
    free(out);
    EXPECT(!bad, "an id outside the vocabulary was decoded");
    return TEST_PASS;
}

/* Counts the entries of dir other than "." and "..", except one name (the test's input). */
static int tt_count_entries(const char* dir, const char* except) {
    DIR* d = opendir(dir);
    int n = 0;
    struct dirent* e;
    while (d && (e = readdir(d)) != NULL)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && (!except || strcmp(e->d_name, except));
    if (d) closedir(d);
    return n;
}

/* --max-line-bytes: a JSONL line of exactly the limit (its newline not counted) is taken, one byte
 * more is an error naming the file and the line, whether the line fits a batch (a worker finds it)
 * or outgrows one (the reader stops it: batches of 16 bytes here); text input: the whole file is
 * the unit. A failed run leaves nothing. */
static test_result test_tokenizer_preprocess_line_limit(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    char dir[64], input[128], prefix[128], text_in[128];
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    /* line 1: 40 bytes, line 2: 100 bytes, line 3: 101 bytes, line 4: 20 bytes */
    char lines[400];
    size_t len = 0;
    const int sizes[4] = {40, 100, 101, 20};
    for (int l = 0; l < 4; l++) {
        size_t start = len;
        len += (size_t)snprintf(lines + len, sizeof(lines) - len, "{\"text\": \"");
        for (int c = 0; len - start < (size_t)sizes[l] - 2; c++) lines[len++] = (char)('a' + c % 26);
        memcpy(lines + len, "\"}\n", 3);
        len += 3;
        EXPECT(len - start == (size_t)sizes[l] + 1, "line %d has %zu bytes", l + 1, len - start - 1);
    }
    snprintf(input, sizeof(input), "%s/in.jsonl", dir);
    EXPECT(tt_write(input, lines, len), "write");
    snprintf(prefix, sizeof(prefix), "%s/out", dir);
    const char* inputs[1] = {input};
    for (int batch = 0; batch < 2; batch++) {
        mt_preprocess_config cfg;
        mt_preprocess_stats stats;
        memset(&cfg, 0, sizeof(cfg));
        cfg.inputs = inputs;
        cfg.num_inputs = 1;
        cfg.output_prefix = prefix;
        cfg.tokenizer = tok;
        cfg.workers = 2;
        cfg.batch_bytes = batch ? 16 : 0;
        cfg.max_line_bytes = 101;
        EXPECT_OK(mt_preprocess(&cfg, &stats, &err), &err);
        EXPECT(stats.documents == 4, "batch %d: %lld documents", batch, (long long)stats.documents);
        cfg.max_line_bytes = 100;
        err.message[0] = 0;
        mt_status st = mt_preprocess(&cfg, &stats, &err);
        char want[300];
        snprintf(want, sizeof(want), "%s: line 3 is longer than --max-line-bytes (100)", input);
        EXPECT(st == MT_ERR_FORMAT && !strcmp(err.message, want), "batch %d: %s -> '%s' (want '%s')", batch,
               mt_status_name(st), err.message, want);
        cfg.skip_bad_lines = 1; /* not a malformed line to skip: still an error */
        EXPECT(mt_preprocess(&cfg, &stats, &err) == MT_ERR_FORMAT && strstr(err.message, "line 3 is longer"),
               "--skip-bad-lines skipped a line over the limit (batch %d)", batch);
        cfg.max_line_bytes = 39;
        EXPECT(mt_preprocess(&cfg, &stats, &err) == MT_ERR_FORMAT && strstr(err.message, "in.jsonl: line 1 is longer"),
               "line 1 over the limit (batch %d): %s", batch, err.message);
        EXPECT(tt_count_entries(dir, "in.jsonl") == 2, "a failed run left files (%d entries)", tt_count_entries(dir, "in.jsonl"));
    }
    /* text input: a file of 300 bytes is one document */
    snprintf(text_in, sizeof(text_in), "%s/doc.txt", dir);
    char doc[300];
    for (int i = 0; i < 300; i++) doc[i] = (char)('a' + i % 26);
    EXPECT(tt_write(text_in, doc, sizeof(doc)), "write");
    const char* texts[1] = {text_in};
    mt_preprocess_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.inputs = texts;
    cfg.num_inputs = 1;
    cfg.format = MT_INPUT_TEXT;
    cfg.output_prefix = prefix;
    cfg.tokenizer = tok;
    cfg.workers = 1;
    cfg.max_line_bytes = 300;
    EXPECT_OK(mt_preprocess(&cfg, NULL, &err), &err);
    cfg.max_line_bytes = 299;
    mt_status st = mt_preprocess(&cfg, NULL, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "doc.txt is longer than --max-line-bytes (299)"), "text: %s -> %s",
           mt_status_name(st), err.message);
    mt_tokenizer_free(tok);
    tt_rmtree(dir);
    return TEST_PASS;
}

/* Cancellation inside the encoder: with the flag set, encoding stops within 4096 pieces (text of
 * many pieces) and within 2^16 merges of one long piece (a 300 000-letter word), returning -2; with
 * the flag clear, the same calls give mt_tokenizer_encode's ids. And mt_preprocess stopped by the
 * flag from another thread while a worker encodes one long document (a 6 MB word: seconds of
 * merges) returns "interrupted" within a second and leaves only its input. */
typedef struct { volatile sig_atomic_t* flag; int ms; } tt_cancel_arg;
static void* tt_cancel_later(void* p) {
    tt_cancel_arg* a = (tt_cancel_arg*)p;
    usleep((useconds_t)a->ms * 1000);
    *a->flag = 1;
    return NULL;
}

static test_result test_tokenizer_preprocess_cancel(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    size_t size = 0;
    char* shakes = test_read_file("dev/data/tinyshakespeare.txt", &size);
    EXPECT(shakes != NULL, "tiny shakespeare");
    size_t wlen = 300000;
    char* word = (char*)malloc(wlen);
    uint64_t x = 12345;
    for (size_t i = 0; i < wlen; i++) { x = x * 6364136223846793005ull + 1442695040888963407ull; word[i] = (char)('a' + (x >> 33) % 26); }
    volatile sig_atomic_t flag = 0;
    const char* texts[2] = {shakes, word};
    size_t lens[2] = {size, wlen};
    for (int t = 0; t < 2; t++) {
        int32_t *a = NULL, *b = NULL;
        size_t na = 0, ca = 0, nb = 0, cb = 0;
        flag = 0;
        int64_t ra = mtk__encode(tok, texts[t], lens[t], &a, &na, &ca, &flag);
        int64_t rb = mt_tokenizer_encode(tok, texts[t], lens[t], &b, &nb, &cb);
        int same = ra == rb && ra > 0 && memcmp(a, b, (size_t)ra * sizeof(int32_t)) == 0;
        flag = 1;
        na = 0;
        int64_t rc = mtk__encode(tok, texts[t], lens[t], &a, &na, &ca, &flag);
        free(a);
        free(b);
        EXPECT(same, "text %d: with a clear flag %lld tokens, mt_tokenizer_encode %lld", t, (long long)ra, (long long)rb);
        EXPECT(rc == -2, "text %d: encoding went on with the flag set (%lld)", t, (long long)rc);
    }
    free(word);
    free(shakes);
    /* the whole pipeline, stopped from another thread while it merges one 6 MB word */
    char dir[64], input[128], prefix[128];
    EXPECT(tt_tmpdir(dir, sizeof(dir)), "mkdtemp");
    snprintf(input, sizeof(input), "%s/word.txt", dir);
    wlen = 6000000;
    word = (char*)malloc(wlen);
    for (size_t i = 0; i < wlen; i++) { x = x * 6364136223846793005ull + 1442695040888963407ull; word[i] = (char)('a' + (x >> 33) % 26); }
    EXPECT(tt_write(input, word, wlen), "write");
    free(word);
    snprintf(prefix, sizeof(prefix), "%s/out", dir);
    const char* inputs[1] = {input};
    mt_preprocess_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.inputs = inputs;
    cfg.num_inputs = 1;
    cfg.format = MT_INPUT_TEXT;
    cfg.output_prefix = prefix;
    cfg.tokenizer = tok;
    cfg.workers = 2;
    flag = 0;
    cfg.cancel = &flag;
    tt_cancel_arg arg = {&flag, 500};
    pthread_t th;
    EXPECT(pthread_create(&th, NULL, tt_cancel_later, &arg) == 0, "thread");
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    mt_status st = mt_preprocess(&cfg, NULL, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_join(th, NULL);
    double took = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    int left = tt_count_entries(dir, "word.txt");
    mt_tokenizer_free(tok);
    tt_rmtree(dir);
    EXPECT(st == MT_ERR_IO && !strcmp(err.message, "interrupted"), "%s: %s", mt_status_name(st), st ? err.message : "finished");
    EXPECT(took < 1.5, "stopped %.2f s after the start, 0.5 s after the flag was set (want < 1 s after)", took);
    EXPECT(left == 0, "an interrupted run left %d files", left);
    return TEST_PASS;
}

static const test_case tokenizer_tests[] = {
    {"tokenizer_empty_token", test_tokenizer_empty_token},
    {"tokenizer_gpt2_bpe_files", test_tokenizer_gpt2_bpe_files},
    {"tokenizer_r50k_base", test_tokenizer_r50k_base},
    {"tokenizer_cl100k_base", test_tokenizer_cl100k_base},
    {"tokenizer_o200k_base", test_tokenizer_o200k_base},
    {"tokenizer_llama3", test_tokenizer_llama3},
    {"tokenizer_hf_gpt2", test_tokenizer_hf_gpt2},
    {"tokenizer_hf_llama3", test_tokenizer_hf_llama3},
    {"tokenizer_hf_qwen2", test_tokenizer_hf_qwen2},
    {"tokenizer_hf_mistral_nemo", test_tokenizer_hf_mistral_nemo},
    {"tokenizer_hf_mistral", test_tokenizer_hf_mistral},
    {"tokenizer_hf_llama2_metaspace", test_tokenizer_hf_llama2_metaspace},
    {"tokenizer_hf_metaspace_split", test_tokenizer_hf_metaspace_split},
    {"tokenizer_tiktokenizer_v1", test_tokenizer_tiktokenizer_v1},
    {"tokenizer_tiktokenizer_v2", test_tokenizer_tiktokenizer_v2},
    {"tokenizer_hf_gutenberg", test_tokenizer_hf_gutenberg},
    {"tokenizer_hf_decode", test_tokenizer_hf_decode},
    {"tokenizer_hf_refusals", test_tokenizer_hf_refusals},
    {"tokenizer_special_tokens", test_tokenizer_special_tokens},
    {"tokenizer_decode_round_trip", test_tokenizer_decode_round_trip},
    {"tokenizer_threads", test_tokenizer_threads},
    {"tokenizer_load_errors", test_tokenizer_load_errors},
    {"tokenizer_json_lines", test_tokenizer_json_lines},
    {"tokenizer_preprocess_workers", test_tokenizer_preprocess_workers},
    {"tokenizer_preprocess_inputs", test_tokenizer_preprocess_inputs},
    {"tokenizer_preprocess_hf", test_tokenizer_preprocess_hf},
    {"tokenizer_preprocess_compressed", test_tokenizer_preprocess_compressed},
    {"tokenizer_preprocess_line_limit", test_tokenizer_preprocess_line_limit},
    {"tokenizer_preprocess_cancel", test_tokenizer_preprocess_cancel},
};
