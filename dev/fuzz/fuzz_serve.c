/*
 * fuzz_serve — the text generation server's request parser (serve_api.h): the body through
 * sv_parse_api or sv_parse_completions (the first byte picks, and sets the limits), then for an
 * accepted request the response builders over made-up results, and the text rules (stop strings,
 * UTF-8 boundaries, sanitizing) over the body's bytes.
 *
 * Input: option byte (bit 0: /v1/completions, bits 1-7: the token limit), then the request body.
 */
#include "fuzz_common.h"
#include "serve_api.h"

/* Every string the builders return must be valid JSON again (cJSON parses it back). */
static void fz_json_back(char* s) {
    FZ_ASSERT(s != NULL, "a builder returned NULL");
    cJSON* j = cJSON_Parse(s);
    FZ_ASSERT(j != NULL, "a builder's output does not parse: %.200s", s);
    cJSON_Delete(j);
    free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const int completions = data[0] & 1;
    sv_limits lim = {1 + (data[0] >> 1), 50257};
    const char* body = (const char*)data + 1;
    size_t len = size - 1;
    char* copy = (char*)malloc(len ? len : 1); /* its own allocation, so a read past its end is seen */
    memcpy(copy, body, len);
    sv_request r;
    char msg[512];
    msg[0] = 0;
    int st = completions ? sv_parse_completions(copy, len, &lim, &r, msg, sizeof(msg))
                         : sv_parse_api(copy, len, &lim, &r, msg, sizeof(msg));
    if (st != 200) {
        FZ_ASSERT(st >= 400 && st < 600, "status %d", st);
        FZ_ASSERT(msg[0] != 0, "a refusal without its message");
        fz_json_back(sv_error_json(st, msg));
    } else {
        FZ_ASSERT(r.num_prompts >= 1 && r.num_prompts <= SV_MAX_PROMPTS, "%d prompts", r.num_prompts);
        FZ_ASSERT(r.tokens_to_generate >= 0 && r.tokens_to_generate <= lim.max_tokens, "tokens %d", r.tokens_to_generate);
        FZ_ASSERT(r.temperature >= 0 && r.top_k >= 0 && r.top_p >= 0 && r.top_p <= 1, "sampling out of range");
        FZ_ASSERT(r.num_stop >= 0 && r.num_stop <= SV_MAX_STOP, "%d stop strings", r.num_stop);
        /* results: the prompt's bytes as tokens, the stop rules applied to the prompt as if generated */
        sv_result* res = (sv_result*)calloc((size_t)r.num_prompts, sizeof(sv_result));
        int32_t toks[4] = {1, 2, 3, 4};
        float lps[4] = {0, -1, -2, -3};
        char* segs[4] = {(char*)"a", (char*)"\xc3\xa9", (char*)"", (char*)"d"}; /* the server sanitizes them */
        for (int i = 0; i < r.num_prompts; i++) {
            const char* p = r.prompts[i];
            size_t n = strlen(p);
            size_t at = sv_stop_find(p, n, 0, r.stop, r.num_stop, NULL);
            FZ_ASSERT(at <= n, "stop at %zu of %zu", at, n);
            size_t safe = sv_stream_safe_len(p, n, r.stop, r.num_stop);
            FZ_ASSERT(safe <= n, "safe %zu of %zu", safe, n);
            res[i] = (sv_result){p, toks, 4, 2, lps, p, at, segs, "stop"};
            if (r.stream) {
                char* ev = sv_completion_chunk(&r, i, p, safe, NULL, "cmpl-0", 0, "m");
                FZ_ASSERT(ev && !strncmp(ev, "data: ", 6) && strlen(ev) >= 8 && !strcmp(ev + strlen(ev) - 2, "\n\n"),
                          "a malformed event");
                ev[strlen(ev) - 2] = 0;
                fz_json_back(sv_strdup(ev + 6));
                free(ev);
            }
        }
        fz_json_back(r.kind == SV_API ? sv_api_response(res, r.num_prompts, r.logprobs)
                                      : sv_completion_response(&r, res, r.num_prompts, "cmpl-0", 0, "m"));
        free(res);
        sv_request_free(&r);
    }
    /* the text rules over raw bytes */
    char* clean = sv_utf8_sanitize(copy, len);
    FZ_ASSERT(clean != NULL, "sanitize");
    size_t cut = sv_utf8_complete_len(copy, len);
    FZ_ASSERT(cut <= len && len - cut <= 3, "complete length %zu of %zu", cut, len);
    free(clean);
    free(copy);
    return 0;
}
