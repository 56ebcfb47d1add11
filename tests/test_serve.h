/* tests/test_serve.h — the text generation server (serve_gpt.c, serve_api.h): the request parser and
 * validator of PUT /api and POST /v1/completions (every field, every bad type, the bounds), the text
 * rules (stop strings, UTF-8 boundaries, sanitizing), the response builders and the SSE framing; and
 * the server itself, serve_gpt_fake (serve_gpt.c's CPU fake engine, next token = (last * 31 + 7 +
 * seed) % vocabulary), started on a free port and driven with curl: concurrent requests, bad
 * requests, a stream, clients that go away, SIGTERM with a request in flight.
 * Needs cJSON (built with MT_HAVE_CJSON, else every test skips); the server tests need serve_gpt_fake
 * (make serve_gpt_fake) and curl. The real engine's server run is dev/serve_check.sh (GPU machine). */
#ifndef MT_TEST_SERVE_H
#define MT_TEST_SERVE_H

#ifdef MT_HAVE_CJSON
#include "serve_api.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>

static const sv_limits serve_test_limits = {1024, 50257};

/* Parses body with the endpoint's parser; the status, and the message in msg. */
static int serve_parse(int completions, const char* body, sv_request* r, char* msg, size_t cap) {
    msg[0] = 0;
    return completions ? sv_parse_completions(body, strlen(body), &serve_test_limits, r, msg, cap)
                       : sv_parse_api(body, strlen(body), &serve_test_limits, r, msg, cap);
}

static test_result test_serve_api_fields(void) {
    sv_request r;
    char msg[512];
    /* the defaults (Megatron's) */
    EXPECT(serve_parse(0, "{\"prompts\": [\"Hello\"]}", &r, msg, sizeof(msg)) == 200, "%s", msg);
    EXPECT(r.kind == SV_API && r.num_prompts == 1 && !strcmp(r.prompts[0], "Hello"), "prompts");
    EXPECT(r.tokens_to_generate == 64 && r.temperature == 1.0 && r.top_k == 0 && r.top_p == 0.0 && !r.logprobs &&
               !r.add_bos && !r.stop_on_eol && !r.stop_on_double_eol && r.seed == -1 && r.stop_token == -1,
           "defaults");
    sv_request_free(&r);
    /* every field given */
    const char* all = "{\"prompts\": [\"a\", \"caf\\u00e9\", \"\"], \"tokens_to_generate\": 7, \"logprobs\": true, "
                      "\"temperature\": 0.5, \"top_k\": 0, \"top_p\": 0.9, \"top_p_decay\": 0.0, \"top_p_bound\": 0.0, "
                      "\"add_BOS\": true, \"stop_on_eol\": true, \"stop_on_double_eol\": true, "
                      "\"prevent_newline_after_colon\": false, \"random_seed\": 1234, \"stop_token\": 198, "
                      "\"length_penalty\": 1.0}";
    EXPECT(serve_parse(0, all, &r, msg, sizeof(msg)) == 200, "%s", msg);
    EXPECT(r.num_prompts == 3 && !strcmp(r.prompts[1], "caf\xc3\xa9") && r.prompts[2][0] == 0, "prompts");
    EXPECT(r.tokens_to_generate == 7 && r.logprobs == 1 && r.temperature == 0.5 && r.top_p == 0.9 &&
               r.add_bos && r.stop_on_eol && r.stop_on_double_eol && r.seed == 1234 && r.stop_token == 198,
           "values");
    sv_request_free(&r);
    /* top_k alone; tokens_to_generate 0 with logprobs; 128 prompts */
    EXPECT(serve_parse(0, "{\"prompts\": [\"a\"], \"top_k\": 1000, \"tokens_to_generate\": 0, \"logprobs\": true}", &r,
                       msg, sizeof(msg)) == 200, "%s", msg);
    EXPECT(r.top_k == 1000 && r.tokens_to_generate == 0, "top_k");
    sv_request_free(&r);
    char many[2048] = "{\"prompts\": [";
    for (int i = 0; i < 128; i++) strcat(many, i ? ",\"p\"" : "\"p\"");
    strcat(many, "]}");
    EXPECT(serve_parse(0, many, &r, msg, sizeof(msg)) == 200 && r.num_prompts == 128, "128 prompts: %s", msg);
    sv_request_free(&r);
    return TEST_PASS;
}

typedef struct {
    const char* body;
    int status;
    const char* message; /* a part of the message */
} serve_bad_case;

static test_result serve_expect_refusals(int completions, const serve_bad_case* cases, int n) {
    for (int i = 0; i < n; i++) {
        sv_request r;
        char msg[512];
        int st = serve_parse(completions, cases[i].body, &r, msg, sizeof(msg));
        EXPECT(st == cases[i].status, "%s: status %d (%s), want %d", cases[i].body, st, msg, cases[i].status);
        EXPECT(strstr(msg, cases[i].message) != NULL, "%s: message '%s', want '%s'", cases[i].body, msg, cases[i].message);
        if (st == 200) sv_request_free(&r);
    }
    return TEST_PASS;
}

