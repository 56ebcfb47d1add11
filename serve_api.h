/*
 * serve_api.h — the text generation server's requests and responses as pure functions (no sockets,
 * no threads, no model): JSON body -> sv_request or an HTTP status with one line naming the field;
 * results -> the response's JSON; the text rules the server applies while tokens arrive (stop
 * strings, UTF-8 boundaries for streaming, invalid bytes made printable). Included by serve_gpt.c,
 * tests/test_serve.h and dev/fuzz/fuzz_serve.c; needs cJSON (Debian's libcjson-dev).
 *
 * Two endpoints:
 *   PUT /api (Megatron's text generation server, tools/run_text_generation_server.py): prompts (a list
 *     of 1..128 strings), tokens_to_generate (64), logprobs (false), temperature (1.0, in (0, 100]),
 *     top_k (0, 0..1000), top_p (0.0, 0..1, not with top_k), add_BOS (false), stop_on_eol,
 *     stop_on_double_eol (false), random_seed (-1: none), stop_token (the end-of-document token),
 *     and the fields Megatron validates but this build does only one way (top_p_decay, top_p_bound:
 *     0; prevent_newline_after_colon: false; length_penalty: 1). Megatron's own messages where it has
 *     them ("prompts argument required", "Maximum number of prompts is 128", ...).
 *   POST /v1/completions (OpenAI's legacy completions): model, prompt (a string or a list of them),
 *     max_tokens (16), temperature (1.0, 0..2, 0 greedy), top_p (1.0), top_k (0, an extension as
 *     vLLM's), n (1 only), best_of (1 only), stream (false), stop (a string or up to 4), logprobs
 *     (null, or 0: the sampled tokens' log-probabilities; top alternatives are refused), echo,
 *     seed, user (ignored), presence/frequency_penalty (0 only).
 * Any other field is refused (400 naming it) rather than ignored.
 */
#ifndef SERVE_API_H
#define SERVE_API_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#define SV_MAX_BODY (1 << 20)  /* request bodies above this: 413 */
#define SV_MAX_PROMPTS 128     /* Megatron's limit per request */
#define SV_MAX_STOP 4          /* stop strings per request (OpenAI's limit) */
#define SV_MAX_STOP_BYTES 256  /* bytes per stop string */

typedef enum { SV_API = 0, SV_COMPLETIONS = 1 } sv_kind;

/* A parsed, validated request. Strings are malloc'd copies (sv_request_free). */
typedef struct {
    sv_kind kind;
    int num_prompts;
    char** prompts;          /* [num_prompts], UTF-8 from the JSON */
    int tokens_to_generate;  /* /api tokens_to_generate, /v1/completions max_tokens */
    double temperature;      /* 0: greedy */
    int top_k;               /* 0: off */
    double top_p;            /* 0 or 1: off */
    int logprobs;            /* 1: return log-probabilities */
    int add_bos;             /* /api add_BOS: the end-of-document token before each prompt */
    int stop_on_eol;         /* /api: the generation ends at the first "\n" it produces */
    int stop_on_double_eol;  /* /api: ... at the first "\n\n" */
    int64_t stop_token;      /* /api stop_token; -1: the tokenizer's end-of-document token */
    int64_t seed;            /* -1: none given (the server picks one) */
    int num_stop;
    char* stop[SV_MAX_STOP]; /* /v1/completions stop strings (the text ends before the first) */
    int stream;              /* /v1/completions: server-sent events */
    int echo;                /* /v1/completions: the prompt before the completion */
    char* model;             /* /v1/completions model (echoed back), or NULL */
} sv_request;

/* Limits a request is checked against (the server's settings). */
typedef struct {
    int max_tokens;          /* tokens_to_generate / max_tokens at most this (the context) */
    int64_t vocab_size;      /* stop_token below this */
} sv_limits;

static void sv_request_free(sv_request* r) {
    if (!r) return;
    for (int i = 0; i < r->num_prompts; i++) free(r->prompts[i]);
    free(r->prompts);
    for (int i = 0; i < r->num_stop; i++) free(r->stop[i]);
    free(r->model);
    memset(r, 0, sizeof(*r));
}

