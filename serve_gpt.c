/*
 * serve_gpt.c — text generation from a checkpoint: Megatron's text generation server (PUT /api) and
 * OpenAI's completions (POST /v1/completions, streamed as server-sent events), or one prompt on the
 * command line.
 *
 *   ./serve_gpt serve --load CKPT [train_gpt's model and tokenizer flags] [--port 5000] [--max-batch 8]
 *                     [--max-context N] [--block-tokens 64]
 *   ./serve_gpt generate --load CKPT [flags] --prompt "text" [--tokens-to-generate 64]
 *                     [--temperature 1.0] [--top-k 0] [--top-p 0] [--seed N]
 *
 * The model and tokenizer flags are train_gpt's (train_gpt_flags.h: the same table, defaults and
 * checks; without them, the built-in job's model and GPT-2 tokenizer), so the command that trained a
 * checkpoint serves it with --load in place of --save and the data flags dropped. --fake-engine
 * (tests) replaces the model by a deterministic CPU stand-in (next token = (last * 31 + 7 + seed) %
 * vocabulary) and needs no checkpoint nor GPU; serve_gpt_fake is this file built with that engine only
 * (no CUDA), for the host tests.
 *
 * Threads: libmicrohttpd runs one thread per connection; a request is parsed and validated there
 * (serve_api.h), tokenized, and queued as a job of one sequence per prompt. One engine thread owns the
 * generator: between steps it adds queued sequences while the generator takes them (continuous
 * batching), cancels those whose client went away, steps, and hands each new token to its sequence
 * (its text grows by the token's bytes; stop strings are looked for in the text), waking the
 * connection's thread. A streaming request's thread sends what text is safe to send (not a possible
 * start of a stop string, not a cut UTF-8 character) as it comes. SIGTERM/SIGINT: the listening socket
 * closes, the requests in flight complete, then exit 0.
 * Errors before serving (flags, checkpoint, tokenizer, port): one line on stderr, exit 2 for usage,
 * 1 otherwise.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#ifdef MT_SERVE_FAKE_ONLY /* no megatron.o: the header's host implementation here */