static test_result test_serve_api_refusals(void) {
    static const serve_bad_case cases[] = {
        {"", 400, "empty"},
        {"{\"prompts\": [\"a\"]", 400, "malformed JSON"},
        {"{\"prompts\": [\"a\"]} x", 400, "text after the value"},
        {"[\"a\"]", 400, "must be a JSON object"},
        {"{}", 400, "prompts argument required"},
        {"{\"prompts\": [\"a\"], \"max_len\": 3}", 400, "max_len is no longer used"},
        {"{\"prompts\": [\"a\"], \"sentences\": [\"a\"]}", 400, "sentences is no longer used"},
        {"{\"prompts\": [\"a\"], \"beam_width\": 2}", 400, "Beam search is no longer supported"},
        {"{\"prompts\": [\"a\"], \"bogus\": 1}", 400, "unsupported field 'bogus'"},
        {"{\"prompts\": \"a\"}", 400, "prompts is not a list of strings"},
        {"{\"prompts\": [\"a\", 3]}", 400, "prompts is not a list of strings"},
        {"{\"prompts\": []}", 400, "prompts is empty"},
        {"{\"prompts\": [\"a\"], \"tokens_to_generate\": \"5\"}", 400, "tokens_to_generate must be an integer"},
        {"{\"prompts\": [\"a\"], \"tokens_to_generate\": 1.5}", 400, "tokens_to_generate must be an integer"},
        {"{\"prompts\": [\"a\"], \"tokens_to_generate\": true}", 400, "tokens_to_generate must be an integer"},
        {"{\"prompts\": [\"a\"], \"tokens_to_generate\": -1}", 400, "greater than or equal to 0"},
        {"{\"prompts\": [\"a\"], \"tokens_to_generate\": 1025}", 400, "at most 1024"},
        {"{\"prompts\": [\"a\"], \"tokens_to_generate\": 1e300}", 400, "tokens_to_generate must be an integer"},
        {"{\"prompts\": [\"a\"], \"logprobs\": 1}", 400, "logprobs must be a boolean value"},
        {"{\"prompts\": [\"a\"], \"tokens_to_generate\": 0}", 400, "tokens_to_generate=0 implies logprobs should be True"},
        {"{\"prompts\": [\"a\"], \"temperature\": 0}", 400, "temperature must be a positive number"},
        {"{\"prompts\": [\"a\"], \"temperature\": 100.5}", 400, "temperature must be a positive number"},
        {"{\"prompts\": [\"a\"], \"temperature\": \"hot\"}", 400, "temperature must be a positive number"},
        {"{\"prompts\": [\"a\"], \"top_k\": 2.5}", 400, "top_k must be an integer"},
        {"{\"prompts\": [\"a\"], \"top_k\": 1001}", 400, "less than or equal to 1000"},
        {"{\"prompts\": [\"a\"], \"top_k\": -1}", 400, "equal to or greater than 0"},
        {"{\"prompts\": [\"a\"], \"top_p\": \"x\"}", 400, "top_p must be a positive float"},
        {"{\"prompts\": [\"a\"], \"top_k\": 5, \"top_p\": 0.5}", 400, "cannot set both top-k and top-p"},
        {"{\"prompts\": [\"a\"], \"top_p\": 1.5}", 400, "top_p must be less than or equal to 1.0"},
        {"{\"prompts\": [\"a\"], \"top_p_decay\": 0.5}", 400, "top_p_decay cannot be set without top_p"},
        {"{\"prompts\": [\"a\"], \"top_p\": 0.5, \"top_p_decay\": 0.5}", 400, "top_p_decay is not supported"},
        {"{\"prompts\": [\"a\"], \"top_p\": 0.5, \"top_p_decay\": \"x\"}", 400, "top_p_decay must be a positive float"},
        {"{\"prompts\": [\"a\"], \"top_p_bound\": 0.5}", 400, "top_p_bound cannot be set without top_p"},
        {"{\"prompts\": [\"a\"], \"top_p\": 0.5, \"top_p_bound\": 0.1}", 400, "top_p_bound is not supported"},
        {"{\"prompts\": [\"a\"], \"add_BOS\": \"yes\"}", 400, "add_BOS must be a boolean value"},
        {"{\"prompts\": [\"\"]}", 400, "Empty prompts require add_BOS=true"},
        {"{\"prompts\": [\"a\"], \"stop_on_eol\": 1}", 400, "stop_on_eol must be a boolean value"},
        {"{\"prompts\": [\"a\"], \"stop_on_double_eol\": null}", 400, "stop_on_double_eol must be a boolean value"},
        {"{\"prompts\": [\"a\"], \"prevent_newline_after_colon\": true}", 400, "prevent_newline_after_colon is not supported"},
        {"{\"prompts\": [\"a\"], \"prevent_newline_after_colon\": 0}", 400, "prevent_newline_after_colon must be a boolean"},
        {"{\"prompts\": [\"a\"], \"random_seed\": \"1\"}", 400, "random_seed must be integer"},
        {"{\"prompts\": [\"a\"], \"random_seed\": -2}", 400, "random_seed must be a positive integer"},
        {"{\"prompts\": [\"a\"], \"stop_token\": 1.5}", 400, "stop_token must be an integer"},
        {"{\"prompts\": [\"a\"], \"stop_token\": 50257}", 400, "stop_token must be in [0, 50257)"},
        {"{\"prompts\": [\"a\"], \"length_penalty\": \"x\"}", 400, "length_penalty must be a float"},
        {"{\"prompts\": [\"a\"], \"length_penalty\": 2}", 400, "length_penalty applies to beam search"},
    };
    if (serve_expect_refusals(0, cases, (int)(sizeof(cases) / sizeof(cases[0]))) != TEST_PASS) return TEST_FAIL;
    /* 129 prompts; a body over 1 MiB (413, before any parse) */
    char many[2048] = "{\"prompts\": [";
    for (int i = 0; i < 129; i++) strcat(many, i ? ",\"p\"" : "\"p\"");
    strcat(many, "]}");
    serve_bad_case over = {many, 400, "Maximum number of prompts is 128"};
    if (serve_expect_refusals(0, &over, 1) != TEST_PASS) return TEST_FAIL;
    size_t big = SV_MAX_BODY + 1;
    char* body = (char*)malloc(big);
    memset(body, ' ', big);
    sv_request r;
    char msg[512];
    EXPECT(sv_parse_api(body, big, &serve_test_limits, &r, msg, sizeof(msg)) == 413, "%s", msg);
    free(body);
    return TEST_PASS;
}