static char* sv_strdup(const char* s) {
    size_t n = strlen(s) + 1;
    char* d = (char*)malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* One line into msg; returns status (an HTTP code). */
static int sv_fail(char* msg, size_t cap, int status, const char* fmt, ...) __attribute__((format(printf, 4, 5)));
static int sv_fail(char* msg, size_t cap, int status, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, cap, fmt, ap);
    va_end(ap);
    return status;
}

/* An integer JSON number (no fraction, within int64's exact doubles); booleans are not integers. */
static int sv_is_int(const cJSON* v, int64_t* out) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d) || fabs(d) > 9007199254740992.0) return 0;
    *out = (int64_t)d;
    return 1;
}

static int sv_is_number(const cJSON* v, double* out) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) return 0;
    *out = v->valuedouble;
    return 1;
}

/* Whether name is one of the n names. */
static int sv_known(const char* name, const char* const* names, int n) {
    for (int i = 0; i < n; i++) if (!strcmp(name, names[i])) return 1;
    return 0;
}

/* body -> root object, or a 400 naming what is wrong. */
static int sv_parse_object(const char* body, size_t len, cJSON** root, char* msg, size_t cap) {
    *root = NULL;
    if (len > SV_MAX_BODY) return sv_fail(msg, cap, 413, "the request body is %zu bytes; at most %d", len, SV_MAX_BODY);
    if (len == 0) return sv_fail(msg, cap, 400, "the request body is empty; a JSON object is expected");
    const char* end = NULL;
    cJSON* j = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!j) {
        size_t at = end && end >= body && end <= body + len ? (size_t)(end - body) : 0;
        return sv_fail(msg, cap, 400, "malformed JSON at byte %zu", at);
    }
    /* anything but white space after the value is an error (cJSON stops at the value's end) */
    for (const char* p = end; p && p < body + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r' && *p != 0) {
            cJSON_Delete(j);
            return sv_fail(msg, cap, 400, "malformed JSON: text after the value at byte %zu", (size_t)(p - body));
        }
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return sv_fail(msg, cap, 400, "the request body must be a JSON object");
    }
    *root = j;
    return 200;
}

/* A boolean field (absent: *out unchanged). */
static int sv_bool_field(const cJSON* root, const char* name, int* out, const char* bad, char* msg, size_t cap) {
    const cJSON* v = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!v) return 200;
    if (!cJSON_IsBool(v)) return sv_fail(msg, cap, 400, "%s", bad);
    *out = cJSON_IsTrue(v) ? 1 : 0;
    return 200;
}

