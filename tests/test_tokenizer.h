/* tests/test_tokenizer.h — host tests of prepro/tokenizer.h: the four BPE tokenizers against
 * tiktoken's ids (vectors from dev/gen_tokenizer_vectors.py), decoding, thread safety, load
 * errors, the JSONL parser and the preprocess_data pipeline (worker-count independence, empty
 * documents, bad lines). The GPT-2 files live in dev/data/gpt2; the cl100k/o200k/Llama-3 rank
 * files are read from ../shared/data and those tests skip when it is absent. Run from the repo root. */
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#define TT_GPT2_VOCAB "dev/data/gpt2/gpt2-vocab.json"
#define TT_GPT2_MERGES "dev/data/gpt2/gpt2-merges.txt"
#define TT_VECTORS "dev/data/tokenizer/"

typedef struct {
    const char* name;  /* vector file name */
    const char* rank_file;
    mt_tokenizer_kind kind;
    int64_t vocab;
    int32_t eod;
} tt_spec;

static const tt_spec tt_specs[4] = {
    {"gpt2", "../shared/data/tiktoken/r50k_base.tiktoken", MT_TOKENIZER_GPT2, 50257, 50256},
    {"cl100k_base", "../shared/data/tiktoken/cl100k_base.tiktoken", MT_TOKENIZER_CL100K, 100277, 100257},
    {"o200k_base", "../shared/data/tiktoken/o200k_base.tiktoken", MT_TOKENIZER_O200K, 200019, 199999},
    {"llama3", "../shared/data/llama3/tokenizer.model", MT_TOKENIZER_LLAMA3, 128256, 128001},
};

static int tt_exists(const char* path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

static uint32_t tt_u32(const char* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Checks every case of a vector file; returns the number of mismatches (printing the first few),
 * or -1 if the file is unreadable. */
static int tt_check_vectors(const mt_tokenizer* tok, const char* name, int* num_cases) {
    char path[256];
    size_t size = 0;
    snprintf(path, sizeof(path), TT_VECTORS "%s.bin", name);
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
                printf("    %s case %u (%u bytes '%.40s...'): %lld tokens, expected %u; first difference at token %zu\n", name, c,
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

static test_result tt_vectors(int which, int gpt2_files) {
    const tt_spec* s = &tt_specs[which];
    mt_tokenizer* tok = NULL;
    mt_error err;
    if (gpt2_files) {
        EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    } else {
        if (!tt_exists(s->rank_file)) SKIP("%s not found (shared data absent)", s->rank_file);
        EXPECT_OK(mt_tokenizer_load_tiktoken(&tok, s->rank_file, s->kind, &err), &err);
    }
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

static test_result test_tokenizer_gpt2_bpe_files(void) { return tt_vectors(0, 1); }
static test_result test_tokenizer_r50k_base(void) { return tt_vectors(0, 0); }
static test_result test_tokenizer_cl100k_base(void) { return tt_vectors(1, 0); }
static test_result test_tokenizer_o200k_base(void) { return tt_vectors(2, 0); }
static test_result test_tokenizer_llama3(void) { return tt_vectors(3, 0); }

static test_result test_tokenizer_special_tokens(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    const char* b = NULL;
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
    size_t n = mt_tokenizer_token_bytes(tok, 50256, &b);
    EXPECT(n == 13 && memcmp(b, "<|endoftext|>", 13) == 0, "token 50256 is not <|endoftext|>");
    EXPECT(mt_tokenizer_token_id(tok, "<|endoftext|>", 13) == 50256, "lookup of <|endoftext|>");
    EXPECT(mt_tokenizer_token_id(tok, " the", 4) == 262, "' the' is %d", mt_tokenizer_token_id(tok, " the", 4));
    EXPECT(mt_tokenizer_token_bytes(tok, 50257, &b) == 0 && mt_tokenizer_token_bytes(tok, -1, &b) == 0, "out-of-range ids");
    /* Special-token text is ordinary text. */
    int32_t* ids = NULL;
    size_t count = 0, cap = 0;
    mt_tokenizer_encode(tok, "<|endoftext|>", 13, &ids, &count, &cap);
    EXPECT(count > 1, "<|endoftext|> encoded to %zu tokens", count);
    for (size_t k = 0; k < count; k++) EXPECT(ids[k] != 50256, "special token produced by ordinary encoding");
    free(ids);
    mt_tokenizer_free(tok);
    if (!tt_exists(tt_specs[3].rank_file)) SKIP("Llama-3 tokenizer.model not found");
    EXPECT_OK(mt_tokenizer_load_tiktoken(&tok, tt_specs[3].rank_file, MT_TOKENIZER_LLAMA3, &err), &err);
    EXPECT(mt_tokenizer_token_id(tok, "<|begin_of_text|>", 17) == 128000, "<|begin_of_text|>");
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

static test_result test_tokenizer_threads(void) {
    mt_tokenizer* tok = NULL;
    mt_error err;
    size_t size = 0, count = 0, cap = 0;
    int32_t* ref = NULL;
    char* text = test_read_file("dev/data/tinyshakespeare.txt", &size);
    EXPECT(text != NULL, "cannot read dev/data/tinyshakespeare.txt");
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, TT_GPT2_VOCAB, TT_GPT2_MERGES, &err), &err);
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
    free(text);
    mt_tokenizer_free(tok);
    EXPECT(same, "threads encoding one text at once got different ids");
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
    if (tt_exists(tt_specs[1].rank_file)) { /* cl100k's ranks as GPT-2: <|endoftext|> 50256 is taken */
        st = mt_tokenizer_load_tiktoken(&tok, tt_specs[1].rank_file, MT_TOKENIZER_GPT2, &err);
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

static const test_case tokenizer_tests[] = {
    {"tokenizer_gpt2_bpe_files", test_tokenizer_gpt2_bpe_files},
    {"tokenizer_r50k_base", test_tokenizer_r50k_base},
    {"tokenizer_cl100k_base", test_tokenizer_cl100k_base},
    {"tokenizer_o200k_base", test_tokenizer_o200k_base},
    {"tokenizer_llama3", test_tokenizer_llama3},
    {"tokenizer_special_tokens", test_tokenizer_special_tokens},
    {"tokenizer_decode_round_trip", test_tokenizer_decode_round_trip},
    {"tokenizer_threads", test_tokenizer_threads},
    {"tokenizer_load_errors", test_tokenizer_load_errors},
    {"tokenizer_json_lines", test_tokenizer_json_lines},
    {"tokenizer_preprocess_workers", test_tokenizer_preprocess_workers},
    {"tokenizer_preprocess_inputs", test_tokenizer_preprocess_inputs},
};