static test_result test_serve_completions_fields(void) {
    sv_request r;
    char msg[512];
    EXPECT(serve_parse(1, "{\"prompt\": \"Once\"}", &r, msg, sizeof(msg)) == 200, "%s", msg);
    EXPECT(r.kind == SV_COMPLETIONS && r.num_prompts == 1 && !strcmp(r.prompts[0], "Once") && r.tokens_to_generate == 16 &&
               r.temperature == 1.0 && r.top_p == 1.0 && r.top_k == 0 && !r.stream && !r.echo && !r.logprobs &&
               r.num_stop == 0 && r.seed == -1 && !r.model,
           "defaults");
    sv_request_free(&r);
    const char* all = "{\"model\": \"gpt\", \"prompt\": [\"a\", \"b\"], \"max_tokens\": 5, \"temperature\": 0, "
                      "\"top_p\": 0.5, \"top_k\": 3, \"n\": 1, \"best_of\": 1, \"stream\": true, \"stop\": [\"\\n\", \"END\"], "
                      "\"logprobs\": 0, \"echo\": true, \"seed\": 9, \"user\": \"me\", \"presence_penalty\": 0, "
                      "\"frequency_penalty\": 0.0}";
    EXPECT(serve_parse(1, all, &r, msg, sizeof(msg)) == 200, "%s", msg);
    EXPECT(r.num_prompts == 2 && !strcmp(r.prompts[1], "b") && r.tokens_to_generate == 5 && r.temperature == 0.0 &&
               r.top_p == 0.5 && r.top_k == 3 && r.stream && r.echo && r.logprobs && r.seed == 9 &&
               !strcmp(r.model, "gpt") && r.num_stop == 2 && !strcmp(r.stop[0], "\n") && !strcmp(r.stop[1], "END"),
           "values");
    sv_request_free(&r);
    EXPECT(serve_parse(1, "{\"prompt\": \"a\", \"stop\": \"x\", \"max_tokens\": null, \"logprobs\": null}", &r, msg,
                       sizeof(msg)) == 200, "%s", msg);
    EXPECT(r.num_stop == 1 && !strcmp(r.stop[0], "x") && r.tokens_to_generate == 16 && !r.logprobs, "stop string");
    sv_request_free(&r);
    EXPECT(serve_parse(1, "{\"prompt\": \"a\", \"max_tokens\": 0, \"echo\": true}", &r, msg, sizeof(msg)) == 200, "%s", msg);
    sv_request_free(&r);
    return TEST_PASS;
}

static test_result test_serve_completions_refusals(void) {
    static const serve_bad_case cases[] = {
        {"{\"max_tokens\": 5}", 400, "prompt is required"},
        {"{\"prompt\": 5}", 400, "prompt must be a string or a list of strings"},
        {"{\"prompt\": []}", 400, "prompt is an empty list"},
        {"{\"prompt\": [[1, 2]]}", 400, "token ids are not supported"},
        {"{\"prompt\": \"a\", \"suffix\": \"b\"}", 400, "unsupported field 'suffix'"},
        {"{\"prompt\": \"a\", \"model\": 3}", 400, "model must be a string"},
        {"{\"prompt\": \"a\", \"max_tokens\": -1}", 400, "max_tokens must be an integer >= 0"},
        {"{\"prompt\": \"a\", \"max_tokens\": \"4\"}", 400, "max_tokens must be an integer >= 0"},
        {"{\"prompt\": \"a\", \"max_tokens\": 99999999}", 400, "max_tokens must be at most 1024"},
        {"{\"prompt\": \"a\", \"temperature\": 2.5}", 400, "temperature must be a number in [0, 2]"},
        {"{\"prompt\": \"a\", \"temperature\": -0.1}", 400, "temperature must be a number in [0, 2]"},
        {"{\"prompt\": \"a\", \"top_p\": 0}", 400, "top_p must be a number in (0, 1]"},
        {"{\"prompt\": \"a\", \"top_p\": true}", 400, "top_p must be a number in (0, 1]"},
        {"{\"prompt\": \"a\", \"top_k\": -3}", 400, "top_k must be an integer in [0, 1000]"},
        {"{\"prompt\": \"a\", \"n\": 2}", 400, "n: only 1 completion"},
        {"{\"prompt\": \"a\", \"n\": \"1\"}", 400, "n must be an integer"},
        {"{\"prompt\": \"a\", \"best_of\": 3}", 400, "best_of > 1 not supported"},
        {"{\"prompt\": \"a\", \"stream\": \"yes\"}", 400, "stream must be a boolean"},
        {"{\"prompt\": \"a\", \"echo\": 1}", 400, "echo must be a boolean"},
        {"{\"prompt\": \"a\", \"stop\": 3}", 400, "stop must be a string or a list of strings"},
        {"{\"prompt\": \"a\", \"stop\": [\"a\", 3]}", 400, "stop must be a string or a list of strings"},
        {"{\"prompt\": \"a\", \"stop\": [\"a\", \"b\", \"c\", \"d\", \"e\"]}", 400, "stop: at most 4 strings"},
        {"{\"prompt\": \"a\", \"stop\": \"\"}", 400, "stop: an empty string"},
        {"{\"prompt\": \"a\", \"logprobs\": 2}", 400, "logprobs > 0 (top alternatives) is not supported"},
        {"{\"prompt\": \"a\", \"logprobs\": true}", 400, "logprobs must be null or an integer"},
        {"{\"prompt\": \"a\", \"seed\": -1}", 400, "seed must be an integer >= 0"},
        {"{\"prompt\": \"a\", \"user\": 5}", 400, "user must be a string"},
        {"{\"prompt\": \"a\", \"presence_penalty\": 0.5}", 400, "presence_penalty is not supported"},
        {"{\"prompt\": \"a\", \"frequency_penalty\": \"x\"}", 400, "frequency_penalty must be a number"},
        {"{\"prompt\": \"a\", \"max_tokens\": 0}", 400, "echo=False not supported when tokens_to_generate == 0"},
    };
    if (serve_expect_refusals(1, cases, (int)(sizeof(cases) / sizeof(cases[0]))) != TEST_PASS) return TEST_FAIL;
    /* a stop string over its byte limit */
    char body[600];
    snprintf(body, sizeof(body), "{\"prompt\": \"a\", \"stop\": \"%0*d\"}", SV_MAX_STOP_BYTES + 1, 0);
    serve_bad_case long_stop = {body, 400, "at most 256"};
    return serve_expect_refusals(1, &long_stop, 1);
}