/* PUT /api, Megatron's checks in Megatron's order and words. */
static int sv_parse_api(const char* body, size_t len, const sv_limits* lim, sv_request* r, char* msg, size_t cap) {
    memset(r, 0, sizeof(*r));
    r->kind = SV_API;
    r->tokens_to_generate = 64;
    r->temperature = 1.0;
    r->seed = -1;
    r->stop_token = -1;
    cJSON* root;
    int st = sv_parse_object(body, len, &root, msg, cap);
    if (st != 200) return st;
    static const char* const fields[] = {"prompts", "tokens_to_generate", "logprobs", "temperature", "top_k",
                                         "top_p", "top_p_decay", "top_p_bound", "add_BOS", "stop_on_double_eol",
                                         "stop_on_eol", "prevent_newline_after_colon", "random_seed", "stop_token",
                                         "length_penalty", "max_len", "sentences", "beam_width"};
    const cJSON* v;
    int64_t i64;
    double d;
#define SV_FAIL(...) do { st = sv_fail(msg, cap, 400, __VA_ARGS__); goto done; } while (0)
    if (!cJSON_GetObjectItemCaseSensitive(root, "prompts")) SV_FAIL("prompts argument required");
    if (cJSON_GetObjectItemCaseSensitive(root, "max_len")) SV_FAIL("max_len is no longer used.  Replace with tokens_to_generate");
    if (cJSON_GetObjectItemCaseSensitive(root, "sentences")) SV_FAIL("sentences is no longer used.  Replace with prompts");
    if (cJSON_GetObjectItemCaseSensitive(root, "beam_width")) SV_FAIL("Beam search is no longer supported.");
    for (const cJSON* c = root->child; c; c = c->next)
        if (!sv_known(c->string, fields, (int)(sizeof(fields) / sizeof(fields[0]))))
            SV_FAIL("unsupported field '%.64s'", c->string);
    v = cJSON_GetObjectItemCaseSensitive(root, "prompts");
    if (!cJSON_IsArray(v)) SV_FAIL("prompts is not a list of strings");
    {
        int n = cJSON_GetArraySize(v);
        if (n == 0) SV_FAIL("prompts is empty");
        if (n > SV_MAX_PROMPTS) SV_FAIL("Maximum number of prompts is %d", SV_MAX_PROMPTS);
        r->prompts = (char**)calloc((size_t)n, sizeof(char*));
        if (!r->prompts) { st = sv_fail(msg, cap, 500, "out of memory"); goto done; }
        for (const cJSON* p = v->child; p; p = p->next) {
            if (!cJSON_IsString(p)) SV_FAIL("prompts is not a list of strings");
            if (!(r->prompts[r->num_prompts] = sv_strdup(p->valuestring))) { st = sv_fail(msg, cap, 500, "out of memory"); goto done; }
            r->num_prompts++;
        }
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "tokens_to_generate"))) {
        if (!sv_is_int(v, &i64)) SV_FAIL("tokens_to_generate must be an integer greater than 0");
        if (i64 < 0) SV_FAIL("tokens_to_generate must be an integer greater than or equal to 0");
        if (i64 > lim->max_tokens) SV_FAIL("tokens_to_generate must be at most %d (the context)", lim->max_tokens);
        r->tokens_to_generate = (int)i64;
    } else if (r->tokens_to_generate > lim->max_tokens) { /* the default, within a small context */
        r->tokens_to_generate = lim->max_tokens;
    }
    if ((st = sv_bool_field(root, "logprobs", &r->logprobs, "logprobs must be a boolean value", msg, cap)) != 200) goto done;
    if (r->tokens_to_generate == 0 && !r->logprobs) SV_FAIL("tokens_to_generate=0 implies logprobs should be True");
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "temperature"))) {
        if (!sv_is_number(v, &d) || !(d > 0.0 && d <= 100.0))
            SV_FAIL("temperature must be a positive number less than or equal to 100.0");
        r->temperature = d;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "top_k"))) {
        if (!sv_is_int(v, &i64)) SV_FAIL("top_k must be an integer equal to or greater than 0 and less than or equal to 1000");
        if (i64 < 0 || i64 > 1000) SV_FAIL("top_k must be equal to or greater than 0 and less than or equal to 1000");
        r->top_k = (int)i64;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "top_p"))) {
        if (!sv_is_number(v, &d)) SV_FAIL("top_p must be a positive float less than or equal to 1.0");
        if (d > 0.0 && r->top_k > 0) SV_FAIL("cannot set both top-k and top-p samplings.");
        if (!(d >= 0.0 && d <= 1.0)) SV_FAIL("top_p must be less than or equal to 1.0");
        r->top_p = d;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "top_p_decay"))) {
        if (!sv_is_number(v, &d)) SV_FAIL("top_p_decay must be a positive float less than or equal to 1.0");
        if (r->top_p == 0.0) SV_FAIL("top_p_decay cannot be set without top_p");
        if (d != 0.0) SV_FAIL("top_p_decay is not supported by this server (0 only)");
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "top_p_bound"))) {
        if (!sv_is_number(v, &d)) SV_FAIL("top_p_bound must be a positive float less than or equal to top_p");
        if (r->top_p == 0.0) SV_FAIL("top_p_bound cannot be set without top_p");
        if (d != 0.0) SV_FAIL("top_p_bound is not supported by this server (0 only)");
    }
    if ((st = sv_bool_field(root, "add_BOS", &r->add_bos, "add_BOS must be a boolean value", msg, cap)) != 200) goto done;
    for (int i = 0; i < r->num_prompts; i++)
        if (!r->prompts[i][0] && !r->add_bos) SV_FAIL("Empty prompts require add_BOS=true");
    if ((st = sv_bool_field(root, "stop_on_double_eol", &r->stop_on_double_eol, "stop_on_double_eol must be a boolean value", msg, cap)) != 200) goto done;
    if ((st = sv_bool_field(root, "stop_on_eol", &r->stop_on_eol, "stop_on_eol must be a boolean value", msg, cap)) != 200) goto done;
    {
        int no_newline = 0;
        if ((st = sv_bool_field(root, "prevent_newline_after_colon", &no_newline,
                                "prevent_newline_after_colon must be a boolean value", msg, cap)) != 200) goto done;
        if (no_newline) SV_FAIL("prevent_newline_after_colon is not supported by this server (false only)");
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "random_seed"))) {
        if (!sv_is_int(v, &i64)) SV_FAIL("random_seed must be integer");
        if (i64 < 0) SV_FAIL("random_seed must be a positive integer");
        r->seed = i64;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "stop_token"))) {
        if (!sv_is_int(v, &i64)) SV_FAIL("stop_token must be an integer");
        if (i64 < 0 || i64 >= lim->vocab_size) SV_FAIL("stop_token must be in [0, %lld) (the vocabulary)", (long long)lim->vocab_size);
        r->stop_token = i64;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "length_penalty"))) {
        if (!sv_is_number(v, &d)) SV_FAIL("length_penalty must be a float");
        if (d != 1.0) SV_FAIL("length_penalty applies to beam search, which is not supported (1 only)");
    }
    st = 200;