#define MEGATRON_IMPLEMENTATION
#endif
#include "megatron.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"
#include "train_gpt_flags.h"
#include "serve_api.h"

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3), noreturn))
#endif
static void die(int code, const char* fmt, ...) {
    char line[1024];
    int n = snprintf(line, sizeof(line), "serve_gpt: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    strcat(line, "\n");
    fputs(line, stderr);
    fflush(stderr);
    exit(code);
}

/* ---- the engine behind the server: the generator, or the fake one --------------------------- */

/* What the server needs of a generation engine (megatron.h section 15b's mt_generator_* calls), so
 * that the request handling runs over the real one or the CPU fake alike. Called from the engine
 * thread only. */
typedef struct {
    void* self;
    mt_status (*add)(void* self, const int32_t* prompt, int len, const mt_sampling* s, int64_t* id, mt_error* err);
    mt_status (*step)(void* self, mt_generated* out, int max_out, int* n_out, mt_error* err);
    mt_status (*cancel)(void* self, int64_t id, mt_error* err);
    mt_status (*prompt_logprobs)(void* self, int64_t id, float* out, mt_error* err);
    void (*free)(void* self);
} sv_engine;

/* The fake: max_batch slots; a step gives each running slot its next token, (last * 31 + 7 + seed)
 * % vocabulary (seed 0 when greedy), log-probability -(token % 5 + 1) / 4; the prompt's
 * log-probabilities by the same rule. It ends a slot at a stop token, max_new_tokens or max_context,
 * as the generator does. step_ms: each step sleeps that long (a request stays in flight for tests). */
typedef struct {
    int64_t id;
    int active, prefilled, generated, max_new, len, num_stop;
    int32_t last, stop[16];
    uint64_t seed;
    int32_t* prompt;
} fake_slot;

typedef struct {
    int max_batch, max_context, step_ms;
    int64_t vocab, next_id;
    fake_slot* slots;
} fake_engine;

static float fake_logprob(int32_t token) { return -(float)(token % 5 + 1) / 4.0f; }

static mt_status fake_add(void* self, const int32_t* prompt, int len, const mt_sampling* s, int64_t* id, mt_error* err) {
    fake_engine* f = (fake_engine*)self;
    if (len < 1 || len > f->max_context - 1) return mt_fail(err, MT_ERR_ARG, "prompt of %d tokens", len);
    if (s->num_stop_tokens < 0 || s->num_stop_tokens > 16 || s->max_new_tokens < 0) return mt_fail(err, MT_ERR_ARG, "bad sampling");
    for (int i = 0; i < len; i++)
        if (prompt[i] < 0 || prompt[i] >= f->vocab) return mt_fail(err, MT_ERR_ARG, "token %d out of the vocabulary", prompt[i]);
    for (int k = 0; k < f->max_batch; k++) {
        fake_slot* sl = &f->slots[k];
        if (sl->active) continue;
        free(sl->prompt);
        memset(sl, 0, sizeof(*sl));
        sl->prompt = (int32_t*)malloc(sizeof(int32_t) * (size_t)len);
        if (!sl->prompt) return mt_fail(err, MT_ERR_OOM, "out of memory");
        memcpy(sl->prompt, prompt, sizeof(int32_t) * (size_t)len);
        sl->id = *id = f->next_id++;
        sl->active = 1;
        sl->len = len;
        sl->last = prompt[len - 1];
        sl->max_new = s->max_new_tokens;
        sl->seed = s->temperature > 0 ? s->seed : 0;
        sl->num_stop = s->num_stop_tokens;
        if (s->num_stop_tokens) memcpy(sl->stop, s->stop_tokens, sizeof(int32_t) * (size_t)s->num_stop_tokens);
        return MT_OK;
    }
    return mt_fail(err, MT_ERR_RANGE, "no free slot");
}

static mt_status fake_step(void* self, mt_generated* out, int max_out, int* n_out, mt_error* err) {
    fake_engine* f = (fake_engine*)self;
    if (f->step_ms > 0) {
        struct timespec ts = {f->step_ms / 1000, (long)(f->step_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    *n_out = 0;
    for (int k = 0; k < f->max_batch; k++) {
        fake_slot* sl = &f->slots[k];
        if (!sl->active || (sl->prefilled && sl->max_new == 0)) continue;
        sl->prefilled = 1;
        if (sl->max_new == 0) continue; /* only the prompt's log-probabilities: kept until cancelled */
        if (*n_out >= max_out) return mt_fail(err, MT_ERR_ARG, "max_out %d is below the running count", max_out);
        int32_t t = (int32_t)(((uint64_t)sl->last * 31u + 7u + sl->seed) % (uint64_t)f->vocab);
        sl->last = t;
        sl->generated++;
        sl->len++;
        int stop = 0;
        for (int i = 0; i < sl->num_stop; i++) stop |= sl->stop[i] == t;
        int finished = stop || sl->generated >= sl->max_new || sl->len >= f->max_context;
        mt_generated g = {sl->id, t, fake_logprob(t), finished};
        out[(*n_out)++] = g;
        if (finished) sl->active = 0;
    }
    return MT_OK;
}

static fake_slot* fake_find(fake_engine* f, int64_t id) {
    for (int k = 0; k < f->max_batch; k++)
        if (f->slots[k].active && f->slots[k].id == id) return &f->slots[k];
    return NULL;
}

static mt_status fake_cancel(void* self, int64_t id, mt_error* err) {
    fake_slot* sl = fake_find((fake_engine*)self, id);
    if (!sl) return mt_fail(err, MT_ERR_ARG, "unknown request %lld", (long long)id);
    sl->active = 0;
    return MT_OK;
}

static mt_status fake_prompt_logprobs(void* self, int64_t id, float* out, mt_error* err) {
    fake_slot* sl = fake_find((fake_engine*)self, id);
    if (!sl || !sl->prefilled) return mt_fail(err, MT_ERR_ARG, "request %lld: no prompt log-probabilities", (long long)id);
    int n = sl->len - sl->generated;
    for (int i = 1; i < n; i++) out[i - 1] = fake_logprob(sl->prompt[i]);
    return MT_OK;
}

static void fake_free(void* self) {
    fake_engine* f = (fake_engine*)self;
    for (int k = 0; k < f->max_batch; k++) free(f->slots[k].prompt);
    free(f->slots);
    free(f);
}

static sv_engine fake_engine_create(int max_batch, int max_context, int64_t vocab, int step_ms) {
    fake_engine* f = (fake_engine*)calloc(1, sizeof(fake_engine));
    if (!f || !(f->slots = (fake_slot*)calloc((size_t)max_batch, sizeof(fake_slot)))) die(1, "out of memory");
    f->max_batch = max_batch;
    f->max_context = max_context;
    f->vocab = vocab;
    f->step_ms = step_ms;
    sv_engine e = {f, fake_add, fake_step, fake_cancel, fake_prompt_logprobs, fake_free};
    return e;
}

#ifndef MT_SERVE_FAKE_ONLY
/* The real engine: megatron.h's mt_generator over a trainer holding the checkpoint's weights. */
typedef struct {
    mt_trainer* t;
    mt_generator* g;
} real_engine;

static mt_status real_add(void* self, const int32_t* prompt, int len, const mt_sampling* s, int64_t* id, mt_error* err) {
    return mt_generator_add(((real_engine*)self)->g, prompt, len, s, id, err);
}
static mt_status real_step(void* self, mt_generated* out, int max_out, int* n_out, mt_error* err) {
    return mt_generator_step(((real_engine*)self)->g, out, max_out, n_out, err);
}
static mt_status real_cancel(void* self, int64_t id, mt_error* err) {
    return mt_generator_cancel(((real_engine*)self)->g, id, err);
}
static mt_status real_prompt_logprobs(void* self, int64_t id, float* out, mt_error* err) {
    return mt_generator_prompt_logprobs(((real_engine*)self)->g, id, out, err);
}
static void real_free(void* self) {
    real_engine* r = (real_engine*)self;
    mt_generator_free(r->g);
    mt_trainer_free(r->t);
    free(r);
}
#endif

/* ---- requests in flight ------------------------------------------------------------------------ */

struct sv_job;

/* One prompt of a request: its tokens (prompt, then generated), their log-probabilities and the
 * generated text. Written by the engine thread under the server's lock. */
typedef struct {
    struct sv_job* job;
    int index;
    int32_t* tokens;     /* [cap] */
    float* logprobs;     /* [cap]: logprobs[i] = log p(tokens[i] | tokens[..i]) */
    int num_prompt, num_tokens, cap;
    char* text;          /* generated bytes (the stop token's excluded; stop strings cut /v1's) */
    size_t text_len, text_cap;
    size_t sent;         /* bytes of text streamed */
    int64_t id;          /* the engine's id while running */
    int state;           /* 0 queued, 1 running, 2 done */
    int final_sent;      /* streaming: its finish event is out */
    const char* finish_reason;
} sv_seq;

typedef struct sv_job {
    sv_request req;
    mt_sampling sampling;
    int32_t stop_tokens[1];
    int num_seqs, remaining; /* sequences, and those not done */
    sv_seq* seqs;
    char* stops[SV_MAX_STOP]; /* the text stop rules: /v1's stop strings, /api's "\n" or "\n\n" */
    int num_stops;
    int keep_stop;            /* /api: the text keeps the token that held the end of line */
    int cancelled;            /* the client went away: the engine drops its sequences */
    int failed;               /* the engine refused a sequence: 500 with error */
    char error[640];
    pthread_cond_t cv;        /* signalled when a sequence moves */
    struct sv_job* next;      /* the engine's queue */
    int queued_from;          /* the first sequence not yet added */
    char id[40];
    int64_t created;
} sv_job;

typedef struct {
    sv_engine eng;
    const mt_tokenizer* tok;
    int32_t eod;
    int64_t vocab;
    int max_batch, max_context;
    const char* model_name;
    pthread_mutex_t mu;
    pthread_cond_t cv_engine;   /* work for the engine thread */
    pthread_cond_t cv_idle;     /* a request completed (the drain at SIGTERM waits on it) */
    sv_job* queue_head;         /* jobs with sequences still to add, in arrival order */
    sv_job* queue_tail;
    sv_seq** running;           /* [max_batch] the engine's sequences */
    int num_running;
    int stop_engine;            /* the engine thread ends once nothing is left */
    int active_requests;        /* HTTP requests begun and not completed */
    uint64_t next_seed, next_job;
    char engine_error[640];     /* a failed step: every request gets 500 with it from then on */
} sv_server;

static void seq_free(sv_seq* s) {
    free(s->tokens);
    free(s->logprobs);
    free(s->text);
}

static void job_free(sv_job* j) {
    if (!j) return;
    for (int i = 0; i < j->num_seqs; i++) seq_free(&j->seqs[i]);
    free(j->seqs);
    for (int i = 0; i < j->num_stops; i++) free(j->stops[i]);
    sv_request_free(&j->req);
    pthread_cond_destroy(&j->cv);
    free(j);
}

/* Ends a sequence (under the lock): it counts as done and its job's waiter wakes. */
static void seq_done(sv_seq* s, const char* reason) {
    if (s->state == 2) return;
    s->state = 2;
    s->finish_reason = reason;
    s->job->remaining--;
    pthread_cond_broadcast(&s->job->cv);
}

static int text_append(sv_seq* s, const char* b, size_t n) {
    if (s->text_len + n + 1 > s->text_cap) {
        size_t cap = (s->text_len + n + 1) * 2;
        char* t = (char*)realloc(s->text, cap);
        if (!t) return -1;
        s->text = t;
        s->text_cap = cap;
    }
    memcpy(s->text + s->text_len, b, n);
    s->text_len += n;
    s->text[s->text_len] = 0;
    return 0;
}

/* A token for sequence s (under the lock): kept with its log-probability; unless it is a stop token,
 * its bytes join the text, where the stop rules are looked for. Returns 1 when a stop rule ended it
 * (the engine must cancel it unless it finished). */
static int seq_take_token(sv_server* sv, sv_seq* s, const mt_generated* g) {
    sv_job* j = s->job;
    if (s->num_tokens < s->cap) {
        s->tokens[s->num_tokens] = g->token;
        s->logprobs[s->num_tokens] = g->logprob;
        s->num_tokens++;
    }
    int is_stop = 0;
    for (int k = 0; k < j->sampling.num_stop_tokens; k++) is_stop |= j->sampling.stop_tokens[k] == g->token;
    if (is_stop) {
        seq_done(s, "stop");
        return 0;
    }
    const char* bytes = NULL;
    size_t n = mt_tokenizer_token_bytes(sv->tok, g->token, &bytes);
    size_t before = s->text_len;
    if (text_append(s, bytes, n) != 0) {
        snprintf(j->error, sizeof(j->error), "out of memory");
        j->failed = 1;
        seq_done(s, "error");
        return !g->finished;
    }
    size_t longest = 0;
    for (int k = 0; k < j->num_stops; k++) if (strlen(j->stops[k]) > longest) longest = strlen(j->stops[k]);
    if (longest) {
        size_t from = before + 1 > longest ? before + 1 - longest : 0;
        size_t at = sv_stop_find(s->text, s->text_len, from, j->stops, j->num_stops, NULL);
        if (at < s->text_len) {
            if (!j->keep_stop) {
                s->text_len = at;
                s->text[at] = 0;
            }
            seq_done(s, "stop");
            return !g->finished;
        }
    }
    if (g->finished) seq_done(s, "length");
    return 0;
}

static sv_seq* running_find(sv_server* sv, int64_t id, int* slot) {
    for (int k = 0; k < sv->num_running; k++)
        if (sv->running[k]->id == id) {
            if (slot) *slot = k;
            return sv->running[k];
        }
    return NULL;
}

static void running_remove(sv_server* sv, int slot) {
    sv->running[slot] = sv->running[--sv->num_running];
}

/* Fails every sequence of a job still waiting (under the lock). */
static void job_fail(sv_job* j, const char* why) {
    j->failed = 1;
    snprintf(j->error, sizeof(j->error), "%s", why);
    for (int i = 0; i < j->num_seqs; i++) if (j->seqs[i].state == 0) seq_done(&j->seqs[i], "error");
}

/* The engine thread: adds, cancels, steps and routes, until told to stop with nothing left. */
static void* engine_main(void* arg) {
    sv_server* sv = (sv_server*)arg;
    mt_generated* out = (mt_generated*)malloc(sizeof(mt_generated) * (size_t)sv->max_batch);
    int64_t* prefilled_now = (int64_t*)malloc(sizeof(int64_t) * (size_t)sv->max_batch);
    if (!out || !prefilled_now) die(1, "out of memory");
    mt_error err;
    pthread_mutex_lock(&sv->mu);
    for (;;) {
        while (!sv->stop_engine && !sv->queue_head && sv->num_running == 0) pthread_cond_wait(&sv->cv_engine, &sv->mu);
        if (sv->stop_engine && !sv->queue_head && sv->num_running == 0) break;
        /* cancels: the running sequences of jobs whose client went away */
        for (int k = 0; k < sv->num_running;) {
            sv_seq* s = sv->running[k];
            if (s->job->cancelled || s->state == 2) {
                sv->eng.cancel(sv->eng.self, s->id, &err); /* unknown (finished meanwhile) is fine */
                seq_done(s, "cancelled");
                running_remove(sv, k);
            } else {
                k++;
            }
        }
        /* adds: queued sequences in arrival order while the engine takes them */
        int num_added = 0;
        while (sv->queue_head) {
            sv_job* j = sv->queue_head;
            if (j->cancelled || sv->engine_error[0]) {
                if (sv->engine_error[0]) job_fail(j, sv->engine_error);
                for (int i = j->queued_from; i < j->num_seqs; i++) seq_done(&j->seqs[i], "cancelled");
                j->queued_from = j->num_seqs;
            }
            mt_status st = MT_OK;
            while (j->queued_from < j->num_seqs && sv->num_running < sv->max_batch) {
                sv_seq* s = &j->seqs[j->queued_from];
                mt_sampling smp = j->sampling;
                smp.seed = j->sampling.seed + (uint64_t)s->index;
                st = sv->eng.add(sv->eng.self, s->tokens, s->num_prompt, &smp, &s->id, &err);
                if (st != MT_OK) break;
                s->state = 1;
                sv->running[sv->num_running++] = s;
                prefilled_now[num_added++] = s->id;
                j->queued_from++;
            }
            if (st == MT_ERR_RANGE && sv->num_running == 0) /* no room with nothing running: it never fits */
                snprintf(err.message, sizeof(err.message), "prompt %d does not fit in the KV cache (--max-context, "
                         "--block-tokens)", j->queued_from);
            if (st != MT_OK && (st != MT_ERR_RANGE || sv->num_running == 0)) { /* it alone fails */
                job_fail(j, err.message);
                j->queued_from = j->num_seqs;
            }
            if (j->queued_from < j->num_seqs) break; /* full: the rest waits for a step to free room */
            sv->queue_head = j->next;
            if (!sv->queue_head) sv->queue_tail = NULL;
        }
        if (sv->num_running == 0) continue;
        pthread_mutex_unlock(&sv->mu);
        int n_out = 0;
        mt_status st = sv->eng.step(sv->eng.self, out, sv->max_batch, &n_out, &err);
        pthread_mutex_lock(&sv->mu);
        if (st != MT_OK) { /* the engine is broken: every request fails from now on, the server stays up */
            fprintf(stderr, "serve_gpt: generation step failed: %s\n", err.message);
            snprintf(sv->engine_error, sizeof(sv->engine_error), "generation failed: %.500s", err.message);
            for (int k = 0; k < sv->num_running; k++) {
                sv->running[k]->job->failed = 1;
                snprintf(sv->running[k]->job->error, sizeof(sv->running[k]->job->error), "%s", sv->engine_error);
                seq_done(sv->running[k], "error");
            }
            sv->num_running = 0;
            continue;
        }
        /* the prompts prefilled by this step: their log-probabilities, when asked for */
        for (int a = 0; a < num_added; a++) {
            sv_seq* s = running_find(sv, prefilled_now[a], NULL);
            if (!s || !s->job->req.logprobs || s->num_prompt < 2) continue;
            if (sv->eng.prompt_logprobs(sv->eng.self, s->id, s->logprobs + 1, &err) != MT_OK) {
                s->job->failed = 1;
                snprintf(s->job->error, sizeof(s->job->error), "%s", err.message);
            }
        }
        for (int i = 0; i < n_out; i++) {
            int slot;
            sv_seq* s = running_find(sv, out[i].id, &slot);
            if (!s) continue;
            if (s->state != 2 && s->job->sampling.max_new_tokens == 0) { /* only its prompt was asked for */
                seq_done(s, "length");
                running_remove(sv, slot);
                if (!out[i].finished) sv->eng.cancel(sv->eng.self, s->id, &err);
                continue;
            }
            if (s->state == 2) { /* cancelled meanwhile */
                if (out[i].finished) running_remove(sv, slot);
                continue;
            }
            if (seq_take_token(sv, s, &out[i])) sv->eng.cancel(sv->eng.self, s->id, &err);
            pthread_cond_broadcast(&s->job->cv); /* a stream sends the new text */
            if (out[i].finished || s->state == 2) running_remove(sv, slot);
        }
        /* only the prompt's log-probabilities (no new tokens): done after the prefill */
        for (int a = 0; a < num_added; a++) {
            int slot;
            sv_seq* s = running_find(sv, prefilled_now[a], &slot);
            if (s && s->job->sampling.max_new_tokens == 0) {
                sv->eng.cancel(sv->eng.self, s->id, &err);
                seq_done(s, "length");
                running_remove(sv, slot);
            }
        }
    }
    pthread_mutex_unlock(&sv->mu);
    free(out);
    free(prefilled_now);
    return NULL;
}

/* ---- a request: validated, tokenized, queued ------------------------------------------------- */

/* The job for a parsed request (taken over): each prompt tokenized (add_BOS: the end-of-document token
 * first) and checked against the context. NULL with an HTTP status and message when it cannot run. */
static sv_job* job_create(sv_server* sv, sv_request* req, int* status, char* msg, size_t cap) {
    sv_job* j = (sv_job*)calloc(1, sizeof(sv_job));
    if (!j) {
        *status = sv_fail(msg, cap, 500, "out of memory");
        sv_request_free(req);
        return NULL;
    }
    j->req = *req;
    memset(req, 0, sizeof(*req));
    pthread_cond_init(&j->cv, NULL);
    const sv_request* r = &j->req;
    j->seqs = (sv_seq*)calloc((size_t)r->num_prompts, sizeof(sv_seq));
    if (!j->seqs) goto oom;
    j->num_seqs = j->remaining = r->num_prompts;
    for (int i = 0; i < r->num_prompts; i++) {
        sv_seq* s = &j->seqs[i];
        s->job = j;
        s->index = i;
        int32_t* toks = NULL;
        size_t count = 0, tcap = 0;
        if (r->add_bos) {
            toks = (int32_t*)malloc(sizeof(int32_t) * 16);
            if (!toks) goto oom;
            tcap = 16;
            toks[count++] = sv->eod;
        }
        int32_t* body = NULL;
        size_t body_count = 0, body_cap = 0;
        if (mt_tokenizer_encode(sv->tok, r->prompts[i], strlen(r->prompts[i]), &body, &body_count, &body_cap) < 0) {
            free(toks);
            goto oom;
        }
        if (body_count + count > (size_t)sv->max_context) {
            free(toks);
            free(body);
            *status = sv_fail(msg, cap, 400, "prompt %d is %zu tokens; the context is %d tokens", i, body_count + count,
                              sv->max_context);
            job_free(j);
            return NULL;
        }
        size_t n = count + body_count;
        if (n == 0) {
            free(toks);
            free(body);
            *status = sv_fail(msg, cap, 400, "prompt %d is empty: give text, or add_BOS=true (/api)", i);
            job_free(j);
            return NULL;
        }
        if ((int64_t)n + r->tokens_to_generate > sv->max_context || (int64_t)n > sv->max_context - 1) {
            free(toks);
            free(body);
            *status = sv_fail(msg, cap, 400, "prompt %d is %zu tokens; with %d tokens to generate it exceeds the context of "
                              "%d tokens", i, n, r->tokens_to_generate, sv->max_context);
            job_free(j);
            return NULL;
        }
        s->cap = (int)n + r->tokens_to_generate;
        s->tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)s->cap);
        s->logprobs = (float*)calloc((size_t)s->cap, sizeof(float));
        if (!s->tokens || !s->logprobs) {
            free(toks);
            free(body);
            goto oom;
        }
        for (size_t k = 0; k < count; k++) s->tokens[k] = toks[k];
        for (size_t k = 0; k < body_count; k++) s->tokens[count + k] = body[k];
        s->num_prompt = s->num_tokens = (int)n;
        free(toks);
        free(body);
        (void)tcap;
    }
    /* sampling, shared by the prompts (each its own seed: the request's + its index) */
    mt_sampling* smp = &j->sampling;
    memset(smp, 0, sizeof(*smp));
    smp->temperature = (float)r->temperature;
    smp->top_k = r->top_k;
    smp->top_p = r->top_p >= 1.0 ? 0.0f : (float)r->top_p;
    smp->max_new_tokens = r->tokens_to_generate;
    smp->prompt_logprobs = r->logprobs && r->kind == SV_API;
    int64_t stop_token = r->stop_token >= 0 ? r->stop_token : sv->eod;
    if (stop_token >= 0) {
        j->stop_tokens[0] = (int32_t)stop_token;
        smp->stop_tokens = j->stop_tokens;
        smp->num_stop_tokens = 1;
    }
    pthread_mutex_lock(&sv->mu);
    smp->seed = r->seed >= 0 ? (uint64_t)r->seed : sv->next_seed++;
    snprintf(j->id, sizeof(j->id), "cmpl-%llu", (unsigned long long)sv->next_job++);
    pthread_mutex_unlock(&sv->mu);
    j->created = (int64_t)time(NULL);
    /* the text's stop rules */
    if (r->kind == SV_API && (r->stop_on_eol || r->stop_on_double_eol)) {
        if (!(j->stops[0] = sv_strdup(r->stop_on_double_eol ? "\n\n" : "\n"))) goto oom;
        j->num_stops = 1;
        j->keep_stop = 1;
    }
    for (int i = 0; i < r->num_stop; i++) {
        if (!(j->stops[j->num_stops] = sv_strdup(r->stop[i]))) goto oom;
        j->num_stops++;
    }
    return j;
oom:
    *status = sv_fail(msg, cap, 500, "out of memory");
    job_free(j);
    return NULL;
}

static void job_enqueue(sv_server* sv, sv_job* j) {
    pthread_mutex_lock(&sv->mu);
    if (sv->queue_tail) sv->queue_tail->next = j;
    else sv->queue_head = j;
    sv->queue_tail = j;
    pthread_cond_signal(&sv->cv_engine);
    pthread_mutex_unlock(&sv->mu);
}

/* Whether the peer of socket fd has closed its side (the client went away). */
static int client_gone(int fd) {
    if (fd < 0) return 0;
    struct pollfd p = {fd, POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* Waits (the lock held) until pred(j) or the client goes away (then the job is cancelled and the wait
 * continues until the engine has let go of every sequence). Returns 0 if the client went away. */
static int job_wait(sv_server* sv, sv_job* j, int fd, int (*pred)(const sv_job*)) {
    int present = 1;
    while (!pred(j) && j->remaining > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&j->cv, &sv->mu, &ts);
        if (present && client_gone(fd)) {
            present = 0;
            j->cancelled = 1;
            pthread_cond_signal(&sv->cv_engine);
        }
    }
    while (!present && j->remaining > 0) pthread_cond_wait(&j->cv, &sv->mu);
    return present;
}

static int job_all_done(const sv_job* j) { return j->remaining == 0; }

/* The builders' view of a finished sequence; segments are made here (each token's text). */
static void seq_result(sv_server* sv, const sv_seq* s, sv_result* out) {
    out->prompt = s->job->req.prompts[s->index];
    out->tokens = s->tokens;
    out->num_tokens = s->num_tokens;
    out->num_prompt_tokens = s->num_prompt;
    out->logprobs = s->logprobs;
    out->text = s->text ? s->text : "";
    out->text_len = s->text_len;
    out->finish_reason = s->finish_reason;
    out->segments = (char**)calloc((size_t)(s->num_tokens > 0 ? s->num_tokens : 1), sizeof(char*));
    for (int i = 0; out->segments && i < s->num_tokens; i++) {
        const char* b = NULL;
        size_t n = mt_tokenizer_token_bytes(sv->tok, s->tokens[i], &b);
        out->segments[i] = sv_utf8_sanitize(b, n);
        if (!out->segments[i]) out->segments[i] = sv_strdup("");
    }
}

static void results_free(sv_result* res, int n) {
    for (int i = 0; i < n; i++) {
        for (int k = 0; res[i].segments && k < res[i].num_tokens; k++) free(res[i].segments[k]);
        free(res[i].segments);
    }
    free(res);
}

/* The finished job's response body (200), or its error. */
static char* job_response(sv_server* sv, sv_job* j, int* status) {
    if (j->failed) {
        *status = 500;
        return sv_error_json(500, j->error);
    }
    sv_result* res = (sv_result*)calloc((size_t)j->num_seqs, sizeof(sv_result));
    if (!res) {
        *status = 500;
        return sv_error_json(500, "out of memory");
    }
    for (int i = 0; i < j->num_seqs; i++) seq_result(sv, &j->seqs[i], &res[i]);
    char* body = j->req.kind == SV_API ? sv_api_response(res, j->num_seqs, j->req.logprobs)
                                       : sv_completion_response(&j->req, res, j->num_seqs, j->id, j->created, sv->model_name);
    results_free(res, j->num_seqs);
    *status = body ? 200 : 500;
    return body ? body : sv_error_json(500, "out of memory");
}

/* ---- HTTP ------------------------------------------------------------------------------------- */

typedef struct {
    char* body;
    size_t len, cap;
    int too_big;
    int counted; /* in active_requests */
} sv_conn;

/* A streaming response's state: the job, and the bytes of the events made but not yet sent. */
typedef struct {
    sv_server* sv;
    sv_job* job;
    int fd;
    char* pending;
    size_t pending_len, pending_off;
    int done_sent;
} sv_stream;

static enum MHD_Result send_body(struct MHD_Connection* c, int status, char* body, const char* type) {
    struct MHD_Response* r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    enum MHD_Result ok = MHD_queue_response(c, (unsigned int)status, r);
    MHD_destroy_response(r);
    return ok;
}

static enum MHD_Result send_error(struct MHD_Connection* c, int status, const char* message) {
    char* body = sv_error_json(status, message);
    return body ? send_body(c, status, body, "application/json") : MHD_NO;
}

static int stream_append(sv_stream* st, char* ev) {
    if (!ev) return -1;
    size_t n = strlen(ev);
    char* p = (char*)realloc(st->pending, st->pending_len + n);
    if (!p) {
        free(ev);
        return -1;
    }
    st->pending = p;
    memcpy(p + st->pending_len, ev, n);
    st->pending_len += n;
    free(ev);
    return 0;
}

/* Whether a stream has something to send: new safe text, or a sequence done without its last event. */
static int stream_ready(const sv_job* j) {
    for (int i = 0; i < j->num_seqs; i++) {
        const sv_seq* s = &j->seqs[i];
        if (s->state == 2 && !s->final_sent) return 1;
        if (s->text_len > s->sent &&
            sv_stream_safe_len(s->text, s->text_len, (char* const*)j->stops, j->num_stops) > s->sent)
            return 1;
    }
    return 0;
}

/* Makes the events for what is ready (the lock held). */
static void stream_collect(sv_stream* st) {
    sv_job* j = st->job;
    for (int i = 0; i < j->num_seqs; i++) {
        sv_seq* s = &j->seqs[i];
        if (s->final_sent) continue;
        size_t upto = s->state == 2 ? s->text_len : sv_stream_safe_len(s->text, s->text_len, j->stops, j->num_stops);
        if (upto < s->sent) upto = s->sent;
        if (upto > s->sent || s->state == 2) {
            const char* reason = s->state == 2 ? s->finish_reason : NULL;
            stream_append(st, sv_completion_chunk(&j->req, i, s->text ? s->text + s->sent : "", upto - s->sent, reason,
                                                  j->id, j->created, st->sv->model_name));
            s->sent = upto;
            if (s->state == 2) s->final_sent = 1;
        }
    }
}

static ssize_t stream_read(void* cls, uint64_t pos, char* buf, size_t max) {
    sv_stream* st = (sv_stream*)cls;
    (void)pos;
    if (st->pending_off == st->pending_len) {
        st->pending_len = st->pending_off = 0;
        if (st->done_sent) return MHD_CONTENT_READER_END_OF_STREAM;
        sv_server* sv = st->sv;
        pthread_mutex_lock(&sv->mu);
        int present = job_wait(sv, st->job, st->fd, stream_ready);
        if (present) stream_collect(st);
        int all = st->job->remaining == 0;
        for (int i = 0; i < st->job->num_seqs; i++) all &= st->job->seqs[i].final_sent;
        pthread_mutex_unlock(&sv->mu);
        if (!present) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (all && !st->done_sent) {
            if (st->job->failed) { /* the error as one event before the end */
                char* e = sv_error_json(500, st->job->error);
                size_t n = e ? strlen(e) : 0;
                char* ev = e ? (char*)malloc(n + 9) : NULL;
                if (ev) snprintf(ev, n + 9, "data: %s\n\n", e);
                free(e);
                stream_append(st, ev);
            }
            stream_append(st, sv_strdup(SV_SSE_DONE));
            st->done_sent = 1;
        }
        if (st->pending_len == 0) return st->done_sent ? MHD_CONTENT_READER_END_OF_STREAM : 0;
    }
    size_t n = st->pending_len - st->pending_off;
    if (n > max) n = max;
    memcpy(buf, st->pending + st->pending_off, n);
    st->pending_off += n;
    return (ssize_t)n;
}

/* The response is gone (sent, or the client left): the engine lets go of the job, then it is freed. */
static void stream_free(void* cls) {
    sv_stream* st = (sv_stream*)cls;
    sv_server* sv = st->sv;
    pthread_mutex_lock(&sv->mu);
    if (st->job->remaining > 0) {
        st->job->cancelled = 1;
        pthread_cond_signal(&sv->cv_engine);
        while (st->job->remaining > 0) pthread_cond_wait(&st->job->cv, &sv->mu);
    }
    pthread_mutex_unlock(&sv->mu);
    job_free(st->job);
    free(st->pending);
    free(st);
}

static int connection_fd(struct MHD_Connection* c) {
    const union MHD_ConnectionInfo* info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return info ? info->connect_fd : -1;
}

static enum MHD_Result on_request(void* cls, struct MHD_Connection* c, const char* url, const char* method,
                                  const char* version, const char* upload, size_t* upload_size, void** con_cls) {
    sv_server* sv = (sv_server*)cls;
    (void)version;
    sv_conn* cn = (sv_conn*)*con_cls;
    if (!cn) { /* the first call: the headers are in */
        cn = (sv_conn*)calloc(1, sizeof(sv_conn));
        if (!cn) return MHD_NO;
        *con_cls = cn;
        pthread_mutex_lock(&sv->mu);
        sv->active_requests++;
        cn->counted = 1;
        pthread_mutex_unlock(&sv->mu);
        const char* cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > SV_MAX_BODY) cn->too_big = 1;
        return MHD_YES;
    }
    if (*upload_size) { /* a piece of the body */
        if (!cn->too_big && cn->len + *upload_size > SV_MAX_BODY) cn->too_big = 1;
        if (!cn->too_big) {
            if (cn->len + *upload_size + 1 > cn->cap) {
                size_t cap = (cn->len + *upload_size + 1) * 2;
                if (cap > SV_MAX_BODY + 1) cap = SV_MAX_BODY + 1;
                char* b = (char*)realloc(cn->body, cap);
                if (!b) return MHD_NO;
                cn->body = b;
                cn->cap = cap;
            }
            memcpy(cn->body + cn->len, upload, *upload_size);
            cn->len += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    /* the whole request */
    int is_api = !strcmp(url, "/api"), is_completions = !strcmp(url, "/v1/completions") || !strcmp(url, "/completions");
    if (!is_api && !is_completions) return send_error(c, 404, "unknown path (PUT /api, POST /v1/completions)");
    if (is_api && strcmp(method, "PUT") && strcmp(method, "POST")) return send_error(c, 405, "/api takes PUT");
    if (is_completions && strcmp(method, "POST")) return send_error(c, 405, "/v1/completions takes POST");
    if (cn->too_big) {
        char m[96];
        snprintf(m, sizeof(m), "the request body is over %d bytes", SV_MAX_BODY);
        return send_error(c, 413, m);
    }
    pthread_mutex_lock(&sv->mu);
    int broken = sv->engine_error[0] != 0;
    pthread_mutex_unlock(&sv->mu);
    if (broken) return send_error(c, 500, sv->engine_error);
    sv_limits lim = {sv->max_context, sv->vocab};
    sv_request req;
    char msg[512];
    int status = is_api ? sv_parse_api(cn->body ? cn->body : "", cn->len, &lim, &req, msg, sizeof(msg))
                        : sv_parse_completions(cn->body ? cn->body : "", cn->len, &lim, &req, msg, sizeof(msg));
    if (status != 200) return send_error(c, status, msg);
    sv_job* j = job_create(sv, &req, &status, msg, sizeof(msg));
    if (!j) return send_error(c, status, msg);
    int fd = connection_fd(c);
    job_enqueue(sv, j);
    if (j->req.stream) {
        sv_stream* st = (sv_stream*)calloc(1, sizeof(sv_stream));
        struct MHD_Response* r = st ? MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, st, stream_free) : NULL;
        if (!r) {
            if (st) free(st);
            pthread_mutex_lock(&sv->mu);
            j->cancelled = 1;
            pthread_cond_signal(&sv->cv_engine);
            while (j->remaining > 0) pthread_cond_wait(&j->cv, &sv->mu);
            pthread_mutex_unlock(&sv->mu);
            job_free(j);
            return MHD_NO;
        }
        st->sv = sv;
        st->job = j;
        st->fd = fd;
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        enum MHD_Result ok = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ok;
    }
    pthread_mutex_lock(&sv->mu);
    int present = job_wait(sv, j, fd, job_all_done);
    pthread_mutex_unlock(&sv->mu);
    if (!present) {
        job_free(j);
        return MHD_NO; /* nobody to answer */
    }
    char* body = job_response(sv, j, &status);
    job_free(j);
    return body ? send_body(c, status, body, "application/json") : MHD_NO;
}

static void on_completed(void* cls, struct MHD_Connection* c, void** con_cls, enum MHD_RequestTerminationCode code) {
    sv_server* sv = (sv_server*)cls;
    (void)c;
    (void)code;
    sv_conn* cn = (sv_conn*)*con_cls;
    if (!cn) return;
    if (cn->counted) {
        pthread_mutex_lock(&sv->mu);
        sv->active_requests--;
        pthread_cond_broadcast(&sv->cv_idle);
        pthread_mutex_unlock(&sv->mu);
    }
    free(cn->body);
    free(cn);
    *con_cls = NULL;
}

/* ---- the command line and the model ----------------------------------------------------------- */

typedef struct {
    int mode;                 /* 0 serve, 1 generate */
    int port, max_batch, max_context, block_tokens;
    int fake, fake_step_ms;
    const char* prompt;
    int tokens_to_generate;
    double temperature, top_p;
    int top_k;
    int64_t seed;
} sv_options;

static long sv_int_flag(const char* name, const char* v, long lo, long hi) {
    char* end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi) die(2, "%s %s: expected an integer in [%ld, %ld]", name, v, lo, hi);
    return x;
}

static double sv_double_flag(const char* name, const char* v, double lo, double hi) {
    char* end = NULL;
    double x = strtod(v, &end);
    if (end == v || *end || !isfinite(x) || x < lo || x > hi) die(2, "%s %s: expected a number in [%g, %g]", name, v, lo, hi);
    return x;
}

/* serve_gpt's own flags out of argv (the rest, train_gpt's, stay for its parser): argv compacted. */
static void parse_own_flags(sv_options* o, int* argc, char** argv) {
    memset(o, 0, sizeof(*o));
    o->port = 5000;
    o->max_batch = 8;
    o->tokens_to_generate = 64;
    o->temperature = 1.0;
    o->seed = -1;
    if (*argc < 2 || (strcmp(argv[1], "serve") && strcmp(argv[1], "generate"))) {
        if (*argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
            printf("usage: serve_gpt serve --load CKPT [train_gpt's model/tokenizer flags] [--port 5000] [--max-batch 8]\n"
                   "                       [--max-context N] [--block-tokens 64] [--fake-engine [--fake-step-ms MS]]\n"
                   "       serve_gpt generate --load CKPT [flags] --prompt TEXT [--tokens-to-generate 64]\n"
                   "                       [--temperature 1.0] [--top-k 0] [--top-p 0] [--seed N]\n"
                   "  serve: PUT /api (Megatron's text generation server), POST /v1/completions (OpenAI, stream=true:\n"
                   "  server-sent events). train_gpt --help lists the model and tokenizer flags.\n");
            exit(0);
        }
        die(2, "the first word is the mode: serve or generate (serve_gpt --help)");
    }
    o->mode = !strcmp(argv[1], "generate");
    int out = 1; /* argv[0] stays; the mode word goes */
    for (int i = 2; i < *argc; i++) {
        const char* a = argv[i];
        static const char* const valued[] = {"--port", "--max-batch", "--max-context", "--block-tokens", "--prompt",
                                             "--tokens-to-generate", "--temperature", "--top-k", "--top-p", "--seed",
                                             "--fake-step-ms"};
        int k = 0, nk = (int)(sizeof(valued) / sizeof(valued[0]));
        while (k < nk && strcmp(a, valued[k])) k++;
        if (!strcmp(a, "--fake-engine")) { o->fake = 1; continue; }
        if (k == nk) { argv[out++] = argv[i]; continue; }
        if (i + 1 >= *argc) die(2, "%s needs a value", a);
        const char* v = argv[++i];
        switch (k) {
            case 0: o->port = (int)sv_int_flag(a, v, 1, 65535); break;
            case 1: o->max_batch = (int)sv_int_flag(a, v, 1, 4096); break;
            case 2: o->max_context = (int)sv_int_flag(a, v, 2, 1 << 24); break;
            case 3: o->block_tokens = (int)sv_int_flag(a, v, 16, 1024); break;
            case 4: o->prompt = v; break;
            case 5: o->tokens_to_generate = (int)sv_int_flag(a, v, 0, 1 << 24); break;
            case 6: o->temperature = sv_double_flag(a, v, 0.0, 100.0); break;
            case 7: o->top_k = (int)sv_int_flag(a, v, 0, 1000); break;
            case 8: o->top_p = sv_double_flag(a, v, 0.0, 1.0); break;
            case 9: o->seed = sv_int_flag(a, v, 0, LONG_MAX); break;
            case 10: o->fake_step_ms = (int)sv_int_flag(a, v, 0, 60000); break;
        }
    }
    *argc = out;
    argv[out] = NULL;
    if (o->mode == 1 && !o->prompt) die(2, "generate needs --prompt TEXT");
    if (o->mode == 0 && o->prompt) die(2, "--prompt is for the generate mode");
}

/* The longest context the model takes: --max-position-embeddings (0: --seq-length). */
static int model_positions(const mt_config* c) {
    return c->max_position_embeddings > 0 ? c->max_position_embeddings : c->seq_length;
}

/* The tokenizer and the model's configuration from train_gpt's flags, checked against the checkpoint
 * in --load (its vocabulary); then the engine (real: the trainer holding the checkpoint's weights). */
static sv_engine open_engine(sv_options* so, tg_flags* o, mt_tokenizer** tok_out, int* max_context) {
    mt_error err;
    mt_tokenizer_args args;
    tg_tokenizer_args(o, &args);
    mt_tokenizer* tok = NULL;
    if (mt_tokenizer_load_by_type(&tok, &args, &err) != MT_OK) die(2, "%s", err.message);
    if (!tok) die(2, "--tokenizer-type NullTokenizer: the server needs a tokenizer to read and write text");
    *tok_out = tok;
    mt_config* c = &o->cfg;
    c->vocab_size = mt_tokenizer_vocab_size(tok);
    c->eod_token = mt_tokenizer_eod(tok);
    if (so->fake) {
        if (mt_config_finalize(c, &err) != MT_OK) die(2, "%s", err.message);
        *max_context = so->max_context > 0 ? so->max_context : model_positions(c);
        return fake_engine_create(so->max_batch, *max_context, c->vocab_size, so->fake_step_ms);
    }
#ifdef MT_SERVE_FAKE_ONLY
    die(2, "this build (serve_gpt_fake) has only the fake engine: give --fake-engine, or use serve_gpt");
#else
    if (!o->load) die(2, "--load CKPT_DIR is required (the checkpoint to serve)");
    mt_ckpt ck;
    if (mt_ckpt_open(&ck, o->load, -1, &err) != MT_OK) die(1, "%s", err.message);
    if (ck.header[MT_CK_TRUE_VOCAB] > 0 && ck.header[MT_CK_TRUE_VOCAB] != c->vocab_size)
        die(1, "the tokenizer's vocabulary is %lld tokens, the checkpoint in %s was trained with %lld: give its tokenizer",
            (long long)c->vocab_size, o->load, (long long)ck.header[MT_CK_TRUE_VOCAB]);
    if (ck.header[MT_CK_VOCAB] < c->vocab_size)
        die(1, "the tokenizer's vocabulary (%lld tokens) is larger than the checkpoint's (%lld, padded) in %s",
            (long long)c->vocab_size, (long long)ck.header[MT_CK_VOCAB], o->load);
    mt_config_resume_padding(c, o->load);
    if (mt_config_finalize(c, &err) != MT_OK) die(2, "%s", err.message);
    *max_context = so->max_context > 0 ? so->max_context : model_positions(c);
    if (*max_context > model_positions(c))
        die(2, "--max-context %d: the model has %d positions (--max-position-embeddings, else --seq-length)", *max_context,
            model_positions(c));
    int gpus = 0;
    if (mt_device_check(&gpus, &err) != MT_OK) die(1, "%s", err.message);
    real_engine* re = (real_engine*)calloc(1, sizeof(real_engine));
    if (!re) die(1, "out of memory");
    if (mt_trainer_create(&re->t, c, &err) != MT_OK) die(1, "%s", err.message);
    int64_t iteration = 0, consumed = 0;
    mt_trainer_set_no_verify_checkpoint(re->t, o->no_verify_checkpoint);
    if (mt_trainer_load_weights(re->t, o->load, -1, &iteration, &consumed, &err) != MT_OK) die(1, "%s", err.message);
    if (mt_trainer_load_warning(re->t)[0]) fprintf(stderr, "warning: %s\n", mt_trainer_load_warning(re->t));
    mt_generator_config gc;
    memset(&gc, 0, sizeof(gc));
    gc.max_batch = so->max_batch;
    gc.max_context = *max_context;
    gc.block_tokens = so->block_tokens;
    if (mt_generator_create(&re->g, re->t, &gc, &err) != MT_OK) die(1, "%s", err.message);
    fprintf(so->mode == 1 ? stderr : stdout, "loaded %s at iteration %lld: %d layers, hidden %d, vocabulary %lld; up to %d requests of %d tokens\n", o->load,
           (long long)iteration, c->num_layers, c->hidden_size, (long long)c->vocab_size, so->max_batch, *max_context);
    sv_engine e = {re, real_add, real_step, real_cancel, real_prompt_logprobs, real_free};
    return e;
#endif
}

/* ---- main ------------------------------------------------------------------------------------- */

static int g_signal_pipe[2] = {-1, -1}; /* SIGTERM/SIGINT wake main through it */

static void on_signal(int sig) {
    char b = (char)sig;
    ssize_t w = write(g_signal_pipe[1], &b, 1);
    (void)w;
}

int main(int argc, char** argv) {
    sv_options so;
    parse_own_flags(&so, &argc, argv);
    tg_flags o;
    char msg[4096];
    tg_flags_init(&o);
    int r = tg_flags_parse(&o, argc, argv, msg, sizeof(msg));
    if (r == 1) {
        tg_flags_help(stdout);
        return 0;
    }
    if (r < 0 || tg_flags_apply(&o, msg, sizeof(msg)) != 0) die(2, "%s", msg);
    tg_flags_info_line(&o, msg, sizeof(msg)); /* train_gpt's line naming the flags with no effect */
    if (msg[0]) fprintf(so.mode == 1 ? stderr : stdout, "%s\n", msg); /* generate: stdout is the text alone */

    signal(SIGPIPE, SIG_IGN); /* a client gone mid-write is an error return, not the end */
    sv_server* sv = (sv_server*)calloc(1, sizeof(sv_server));
    if (!sv) die(1, "out of memory");
    mt_tokenizer* tok = NULL;
    sv->eng = open_engine(&so, &o, &tok, &sv->max_context);
    sv->tok = tok;
    sv->eod = mt_tokenizer_eod(tok);
    sv->vocab = mt_tokenizer_vocab_size(tok);
    sv->max_batch = so.max_batch;
    sv->model_name = o.load ? o.load : "megatron.c";
    /* requests without a seed: --seed, then +1 each (the same order, the same texts), else from the clock */
    sv->next_seed = so.seed >= 0 ? (uint64_t)so.seed : (uint64_t)time(NULL) * 2654435761u;
    sv->running = (sv_seq**)calloc((size_t)so.max_batch, sizeof(sv_seq*));
    if (!sv->running) die(1, "out of memory");
    pthread_mutex_init(&sv->mu, NULL);
    pthread_cond_init(&sv->cv_engine, NULL);
    pthread_cond_init(&sv->cv_idle, NULL);
    pthread_t engine;
    if (pthread_create(&engine, NULL, engine_main, sv) != 0) die(1, "cannot start the engine thread");

    int status = 0;
    if (so.mode == 1) { /* generate: one prompt, its text on stdout */
        sv_request req;
        memset(&req, 0, sizeof(req));
        req.kind = SV_API;
        req.num_prompts = 1;
        req.prompts = (char**)calloc(1, sizeof(char*));
        if (!req.prompts || !(req.prompts[0] = sv_strdup(so.prompt))) die(1, "out of memory");
        req.tokens_to_generate = so.tokens_to_generate;
        req.temperature = so.temperature;
        req.top_k = so.top_k;
        req.top_p = so.top_p;
        req.seed = so.seed;
        req.stop_token = -1;
        int st;
        char m[512];
        sv_job* j = job_create(sv, &req, &st, m, sizeof(m));
        if (!j) die(2, "%s", m);
        job_enqueue(sv, j);
        pthread_mutex_lock(&sv->mu);
        job_wait(sv, j, -1, job_all_done);
        pthread_mutex_unlock(&sv->mu);
        if (j->failed) die(1, "%s", j->error);
        char* text = sv_utf8_sanitize(j->seqs[0].text ? j->seqs[0].text : "", j->seqs[0].text_len);
        printf("%s%s\n", so.prompt, text ? text : "");
        free(text);
        job_free(j);
    } else {
        if (pipe(g_signal_pipe) != 0) die(1, "pipe: %s", strerror(errno));
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_signal;
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        struct MHD_Daemon* d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC,
                                                (uint16_t)so.port, NULL, NULL, on_request, sv,
                                                MHD_OPTION_NOTIFY_COMPLETED, on_completed, sv,
                                                MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)120,
                                                MHD_OPTION_END);
        if (!d) die(1, "cannot listen on port %d (in use, or not allowed)", so.port);
        printf("serving on port %d: PUT /api, POST /v1/completions (SIGTERM: finish the requests in flight, exit)\n", so.port);
        fflush(stdout);
        char b;
        while (read(g_signal_pipe[0], &b, 1) < 0 && errno == EINTR) {}
        printf("signal %d: no new connections; finishing the requests in flight\n", (int)b);
        fflush(stdout);
        MHD_socket listening = MHD_quiesce_daemon(d); /* ours to close: new connections are refused */
        if (listening != MHD_INVALID_SOCKET) close(listening);
        pthread_mutex_lock(&sv->mu);
        while (sv->active_requests > 0) pthread_cond_wait(&sv->cv_idle, &sv->mu);
        pthread_mutex_unlock(&sv->mu);
        MHD_stop_daemon(d);
    }
    pthread_mutex_lock(&sv->mu);
    sv->stop_engine = 1;
    pthread_cond_signal(&sv->cv_engine);
    pthread_mutex_unlock(&sv->mu);
    pthread_join(engine, NULL);
    sv->eng.free(sv->eng.self);
    mt_tokenizer_free(tok);
    free(sv->running);
    free(sv);
    if (so.mode == 0) printf("stopped\n");
    return status;
}