/* The text rules: UTF-8 boundaries, sanitizing, stop strings found across appends, what a stream holds back. */
static test_result test_serve_text_rules(void) {
    EXPECT(sv_utf8_complete_len("ab", 2) == 2, "ascii");
    EXPECT(sv_utf8_complete_len("a\xc3", 2) == 1, "a cut 2-byte character");
    EXPECT(sv_utf8_complete_len("a\xc3\xa9", 3) == 3, "a whole 2-byte character");
    EXPECT(sv_utf8_complete_len("a\xe2\x82", 3) == 1, "a cut 3-byte character");
    EXPECT(sv_utf8_complete_len("a\xf0\x9f\x98", 4) == 1, "a cut 4-byte character");
    EXPECT(sv_utf8_complete_len("a\xf0\x9f\x98\x80", 5) == 5, "a whole 4-byte character");
    EXPECT(sv_utf8_complete_len("\x80\x80", 2) == 2, "continuation bytes alone pass (made U+FFFD later)");
    char* s = sv_utf8_sanitize("a\xff" "b\xc3" "\xa9\xc3", 6);
    EXPECT(s && !strcmp(s, "a\xef\xbf\xbd" "b\xc3\xa9\xef\xbf\xbd"), "sanitized: %s", s);
    free(s);
    s = sv_utf8_sanitize("\xed\xa0\x80" "\xc0\xaf" "x\0y", 8); /* a surrogate, an overlong '/', a NUL */
    EXPECT(s && !strcmp(s, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd" "x\xef\xbf\xbdy"), "sanitized: %s", s);
    free(s);
    char* stops[2] = {(char*)"END", (char*)"\n\n"};
    int which = -1;
    const char* t = "hello E";
    EXPECT(sv_stop_find(t, strlen(t), 0, stops, 2, &which) == strlen(t), "no stop yet");
    EXPECT(sv_stream_safe_len(t, strlen(t), stops, 2) == 6, "the 'E' that may start END is held back");
    t = "hello ENDx\n\n";
    EXPECT(sv_stop_find(t, strlen(t), 4, stops, 2, &which) == 6 && which == 0, "END at 6 (which %d)", which);
    EXPECT(sv_stop_find(t, strlen(t), 7, stops, 2, &which) == 10 && which == 1, "the double newline after 7");
    t = "ab\n";
    EXPECT(sv_stream_safe_len(t, 3, stops, 2) == 2, "a newline that may become two is held back");
    EXPECT(sv_stream_safe_len("ab\xc3", 3, stops, 0) == 2, "a cut character is held back");
    EXPECT(sv_stream_safe_len("abc", 3, stops, 0) == 3, "nothing to hold");
    return TEST_PASS;
}

/* The builders: Megatron's /api shape, OpenAI's completion and its stream events, the error body. */
static test_result test_serve_responses(void) {
    int32_t toks[4] = {10, 11, 12, 13};
    float lps[4] = {0.0f, -0.5f, -1.25f, -2.0f};
    char* segs[4] = {(char*)"He", (char*)"llo", (char*)" w", (char*)"\xc3\xa9"};
    sv_result res = {"Hello", toks, 4, 2, lps, " w\xc3\xa9", 4, segs, "length"};
    char* out = sv_api_response(&res, 1, 1);
    cJSON* j = cJSON_Parse(out);
    EXPECT(j, "api response does not parse: %s", out);
    cJSON* text = cJSON_GetObjectItem(j, "text");
    EXPECT(cJSON_GetArraySize(text) == 1 && !strcmp(cJSON_GetArrayItem(text, 0)->valuestring, "Hello w\xc3\xa9"), "%s", out);
    cJSON* seg = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "segments"), 0);
    EXPECT(cJSON_GetArraySize(seg) == 4 && !strcmp(cJSON_GetArrayItem(seg, 3)->valuestring, "\xc3\xa9"), "%s", out);
    cJSON* lp = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "logprobs"), 0);
    EXPECT(cJSON_GetArraySize(lp) == 3 && cJSON_GetArrayItem(lp, 0)->valuedouble == -0.5 &&
               cJSON_GetArrayItem(lp, 2)->valuedouble == -2.0, "logprobs of tokens[1..]: %s", out);
    cJSON* tk = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "tokens"), 0);
    EXPECT(cJSON_GetArraySize(tk) == 4 && cJSON_GetArrayItem(tk, 3)->valueint == 13, "%s", out);
    cJSON_Delete(j);
    free(out);
    out = sv_api_response(&res, 1, 0);
    j = cJSON_Parse(out);
    EXPECT(j && !cJSON_GetObjectItem(j, "logprobs"), "no logprobs unless asked: %s", out);
    cJSON_Delete(j);
    free(out);

    sv_request req;
    memset(&req, 0, sizeof(req));
    req.kind = SV_COMPLETIONS;
    req.logprobs = 1;
    req.echo = 1;
    out = sv_completion_response(&req, &res, 1, "cmpl-7", 1700000000, "tiny");
    j = cJSON_Parse(out);
    EXPECT(j, "completion does not parse: %s", out);
    EXPECT(!strcmp(cJSON_GetObjectItem(j, "object")->valuestring, "text_completion") &&
               !strcmp(cJSON_GetObjectItem(j, "id")->valuestring, "cmpl-7") &&
               !strcmp(cJSON_GetObjectItem(j, "model")->valuestring, "tiny") &&
               cJSON_GetObjectItem(j, "created")->valuedouble == 1700000000.0, "%s", out);
    cJSON* c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    EXPECT(!strcmp(cJSON_GetObjectItem(c0, "text")->valuestring, "Hello w\xc3\xa9") &&
               !strcmp(cJSON_GetObjectItem(c0, "finish_reason")->valuestring, "length") &&
               cJSON_GetObjectItem(c0, "index")->valueint == 0, "echo: %s", out);
    cJSON* l = cJSON_GetObjectItem(c0, "logprobs");
    EXPECT(cJSON_GetArraySize(cJSON_GetObjectItem(l, "tokens")) == 2 &&
               cJSON_GetArrayItem(cJSON_GetObjectItem(l, "token_logprobs"), 1)->valuedouble == -2.0 &&
               cJSON_IsNull(cJSON_GetObjectItem(l, "top_logprobs")) &&
               cJSON_GetArrayItem(cJSON_GetObjectItem(l, "text_offset"), 1)->valueint == 7, "logprobs: %s", out);
    cJSON* usage = cJSON_GetObjectItem(j, "usage");
    EXPECT(cJSON_GetObjectItem(usage, "prompt_tokens")->valueint == 2 &&
               cJSON_GetObjectItem(usage, "completion_tokens")->valueint == 2 &&
               cJSON_GetObjectItem(usage, "total_tokens")->valueint == 4, "usage: %s", out);
    cJSON_Delete(j);
    free(out);

    /* a stream event: "data: " + one JSON object + a blank line; the cut character made U+FFFD */
    char* ev = sv_completion_chunk(&req, 3, "ab\xc3", 3, NULL, "cmpl-7", 5, "tiny");
    EXPECT(ev && !strncmp(ev, "data: {", 7) && !strcmp(ev + strlen(ev) - 3, "}\n\n"), "event: %s", ev);
    ev[strlen(ev) - 2] = 0;
    j = cJSON_Parse(ev + 6);
    c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    EXPECT(j && cJSON_GetObjectItem(c0, "index")->valueint == 3 && cJSON_IsNull(cJSON_GetObjectItem(c0, "finish_reason")) &&
               !strcmp(cJSON_GetObjectItem(c0, "text")->valuestring, "ab\xef\xbf\xbd"), "event: %s", ev + 6);
    cJSON_Delete(j);
    free(ev);
    ev = sv_completion_chunk(&req, 0, "", 0, "stop", "cmpl-7", 5, "tiny");
    EXPECT(ev && strstr(ev, "\"finish_reason\":\"stop\""), "last event: %s", ev);
    free(ev);
    EXPECT(!strcmp(SV_SSE_DONE, "data: [DONE]\n\n"), "the end");

    out = sv_error_json(400, "bad \xff field");
    j = cJSON_Parse(out);
    cJSON* e = cJSON_GetObjectItem(j, "error");
    EXPECT(e && !strcmp(cJSON_GetObjectItem(e, "message")->valuestring, "bad \xef\xbf\xbd field") &&
               cJSON_GetObjectItem(e, "code")->valueint == 400 &&
               !strcmp(cJSON_GetObjectItem(e, "type")->valuestring, "invalid_request_error"), "%s", out);
    cJSON_Delete(j);
    free(out);
    return TEST_PASS;
}