done:
#undef SV_FAIL
    cJSON_Delete(root);
    if (st != 200) sv_request_free(r);
    return st;
}

/* POST /v1/completions. */
static int sv_parse_completions(const char* body, size_t len, const sv_limits* lim, sv_request* r, char* msg, size_t cap) {
    memset(r, 0, sizeof(*r));
    r->kind = SV_COMPLETIONS;
    r->tokens_to_generate = 16;
    r->temperature = 1.0;
    r->top_p = 1.0;
    r->seed = -1;
    r->stop_token = -1;
    cJSON* root;
    int st = sv_parse_object(body, len, &root, msg, cap);
    if (st != 200) return st;
    static const char* const fields[] = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n",
                                         "best_of", "stream", "stop", "logprobs", "echo", "seed", "user",
                                         "presence_penalty", "frequency_penalty"};
    const cJSON* v;
    int64_t i64;
    double d;
#define SV_FAIL(...) do { st = sv_fail(msg, cap, 400, __VA_ARGS__); goto done; } while (0)
    for (const cJSON* c = root->child; c; c = c->next)
        if (!sv_known(c->string, fields, (int)(sizeof(fields) / sizeof(fields[0]))))
            SV_FAIL("unsupported field '%.64s'", c->string);
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "model")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsString(v)) SV_FAIL("model must be a string");
        if (!(r->model = sv_strdup(v->valuestring))) { st = sv_fail(msg, cap, 500, "out of memory"); goto done; }
    }
    v = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (!v) SV_FAIL("prompt is required");
    {
        int n = cJSON_IsString(v) ? 1 : cJSON_IsArray(v) ? cJSON_GetArraySize(v) : -1;
        if (n < 0) SV_FAIL("prompt must be a string or a list of strings");
        if (n == 0) SV_FAIL("prompt is an empty list");
        if (n > SV_MAX_PROMPTS) SV_FAIL("prompt: at most %d prompts", SV_MAX_PROMPTS);
        r->prompts = (char**)calloc((size_t)n, sizeof(char*));
        if (!r->prompts) { st = sv_fail(msg, cap, 500, "out of memory"); goto done; }
        for (const cJSON* p = cJSON_IsString(v) ? v : v->child; p; p = cJSON_IsString(v) ? NULL : p->next) {
            if (!cJSON_IsString(p)) SV_FAIL("prompt must be a string or a list of strings (token ids are not supported)");
            if (!(r->prompts[r->num_prompts] = sv_strdup(p->valuestring))) { st = sv_fail(msg, cap, 500, "out of memory"); goto done; }
            r->num_prompts++;
        }
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "max_tokens")) && !cJSON_IsNull(v)) {
        if (!sv_is_int(v, &i64) || i64 < 0) SV_FAIL("max_tokens must be an integer >= 0");
        if (i64 > lim->max_tokens) SV_FAIL("max_tokens must be at most %d (the context)", lim->max_tokens);
        r->tokens_to_generate = (int)i64;
    } else if (r->tokens_to_generate > lim->max_tokens) { /* the default, within a small context */
        r->tokens_to_generate = lim->max_tokens;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "temperature")) && !cJSON_IsNull(v)) {
        if (!sv_is_number(v, &d) || d < 0.0 || d > 2.0) SV_FAIL("temperature must be a number in [0, 2]");
        r->temperature = d;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "top_p")) && !cJSON_IsNull(v)) {
        if (!sv_is_number(v, &d) || !(d > 0.0 && d <= 1.0)) SV_FAIL("top_p must be a number in (0, 1]");
        r->top_p = d;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "top_k")) && !cJSON_IsNull(v)) {
        if (!sv_is_int(v, &i64) || i64 < 0 || i64 > 1000) SV_FAIL("top_k must be an integer in [0, 1000]");
        r->top_k = (int)i64;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "n")) && !cJSON_IsNull(v)) {
        if (!sv_is_int(v, &i64)) SV_FAIL("n must be an integer");
        if (i64 != 1) SV_FAIL("n: only 1 completion per prompt is supported");
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "best_of")) && !cJSON_IsNull(v)) {
        if (!sv_is_int(v, &i64)) SV_FAIL("best_of must be an integer");
        if (i64 != 1) SV_FAIL("best_of > 1 not supported");
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "stream")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsBool(v)) SV_FAIL("stream must be a boolean");
        r->stream = cJSON_IsTrue(v);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "echo")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsBool(v)) SV_FAIL("echo must be a boolean");
        r->echo = cJSON_IsTrue(v);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "stop")) && !cJSON_IsNull(v)) {
        int n = cJSON_IsString(v) ? 1 : cJSON_IsArray(v) ? cJSON_GetArraySize(v) : -1;
        if (n < 0) SV_FAIL("stop must be a string or a list of strings");
        if (n > SV_MAX_STOP) SV_FAIL("stop: at most %d strings", SV_MAX_STOP);
        for (const cJSON* p = cJSON_IsString(v) ? v : v->child; p; p = cJSON_IsString(v) ? NULL : p->next) {
            if (!cJSON_IsString(p)) SV_FAIL("stop must be a string or a list of strings");
            size_t n_bytes = strlen(p->valuestring);
            if (n_bytes == 0) SV_FAIL("stop: an empty string");
            if (n_bytes > SV_MAX_STOP_BYTES) SV_FAIL("stop: a string of %zu bytes; at most %d", n_bytes, SV_MAX_STOP_BYTES);
            if (!(r->stop[r->num_stop] = sv_strdup(p->valuestring))) { st = sv_fail(msg, cap, 500, "out of memory"); goto done; }
            r->num_stop++;
        }
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "logprobs")) && !cJSON_IsNull(v)) {
        if (!sv_is_int(v, &i64) || i64 < 0) SV_FAIL("logprobs must be null or an integer >= 0");
        if (i64 > 0) SV_FAIL("logprobs > 0 (top alternatives) is not supported; 0 returns the sampled tokens' log-probabilities");
        r->logprobs = 1;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "seed")) && !cJSON_IsNull(v)) {
        if (!sv_is_int(v, &i64) || i64 < 0) SV_FAIL("seed must be an integer >= 0");
        r->seed = i64;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(root, "user")) && !cJSON_IsNull(v) && !cJSON_IsString(v))
        SV_FAIL("user must be a string");
    {
        static const char* const penalties[] = {"presence_penalty", "frequency_penalty"};
        for (int k = 0; k < 2; k++)
            if ((v = cJSON_GetObjectItemCaseSensitive(root, penalties[k])) && !cJSON_IsNull(v)) {
                if (!sv_is_number(v, &d)) SV_FAIL("%s must be a number", penalties[k]);
                if (d != 0.0) SV_FAIL("%s is not supported (0 only)", penalties[k]);
            }
    }
    if (r->tokens_to_generate == 0 && !r->echo) SV_FAIL("echo=False not supported when tokens_to_generate == 0");
    st = 200;
done:
#undef SV_FAIL
    cJSON_Delete(root);
    if (st != 200) sv_request_free(r);
    return st;
}

/* ---- text rules ---------------------------------------------------------------------------- */

/* The length of the longest prefix of s[0..n) that does not end inside a UTF-8 sequence (a lead
 * byte whose continuation bytes have not all come yet): what a stream may send now. */
static size_t sv_utf8_complete_len(const char* s, size_t n) {
    size_t back = 0;
    while (back < 4 && back < n && ((unsigned char)s[n - 1 - back] & 0xc0) == 0x80) back++;
    if (back == n) return n; /* continuation bytes alone: invalid, sent as they are (made U+FFFD) */
    unsigned char lead = (unsigned char)s[n - 1 - back];
    size_t want = lead >= 0xf0 && lead < 0xf8 ? 4 : lead >= 0xe0 ? 3 : lead >= 0xc0 ? 2 : 1;
    if (lead < 0xc0 || lead >= 0xf8) want = 1;
    return back + 1 < want ? n - 1 - back : n;
}

/* s[0..n) as valid UTF-8 (malloc'd, NUL-terminated): each byte that does not start a valid sequence
 * (and a NUL byte, which a C string cannot hold) becomes U+FFFD, as Python's errors="replace". */
static char* sv_utf8_sanitize(const char* s, size_t n) {
    char* out = (char*)malloc(3 * n + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = 0;
        uint32_t cp = 0;
        if (c >= 0x01 && c < 0x80) len = 1, cp = c;
        else if (c >= 0xc2 && c < 0xe0) len = 2, cp = c & 0x1f;
        else if (c >= 0xe0 && c < 0xf0) len = 3, cp = c & 0x0f;
        else if (c >= 0xf0 && c < 0xf5) len = 4, cp = c & 0x07;
        int ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++) {
            unsigned char b = (unsigned char)s[i + k];
            if ((b & 0xc0) != 0x80) ok = 0;
            cp = (cp << 6) | (b & 0x3f);
        }
        /* overlong forms, surrogates and code points past U+10FFFF are invalid too */
        if (ok && ((len == 3 && (cp < 0x800 || (cp >= 0xd800 && cp < 0xe000))) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff))))
            ok = 0;
        if (ok) {
            memcpy(out + o, s + i, len);
            o += len;
            i += len;
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            i += 1;
        }
    }
    out[o] = 0;
    return out;
}