/* ---- the server process (serve_gpt_fake) ---- */

#define SERVE_FAKE_BIN "./serve_gpt_fake"
#define SERVE_VOCAB 50257

typedef struct {
    pid_t pid;
    int port;
    char log[320];
    char dir[256];
} serve_proc;

static int serve_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof(a);
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr*)&a, sizeof(a)) == 0 && getsockname(fd, (struct sockaddr*)&a, &n) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

/* Starts serve_gpt_fake serve --fake-engine with extra flags (NULL-terminated) on a free port; waits for
 * its "serving on port" line. 0 when it serves. */
static int serve_start(serve_proc* p, const char* const* extra) {
    memset(p, 0, sizeof(*p));
    snprintf(p->dir, sizeof(p->dir), "/tmp/mt_serve_test_XXXXXX");
    if (!mkdtemp(p->dir)) return -1;
    snprintf(p->log, sizeof(p->log), "%s/server.log", p->dir);
    p->port = serve_free_port();
    if (p->port < 0) return -1;
    char port[16];
    snprintf(port, sizeof(port), "%d", p->port);
    const char* argv[32] = {SERVE_FAKE_BIN, "serve", "--fake-engine", "--port", port};
    int n = 5;
    for (int i = 0; extra && extra[i] && n < 31; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    fflush(stdout);
    p->pid = fork();
    if (p->pid == 0) {
        int fd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(SERVE_FAKE_BIN, (char* const*)argv);
        _exit(127);
    }
    if (p->pid < 0) return -1;
    for (int i = 0; i < 200; i++) { /* 20 s */
        char* log = test_read_file(p->log, NULL);
        int up = log && strstr(log, "serving on port");
        free(log);
        if (up) return 0;
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            p->pid = -1;
            return -1;
        }
        usleep(100000);
    }
    return -1;
}

/* SIGTERM, then its exit status (-1: it had to be killed after 20 s). */
static int serve_stop(serve_proc* p) {
    if (p->pid <= 0) return -1;
    kill(p->pid, SIGTERM);
    for (int i = 0; i < 200; i++) {
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            p->pid = -1;
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        }
        usleep(100000);
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = -1;
    return -1;
}

static void serve_cleanup(serve_proc* p) {
    if (p->pid > 0) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, NULL, 0);
    }
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", p->dir);
    if (system(cmd) != 0) printf("    note: could not remove %s\n", p->dir);
}