/* The first position at or after `from` where one of the stop strings starts in text[0..n)
 * (*which: its index); n when none does. A stop string that straddles `from` is found, so callers
 * pass the length before the last append less the longest stop string's length plus one. */
static size_t sv_stop_find(const char* text, size_t n, size_t from, char* const* stops, int num_stops, int* which) {
    size_t best = n;
    for (int k = 0; k < num_stops; k++) {
        size_t m = strlen(stops[k]);
        if (m == 0 || m > n) continue;
        for (size_t i = from; i + m <= n && i < best; i++)
            if (!memcmp(text + i, stops[k], m)) {
                best = i;
                if (which) *which = k;
                break;
            }
    }
    return best;
}

/* What of text[0..n) a stream may send now: not a tail that could still become a stop string (a
 * proper prefix of one of them), and not the first bytes of a UTF-8 sequence still to come. */
static size_t sv_stream_safe_len(const char* text, size_t n, char* const* stops, int num_stops) {
    size_t hold = 0;
    for (int k = 0; k < num_stops; k++) {
        size_t m = strlen(stops[k]);
        for (size_t t = m > 1 ? m - 1 : 0; t > hold; t--) /* the longest tail that is a prefix */
            if (t <= n && !memcmp(text + n - t, stops[k], t)) {
                hold = t;
                break;
            }
    }
    return sv_utf8_complete_len(text, n - hold);
}

/* ---- responses ----------------------------------------------------------------------------- */

/* One prompt's outcome, as the server hands it to the builders. */
typedef struct {
    const char* prompt;      /* the prompt as given */
    const int32_t* tokens;   /* prompt (with BOS when added) then the generated tokens [num_tokens] */
    int num_tokens, num_prompt_tokens;
    const float* logprobs;   /* [num_tokens]: logprobs[i] = log p(tokens[i] | tokens[..i]); [0] unused */
    const char* text;        /* the generated text's bytes (after stop rules) */
    size_t text_len;
    char** segments;         /* [num_tokens]: each token's text (valid UTF-8) */
    const char* finish_reason; /* "stop" or "length" */
} sv_result;

/* {"error": {"message", "type", "code"}} (OpenAI's error shape, used by both endpoints). */
static char* sv_error_json(int status, const char* message) {
    cJSON* root = cJSON_CreateObject();
    cJSON* e = cJSON_AddObjectToObject(root, "error");
    char* m = sv_utf8_sanitize(message, strlen(message));
    cJSON_AddStringToObject(e, "message", m ? m : "");
    cJSON_AddStringToObject(e, "type", status == 413 ? "request_too_large" : status >= 500 ? "server_error" : "invalid_request_error");
    cJSON_AddNumberToObject(e, "code", status);
    free(m);
    char* out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

static cJSON* sv_float_array(const float* v, int n) {
    cJSON* a = cJSON_CreateArray();
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((double)v[i]));
    return a;
}

/* PUT /api's response: {"text": [prompt + generation], "segments": [[token texts]], "tokens":
 * [[ids]], "logprobs": [[log p of tokens[1..]]] (with logprobs)} as Megatron's server returns it. */
static char* sv_api_response(const sv_result* res, int n, int with_logprobs) {
    cJSON* root = cJSON_CreateObject();
    cJSON* text = cJSON_AddArrayToObject(root, "text");
    cJSON* segments = cJSON_AddArrayToObject(root, "segments");
    cJSON* logprobs = with_logprobs ? cJSON_AddArrayToObject(root, "logprobs") : NULL;
    cJSON* tokens = cJSON_AddArrayToObject(root, "tokens");
    for (int i = 0; i < n; i++) {
        const sv_result* r = &res[i];
        size_t pl = strlen(r->prompt);
        char* whole = (char*)malloc(pl + r->text_len + 1);
        if (!whole) { cJSON_Delete(root); return NULL; }
        memcpy(whole, r->prompt, pl);
        memcpy(whole + pl, r->text, r->text_len);
        char* clean = sv_utf8_sanitize(whole, pl + r->text_len);
        free(whole);
        cJSON_AddItemToArray(text, cJSON_CreateString(clean ? clean : ""));
        free(clean);
        cJSON_AddItemToArray(segments, cJSON_CreateStringArray((const char* const*)r->segments, r->num_tokens));
        if (logprobs) cJSON_AddItemToArray(logprobs, sv_float_array(r->logprobs + 1, r->num_tokens > 0 ? r->num_tokens - 1 : 0));
        cJSON_AddItemToArray(tokens, cJSON_CreateIntArray((const int*)r->tokens, r->num_tokens));
    }
    char* out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

/* One choice of a completion: its text (echo: the prompt first), and with logprobs OpenAI's
 * {"tokens", "token_logprobs", "top_logprobs": null, "text_offset"} over the generated tokens. */
static cJSON* sv_choice(const sv_result* r, int index, int echo, int with_logprobs, const char* text, size_t text_len,
                        const char* finish_reason) {
    cJSON* c = cJSON_CreateObject();
    size_t pl = echo ? strlen(r->prompt) : 0;
    char* whole = (char*)malloc(pl + text_len + 1);
    if (whole) {
        memcpy(whole, r->prompt, pl);
        memcpy(whole + pl, text, text_len);
    }
    char* clean = whole ? sv_utf8_sanitize(whole, pl + text_len) : NULL;
    free(whole);
    cJSON_AddStringToObject(c, "text", clean ? clean : "");
    free(clean);
    cJSON_AddNumberToObject(c, "index", index);
    if (with_logprobs) {
        cJSON* lp = cJSON_AddObjectToObject(c, "logprobs");
        int first = r->num_prompt_tokens, n = r->num_tokens - first;
        cJSON_AddItemToObject(lp, "tokens", cJSON_CreateStringArray((const char* const*)r->segments + first, n));
        cJSON_AddItemToObject(lp, "token_logprobs", sv_float_array(r->logprobs + first, n));
        cJSON_AddNullToObject(lp, "top_logprobs");
        cJSON* off = cJSON_AddArrayToObject(lp, "text_offset");
        size_t at = pl;
        for (int k = 0; k < n; k++) {
            cJSON_AddItemToArray(off, cJSON_CreateNumber((double)at));
            at += strlen(r->segments[first + k]);
        }
    } else {
        cJSON_AddNullToObject(c, "logprobs");
    }
    if (finish_reason) cJSON_AddStringToObject(c, "finish_reason", finish_reason);
    else cJSON_AddNullToObject(c, "finish_reason");
    return c;
}

static cJSON* sv_completion_head(const char* id, int64_t created, const char* model) {
    cJSON* root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "id", id);
    cJSON_AddStringToObject(root, "object", "text_completion");
    cJSON_AddNumberToObject(root, "created", (double)created);
    cJSON_AddStringToObject(root, "model", model ? model : "");
    return root;
}