/* Writes body to a file in the server's directory; curl sends it (no shell quoting of JSON). */
static void serve_write(const serve_proc* p, const char* name, const char* body) {
    char path[300];
    snprintf(path, sizeof(path), "%s/%s", p->dir, name);
    FILE* f = fopen(path, "wb");
    if (f) {
        fputs(body, f);
        fclose(f);
    }
}

/* curl METHOD path with the body file; the HTTP status, the response in out. */
static int serve_curl(const serve_proc* p, const char* method, const char* path, const char* body_file, char* out,
                      size_t cap, const char* curl_extra) {
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "curl -s -N %s -X %s -H 'Content-Type: application/json' --data-binary @%s/%s "
             "-w '\\n%%{http_code}' http://127.0.0.1:%d%s", curl_extra ? curl_extra : "", method, p->dir, body_file,
             p->port, path);
    test_command_output(cmd, out, cap);
    char* last = strrchr(out, '\n');
    if (!last) return -1;
    int code = atoi(last + 1);
    *last = 0;
    return code;
}

/* A response's tokens follow the fake's rule from the prompt on: tokens[i] = (tokens[i-1] * 31 + 7 +
 * seed) % V; returns the generated count, or -1 on a break. */
static int serve_check_fake_tokens(const cJSON* tokens, int num_prompt, uint64_t seed) {
    int n = cJSON_GetArraySize(tokens);
    for (int i = num_prompt; i < n; i++) {
        uint64_t prev = (uint64_t)cJSON_GetArrayItem(tokens, i - 1)->valuedouble;
        if ((uint64_t)cJSON_GetArrayItem(tokens, i)->valuedouble != (prev * 31u + 7u + seed) % SERVE_VOCAB) return -1;
    }
    return n - num_prompt;
}