/* POST /v1/completions without stream: one choice per prompt, and the token counts. */
static char* sv_completion_response(const sv_request* req, const sv_result* res, int n, const char* id, int64_t created,
                                    const char* model) {
    cJSON* root = sv_completion_head(id, created, req->model ? req->model : model);
    cJSON* choices = cJSON_AddArrayToObject(root, "choices");
    int64_t prompt_tokens = 0, completion_tokens = 0;
    for (int i = 0; i < n; i++) {
        cJSON_AddItemToArray(choices, sv_choice(&res[i], i, req->echo, req->logprobs, res[i].text, res[i].text_len,
                                                res[i].finish_reason));
        prompt_tokens += res[i].num_prompt_tokens;
        completion_tokens += res[i].num_tokens - res[i].num_prompt_tokens;
    }
    cJSON* usage = cJSON_AddObjectToObject(root, "usage");
    cJSON_AddNumberToObject(usage, "prompt_tokens", (double)prompt_tokens);
    cJSON_AddNumberToObject(usage, "completion_tokens", (double)completion_tokens);
    cJSON_AddNumberToObject(usage, "total_tokens", (double)(prompt_tokens + completion_tokens));
    char* out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

/* One streamed piece of choice `index`: text[0..len) (finish_reason NULL until its last event), as
 * one server-sent event "data: {...}\n\n". The tokens' log-probabilities are not streamed. */
static char* sv_completion_chunk(const sv_request* req, int index, const char* text, size_t len, const char* finish_reason,
                                 const char* id, int64_t created, const char* model) {
    cJSON* root = sv_completion_head(id, created, req->model ? req->model : model);
    cJSON* choices = cJSON_AddArrayToObject(root, "choices");
    cJSON* c = cJSON_CreateObject();
    char* clean = sv_utf8_sanitize(text, len);
    cJSON_AddStringToObject(c, "text", clean ? clean : "");
    free(clean);
    cJSON_AddNumberToObject(c, "index", index);
    cJSON_AddNullToObject(c, "logprobs");
    if (finish_reason) cJSON_AddStringToObject(c, "finish_reason", finish_reason);
    else cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddItemToArray(choices, c);
    char* json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!json) return NULL;
    size_t n = strlen(json);
    char* ev = (char*)malloc(n + 9);
    if (ev) {
        memcpy(ev, "data: ", 6);
        memcpy(ev + 6, json, n);
        memcpy(ev + 6 + n, "\n\n", 3);
    }
    cJSON_free(json);
    return ev;
}

/* The stream's last event. */
#define SV_SSE_DONE "data: [DONE]\n\n"

#endif /* SERVE_API_H */