static test_result test_serve_fake_server(void) {
    if (access(SERVE_FAKE_BIN, X_OK) != 0) SKIP("serve_gpt_fake is not built (make serve_gpt_fake: libmicrohttpd-dev, libcjson-dev)");
    if (system("command -v curl >/dev/null 2>&1") != 0) SKIP("curl is not installed");
    serve_proc p;
    static const char* const flags[] = {"--max-batch", "4", "--max-context", "96", "--fake-step-ms", "20", NULL};
    if (serve_start(&p, flags) != 0) {
        char* log = test_read_file(p.log, NULL);
        printf("    server log: %s\n", log ? log : "(none)");
        free(log);
        serve_cleanup(&p);
        EXPECT(0, "serve_gpt_fake did not start");
    }
    static char out[1 << 16];
    test_result result = TEST_FAIL;
    int code;
    cJSON* j = NULL;
    /* one /api request: text = prompt + generation, tokens by the fake's rule with seed 100 + index */
    serve_write(&p, "api.json", "{\"prompts\": [\"Hello world\", \"Once upon a time\"], \"tokens_to_generate\": 6, "
                                "\"logprobs\": true, \"random_seed\": 100}");
    code = serve_curl(&p, "PUT", "/api", "api.json", out, sizeof(out), NULL);
    if (code != 200 || !(j = cJSON_Parse(out))) { printf("    FAIL /api: %d %s\n", code, out); goto done; }
    for (int i = 0; i < 2; i++) {
        cJSON* tokens = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "tokens"), i);
        int num_prompt = i == 0 ? 2 : 4; /* GPT-2: "Hello", " world" / "Once", " upon", " a", " time" */
        int gen = serve_check_fake_tokens(tokens, num_prompt, 100 + (uint64_t)i);
        const char* text = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "text"), i)->valuestring;
        int logprobs = cJSON_GetArraySize(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "logprobs"), i));
        int segments = cJSON_GetArraySize(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "segments"), i));
        if (gen != 6 || strncmp(text, i ? "Once upon a time" : "Hello world", i ? 16 : 11) ||
            logprobs != num_prompt + 5 || segments != num_prompt + 6) {
            printf("    FAIL /api prompt %d: %d generated, %d logprobs, %d segments: %s\n", i, gen, logprobs, segments, out);
            goto done;
        }
    }
    cJSON_Delete(j);
    j = NULL;
    /* concurrency: 8 requests at once on 4 slots (each its own seed) come back whole and by the rule */
    {
        char cmd[4096];
        int used = snprintf(cmd, sizeof(cmd), "cd %s; ", p.dir);
        for (int k = 0; k < 8; k++) {
            char name[32], body[256];
            snprintf(name, sizeof(name), "c%d.json", k);
            snprintf(body, sizeof(body), "{\"prompt\": \"request %d\", \"max_tokens\": %d, \"seed\": %d}", k, 10 + k, 1000 + k);
            serve_write(&p, name, body);
            used += snprintf(cmd + used, sizeof(cmd) - (size_t)used,
                             "(curl -s -X POST --data-binary @c%d.json -o r%d.json -w '%%{http_code}' "
                             "http://127.0.0.1:%d/v1/completions > s%d.txt) & ", k, k, p.port, k);
        }
        snprintf(cmd + used, sizeof(cmd) - (size_t)used, "wait");
        test_command_output(cmd, out, sizeof(out));
        for (int k = 0; k < 8; k++) {
            char path[300];
            snprintf(path, sizeof(path), "%s/s%d.txt", p.dir, k);
            char* s = test_read_file(path, NULL);
            snprintf(path, sizeof(path), "%s/r%d.json", p.dir, k);
            char* r = test_read_file(path, NULL);
            cJSON* rj = r ? cJSON_Parse(r) : NULL;
            cJSON* usage = rj ? cJSON_GetObjectItem(rj, "usage") : NULL;
            int ok = s && !strcmp(s, "200") && usage && cJSON_GetObjectItem(usage, "completion_tokens")->valueint == 10 + k;
            if (!ok) printf("    FAIL concurrent request %d: %s %s\n", k, s ? s : "(no status)", r ? r : "(no body)");
            cJSON_Delete(rj);
            free(s);
            free(r);
            if (!ok) goto done;
        }
    }
    /* bad requests: each its status and a JSON error; the server keeps serving */
    {
        static const struct { const char* method; const char* path; const char* body; int status; const char* part; } bad[] = {
            {"PUT", "/api", "{\"prompts\": [\"a\"", 400, "malformed JSON"},
            {"PUT", "/api", "{\"prompts\": [1]}", 400, "prompts is not a list of strings"},
            {"PUT", "/api", "{\"prompts\": [\"a\"], \"tokens_to_generate\": 100000}", 400, "at most 96"},
            {"POST", "/v1/completions", "{\"prompt\": \"a\", \"n\": 3}", 400, "only 1 completion"},
            {"GET", "/api", "{}", 405, "PUT"},
            {"POST", "/nowhere", "{}", 404, "unknown path"},
        };
        for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
            serve_write(&p, "bad.json", bad[k].body);
            code = serve_curl(&p, bad[k].method, bad[k].path, "bad.json", out, sizeof(out), NULL);
            j = cJSON_Parse(out);
            if (code != bad[k].status || !j || !cJSON_GetObjectItem(j, "error") || !strstr(out, bad[k].part)) {
                printf("    FAIL bad request %zu: %d %s\n", k, code, out);
                goto done;
            }
            cJSON_Delete(j);
            j = NULL;
        }
        /* a prompt longer than the context (96 tokens) */
        char body[2048] = "{\"prompts\": [\"";
        for (int i = 0; i < 120; i++) strcat(body, " word");
        strcat(body, "\"], \"tokens_to_generate\": 1}");
        serve_write(&p, "long.json", body);
        code = serve_curl(&p, "PUT", "/api", "long.json", out, sizeof(out), NULL);
        if (code != 400 || !strstr(out, "the context is 96 tokens")) { printf("    FAIL long prompt: %d %s\n", code, out); goto done; }
        /* a body over 1 MiB: 413 */
        char path[300];
        snprintf(path, sizeof(path), "%s/big.json", p.dir);
        FILE* f = fopen(path, "wb");
        for (int i = 0; f && i < (1 << 20) / 64 + 2; i++) fputs("                                                               \n", f);
        if (f) fclose(f);
        code = serve_curl(&p, "PUT", "/api", "big.json", out, sizeof(out), NULL);
        if (code != 413) { printf("    FAIL big body: %d %s\n", code, out); goto done; }
    }
    /* a stream: data events whose texts add up to the non-stream completion's, then [DONE] */
    {
        serve_write(&p, "s.json", "{\"prompt\": \"Stream me\", \"max_tokens\": 12, \"seed\": 5, \"stream\": true}");
        code = serve_curl(&p, "POST", "/v1/completions", "s.json", out, sizeof(out), NULL);
        static char streamed[8192];
        streamed[0] = 0;
        int events = 0, finished = 0;
        const char* at = out;
        const char* done_at = strstr(out, "data: [DONE]\n\n");
        while (code == 200 && (at = strstr(at, "data: {")) != NULL) {
            const char* end = strstr(at, "\n\n");
            if (!end) break;
            char one[4096];
            snprintf(one, sizeof(one), "%.*s", (int)(end - at - 6), at + 6);
            cJSON* ev = cJSON_Parse(one);
            cJSON* c0 = ev ? cJSON_GetArrayItem(cJSON_GetObjectItem(ev, "choices"), 0) : NULL;
            if (c0) {
                strncat(streamed, cJSON_GetObjectItem(c0, "text")->valuestring, sizeof(streamed) - strlen(streamed) - 1);
                finished += cJSON_IsString(cJSON_GetObjectItem(c0, "finish_reason"));
            }
            cJSON_Delete(ev);
            events++;
            at = end;
        }
        serve_write(&p, "ns.json", "{\"prompt\": \"Stream me\", \"max_tokens\": 12, \"seed\": 5}");
        static char whole[8192];
        int code2 = serve_curl(&p, "POST", "/v1/completions", "ns.json", whole, sizeof(whole), NULL);
        j = cJSON_Parse(whole);
        const char* text = j ? cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "text")->valuestring : "";
        if (code != 200 || code2 != 200 || !done_at || events < 2 || finished != 1 || strcmp(streamed, text)) {
            printf("    FAIL stream: %d events, %d finished, streamed '%s' vs '%s': %s\n", events, finished, streamed, text, out);
            goto done;
        }
        cJSON_Delete(j);
        j = NULL;
    }
    /* clients that go away: 4 long requests cut by curl after 0.3 s free their slots (a short one then
     * completes at once; were they kept, 90 tokens x 20 ms would hold every slot until 1.8 s) */
    {
        serve_write(&p, "long_gen.json", "{\"prompt\": \"go\", \"max_tokens\": 90}");
        char cmd[1024];
        snprintf(cmd, sizeof(cmd), "cd %s && for k in 1 2 3 4; do (curl -s -m 0.3 -X POST --data-binary @long_gen.json "
                 "http://127.0.0.1:%d/v1/completions >/dev/null 2>&1 &); done; sleep 0.6", p.dir, p.port);
        test_command_output(cmd, out, sizeof(out));
        struct timeval t0, t1;
        gettimeofday(&t0, NULL);
        serve_write(&p, "short.json", "{\"prompt\": \"quick\", \"max_tokens\": 2}");
        code = serve_curl(&p, "POST", "/v1/completions", "short.json", out, sizeof(out), NULL);
        gettimeofday(&t1, NULL);
        double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-6 * (double)(t1.tv_usec - t0.tv_usec);
        if (code != 200 || s > 0.6) { printf("    FAIL after clients left: %d in %.2f s: %s\n", code, s, out); goto done; }
    }
    /* SIGTERM with a request in flight: it completes whole, the server exits 0, the port closes */
    {
        serve_write(&p, "inflight.json", "{\"prompts\": [\"last one\"], \"tokens_to_generate\": 60, \"random_seed\": 3}");
        char cmd[1024];
        snprintf(cmd, sizeof(cmd), "curl -s -X PUT --data-binary @%s/inflight.json -o %s/inflight.out -w '%%{http_code}' "
                 "http://127.0.0.1:%d/api > %s/inflight.code 2>&1 & echo $!", p.dir, p.dir, p.port, p.dir);
        test_command_output(cmd, out, sizeof(out));
        pid_t curl_pid = (pid_t)atoi(out);
        usleep(250000); /* the request is in flight (60 steps of 20 ms) */
        int exit_code = serve_stop(&p);
        while (curl_pid > 0 && kill(curl_pid, 0) == 0) usleep(50000);
        char path[300];
        snprintf(path, sizeof(path), "%s/inflight.code", p.dir);
        char* c = test_read_file(path, NULL);
        snprintf(path, sizeof(path), "%s/inflight.out", p.dir);
        char* r = test_read_file(path, NULL);
        cJSON* rj = r ? cJSON_Parse(r) : NULL;
        int gen = rj ? serve_check_fake_tokens(cJSON_GetArrayItem(cJSON_GetObjectItem(rj, "tokens"), 0), 2, 3) : -2;
        char* log = test_read_file(p.log, NULL);
        int ok = exit_code == 0 && c && !strcmp(c, "200") && gen == 60 && log && strstr(log, "stopped");
        if (!ok) printf("    FAIL SIGTERM: exit %d, status %s, %d generated, log: %s\n", exit_code, c ? c : "-", gen, log ? log : "-");
        cJSON_Delete(rj);
        free(c);
        free(r);
        free(log);
        if (!ok) goto done;
        snprintf(cmd, sizeof(cmd), "curl -s -m 2 -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/api", p.port);
        test_command_output(cmd, out, sizeof(out));
        if (strcmp(out, "000") != 0) { printf("    FAIL the port still answers after exit: %s\n", out); goto done; }
    }
    result = TEST_PASS;
done:
    cJSON_Delete(j);
    serve_cleanup(&p);
    return result;
}

/* Bad startup: a port in use, a bad flag, no --fake-engine in the fake build: one line, non-zero exit. */
static test_result test_serve_startup_refusals(void) {
    if (access(SERVE_FAKE_BIN, X_OK) != 0) SKIP("serve_gpt_fake is not built (make serve_gpt_fake: libmicrohttpd-dev, libcjson-dev)");
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t n = sizeof(a);
    EXPECT(fd >= 0 && bind(fd, (struct sockaddr*)&a, sizeof(a)) == 0 && listen(fd, 1) == 0 &&
               getsockname(fd, (struct sockaddr*)&a, &n) == 0, "a listening socket");
    char cmd[512], out[4096];
    snprintf(cmd, sizeof(cmd), SERVE_FAKE_BIN " serve --fake-engine --port %d 2>&1; echo \"exit $?\"", ntohs(a.sin_port));
    test_command_output(cmd, out, sizeof(out));
    close(fd);
    EXPECT(strstr(out, "serve_gpt: cannot listen on port") && strstr(out, "exit 1") && !strstr(out, "serving on"),
           "port in use: %s", out);
    static const struct { const char* args; const char* part; const char* exit; } cases[] = {
        {"serve --fake-engine --port 0", "--port 0: expected an integer in [1, 65535]", "exit 2"},
        {"serve --fake-engine --max-batch 0", "--max-batch 0", "exit 2"},
        {"serve --fake-engine --num-layerz 3", "unknown flag --num-layerz", "exit 2"},
        {"serve --load /nonexistent", "has only the fake engine", "exit 2"},
        {"generate --fake-engine", "generate needs --prompt", "exit 2"},
        {"train", "the first word is the mode", "exit 2"},
        {"serve --fake-engine --vocab-file /nonexistent.json --merge-file /nonexistent.txt", "nonexistent", "exit 2"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        snprintf(cmd, sizeof(cmd), SERVE_FAKE_BIN " %s 2>&1; echo \"exit $?\"", cases[k].args);
        test_command_output(cmd, out, sizeof(out));
        EXPECT(strstr(out, cases[k].part) && strstr(out, cases[k].exit), "%s: %s", cases[k].args, out);
    }
    /* generate: one prompt, greedy, its text on stdout (the fake's tokens, detokenized) */
    snprintf(cmd, sizeof(cmd), SERVE_FAKE_BIN " generate --fake-engine --prompt 'Hello world' --tokens-to-generate 3 "
             "--temperature 0 2>&1; echo \"exit $?\"");
    test_command_output(cmd, out, sizeof(out));
    EXPECT(!strncmp(out, "Hello world", 11) && strstr(out, "exit 0"), "generate: %s", out);
    return TEST_PASS;
}

static const test_case serve_tests[] = {
    {"serve_api_fields", test_serve_api_fields},
    {"serve_api_refusals", test_serve_api_refusals},
    {"serve_completions_fields", test_serve_completions_fields},
    {"serve_completions_refusals", test_serve_completions_refusals},
    {"serve_text_rules", test_serve_text_rules},
    {"serve_responses", test_serve_responses},
    {"serve_fake_server", test_serve_fake_server},
    {"serve_startup_refusals", test_serve_startup_refusals},
};

#else /* built without cJSON */

static test_result test_serve_skipped(void) { SKIP("built without cJSON (libcjson-dev): the server's tests need it"); }
static const test_case serve_tests[] = {
    {"serve", test_serve_skipped},
};

#endif

#endif
