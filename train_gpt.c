/*
 * train_gpt.c — the command-line trainer: Megatron's pretrain_gpt.py flags -> mt_config, the data
 * pipeline (Megatron's .bin/.idx datasets and sample index), the training loop through the trainer
 * API, Megatron's log line, evaluation, checkpoints and a text sample at the end.
 *
 *   ./train_gpt                                  the built-in job: a small GPT on tiny shakespeare
 *   ./train_gpt --num-layers 12 --hidden-size 768 ... --data-path my_text_document
 *
 * Without --data-path every flag defaults to the built-in job (the corpus is tokenized on first use
 * into dev/data/tinyshakespeare_text_document.{bin,idx}). With --data-path, Megatron's defaults and
 * required flags apply. An unknown flag or an inconsistent configuration is one line and exit 2.
 */
#include <errno.h>
#include <stdint.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#ifdef MT_USE_MPI
#include <mpi.h>
#endif

#include "megatron.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

#include "train_gpt_flags.h"

static int g_rank = 0, g_world = 1; /* for error lines only: which of the N processes failed */

static void die(int code, const char* fmt, ...) {
    /* one write of the whole line, so that the ranks' lines under mpirun do not interleave */
    char line[1024];
    int n = g_world > 1 ? snprintf(line, sizeof(line), "train_gpt: rank %d: ", g_rank)
                        : snprintf(line, sizeof(line), "train_gpt: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    strcat(line, "\n");
    fputs(line, stderr);
    fflush(stderr);
#ifdef MT_USE_MPI
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized && g_world > 1) MPI_Abort(MPI_COMM_WORLD, code); /* ends the other ranks */
    if (initialized && !finalized) MPI_Finalize(); /* alone: no abort banner after the line above */
#endif
    exit(code);
}

/* The watchdog's handler (mt_trainer_on_collective_timeout), on its own thread: a collective that
 * cannot complete leaves nothing to save; one line, then exit 1 (mpirun then ends the other ranks). */
static void collective_timeout(const char* message, void* user) {
    (void)user;
    fprintf(stderr, "train_gpt: %s\n", message);
    fflush(stderr);
    fflush(stdout);
    _exit(1);
}

/* ---- flags (the table, the parser and --help are in train_gpt_flags.h) ------------------------ */

static void parse_args(tg_flags* o, int argc, char** argv) {
    char msg[4096]; /* every unknown flag of the line, each with its nearest known name */
    tg_flags_init(o);
    int r = tg_flags_parse(o, argc, argv, msg, sizeof(msg));
    if (r == 1) {
        tg_flags_help(stdout);
        exit(0);
    }
    if (r < 0 || tg_flags_apply(o, msg, sizeof(msg)) != 0) die(2, "%s", msg);
    if (o->builtin) o->log_throughput = 1; /* the built-in job shows its speed */
}

/* ---- tokenizer and the built-in corpus ------------------------------------------------------- */

/* Megatron's --tokenizer-type names and meanings (prepro/tokenizer.h, mt_tokenizer_load_by_type);
 * NullTokenizer gives no tokenizer (--vocab-size only). */
static mt_tokenizer* load_tokenizer(tg_flags* o) {
    mt_error err;
    mt_tokenizer* tok = NULL;
    mt_tokenizer_args args;
    tg_tokenizer_args(o, &args);
    if (mt_tokenizer_load_by_type(&tok, &args, &err) != MT_OK) die(2, "%s", err.message);
    if (tok && mt_tokenizer_eod(tok) < 0 && o->sample_tokens > 0) {
        printf("the tokenizer names no end-of-document token (eos_token): no text sample is printed\n");
        o->sample_tokens = 0;
    }
    if (o->builtin && strcmp(args.type, "GPT2BPETokenizer")) /* its cached dataset is GPT-2's */
        die(2, "the built-in job (no --data-path) uses GPT2BPETokenizer; give --data-path for data made with %s", args.type);
    return tok;
}

/* Tokenizes dev/data/tinyshakespeare.txt into Megatron's format, one document per blank-line
 * separated passage with the end-of-document token appended (preprocess_data --append-eod). */
static void prepare_builtin_corpus(const mt_tokenizer* tok, const char* prefix) {
    char path[512];
    snprintf(path, sizeof(path), "%s.idx", prefix);
    if (access(path, R_OK) == 0) return;
    const char* text_path = "dev/data/tinyshakespeare.txt";
    mt_error err;
    char* text = NULL;
    size_t text_bytes = 0;
    if (mt_read_file(text_path, (size_t)1 << 30, &text, &text_bytes, &err) != MT_OK)
        die(1, "%s (the built-in corpus: run from the repository root)", err.message);
    long size = (long)text_bytes;
    mt_indexed_writer* w = NULL;
    if (mt_indexed_writer_open(&w, prefix, mt_indexed_dtype_for_vocab(mt_tokenizer_vocab_size(tok)), &err) != MT_OK)
        die(1, "%s", err.message);
    int32_t* tokens = NULL;
    size_t count = 0, cap = 0;
    long start = 0;
    int64_t docs = 0;
    while (start < size) {
        char* sep = strstr(text + start, "\n\n");
        long end = sep ? (long)(sep - text) + 2 : size;
        count = 0;
        if (mt_tokenizer_encode(tok, text + start, (size_t)(end - start), &tokens, &count, &cap) < 0)
            die(1, "cannot tokenize the built-in corpus");
        if (count > 0) {
            if (count == cap) {
                cap = cap * 2 + 16;
                tokens = (int32_t*)realloc(tokens, cap * sizeof(int32_t));
            }
            tokens[count++] = mt_tokenizer_eod(tok);
            int64_t len = (int64_t)count;
            if (mt_indexed_writer_add_document(w, tokens, &len, 1, &err) != MT_OK) {
                mt_indexed_writer_abort(w);
                die(1, "%s", err.message);
            }
            docs++;
        }
        start = end;
    }
    if (mt_indexed_writer_finalize(w, &err) != MT_OK) die(1, "%s", err.message);
    free(tokens);
    free(text);
    printf("prepared the built-in corpus: %lld documents -> %s.{bin,idx}\n", (long long)docs, prefix);
}

/* ---- logging ---------------------------------------------------------------------------------- */

static double now_seconds(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return tv.tv_sec + tv.tv_usec * 1e-6;
}

static void timestamp(char* buf, size_t n) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    localtime_r(&tv.tv_sec, &tm);
    char base[32];
    strftime(base, sizeof(base), "%Y-%m-%d %H:%M:%S", &tm);
    snprintf(buf, n, "%s.%06ld", base, (long)tv.tv_usec);
}

/* ---- memory plan ------------------------------------------------------------------------------ */

static const char* precision_name(mt_precision p) { return p == MT_FP32 ? "fp32" : p == MT_BF16 ? "bf16" : "fp16"; }
static const char* cp_comm_name(mt_cp_comm_type k) { return k == MT_CP_A2A ? "a2a" : k == MT_CP_ALL_GATHER ? "all_gather" : "p2p"; }

/* The plan of one GPU, by category (the same block at startup, for --plan, and before a refusal). */
static void print_plan(const mt_memory_plan* p, const mt_config* c) {
    const double gib = 1024.0 * 1024.0 * 1024.0, mib = 1024.0 * 1024.0;
    char recompute_setting[128];
    mt_recompute_describe(&c->recompute, recompute_setting, sizeof(recompute_setting));
    char cp_note[64] = "";
    if (c->context_parallel_size > 1)
        snprintf(cp_note, sizeof(cp_note), ", CP %d (%s, %d tokens a rank)", c->context_parallel_size,
                 cp_comm_name(c->cp_comm_type), c->seq_length / c->context_parallel_size);
    printf("memory plan per GPU (pipeline rank %d of %d, %lld parameters on this GPU, %s%s): TP %d, PP %d, VP %d, DP %d%s%s%s%s, "
           "recompute %s, micro-batch %d x %d tokens, %d activation slots for %d micro-batches\n",
           p->pp_rank, c->pipeline_model_parallel_size, (long long)p->num_parameters, precision_name(c->precision),
           c->fp8_format != MT_FP8_NONE ? " + FP8" : "", c->tensor_model_parallel_size, c->pipeline_model_parallel_size,
           c->virtual_pipeline_size, c->data_parallel_size, cp_note, c->sequence_parallel ? ", SP" : "",
           c->use_distributed_optimizer ? ", distributed optimizer" : "",
           p->offload_elements ? ", optimizer offload" : "", recompute_setting,
           c->micro_batch_size, c->seq_length, p->in_flight, p->num_micro_batches);
    printf("  parameters   %8.3f GiB  (%s, %lld elements with padding)\n", p->parameter_bytes / gib,
           precision_name(c->precision), (long long)p->buffer_elements);
    printf("  master fp32  %8.3f GiB\n", p->master_bytes / gib);
    printf("  gradients    %8.3f GiB  (fp32)\n", p->gradient_bytes / gib);
    printf("  Adam m, v    %8.3f GiB  (fp32, %lld of %lld optimizer elements on the GPU)\n", p->optimizer_bytes / gib,
           (long long)(p->shard_elements - p->offload_elements), (long long)p->shard_elements);
    printf("  activations  %8.3f GiB  (%.3f GiB saved per micro-batch x %d slots, the rest scratch)\n",
           p->activation_bytes / gib, p->activation_saved_bytes / gib, p->in_flight);
    if (p->fp8_bytes) printf("  fp8          %8.3f GiB  (the weights' FP8 copies, scaling state, cast scratch)\n", p->fp8_bytes / gib);
    printf("  workspace    %8.3f GiB  (cuBLAS %.0f MiB, column sums, AdamW chunk table, RoPE tables%s%s)\n",
           p->workspace_bytes / gib, MT_CUBLAS_WORKSPACE_BYTES / mib,
           c->pipeline_model_parallel_size > 1 ? ", the pipeline's send buffer" : "",
           mt_moe_num_layers(c) > 0 ? ", the MoE state" : "");
    if (mt_moe_num_layers(c) > 0) { /* mixture of experts: routing, the rows bound the capacity sets, expert parameters */
        mt_param_info info[MT_NUM_PARAM_TENSORS];
        mt_param_layout_shard(c, info);
        int64_t experts = 0, router = 0, shared = 0;
        for (int k = MT_P_EXPERT_FC1_WEIGHT; k <= MT_P_EXPERT_FC2_BIAS; k++) experts += info[k].numel;
        router = info[MT_P_ROUTER_WEIGHT].numel + info[MT_P_ROUTER_BIAS].numel;
        for (int k = MT_P_SHARED_FC1_WEIGHT; k <= MT_P_SHARED_GATE_WEIGHT; k++) shared += info[k].numel;
        const int64_t N = (int64_t)c->micro_batch_size * c->seq_length, C = mt_moe_capacity(c, N);
        char capacity[96];
        if (C > 0) snprintf(capacity, sizeof(capacity), "capacity %lld tokens per expert%s", (long long)C,
                            c->moe_pad_expert_input_to_capacity ? ", padded" : "");
        else snprintf(capacity, sizeof(capacity), "dropless");
        printf("  MoE          %d of %d layers: %d experts of width %lld, top-%d; at most %lld permuted rows per micro-batch "
               "of %lld tokens (%s); %lld expert, %lld router, %lld shared-expert parameters on this GPU\n",
               mt_moe_num_layers(c), c->num_layers, c->num_experts, (long long)mt_moe_ffn(c), c->moe_router_topk,
               (long long)mt_moe_max_rows(c, N), (long long)N, capacity, (long long)experts, (long long)router,
               (long long)shared);
    }
    if (p->offload_elements)
        printf("  offload      %8.3f GiB  (device staging; host: %.3f GiB pinned for %lld offloaded elements)\n",
               p->offload_bytes / gib, p->host_pinned_bytes / gib, (long long)p->offload_elements);
    printf("  allocated    %8.3f GiB  (%.2f bytes of model state per parameter)\n", p->total_bytes / gib,
           (double)(p->parameter_bytes + p->master_bytes + p->gradient_bytes + p->optimizer_bytes) /
               (double)(p->num_parameters ? p->num_parameters : 1));
    printf("  overheads    %8.3f GiB  (stated constants: CUDA context %.0f MiB, cuBLAS %.0f MiB, NCCL %.0f MiB per "
           "communicator)\n", p->overhead_bytes / gib, MT_PLAN_CONTEXT_BYTES / mib, MT_PLAN_CUBLAS_BYTES / mib,
           MT_PLAN_NCCL_BYTES / mib);
    printf("  in use       %8.3f GiB  expected per GPU\n", p->device_bytes / gib);
}

/* --grad-reduce-in-bf16 halves the reduction's bytes; this says what Megatron's bf16 gradient buffer, not
 * built here, would also save. */
static void print_grad_bf16_note(const mt_memory_plan* p) {
    const double gib = 1024.0 * 1024.0 * 1024.0;
    printf("--grad-reduce-in-bf16: gradients are reduced in bf16 but still accumulate in fp32 here; Megatron's bf16 "
           "gradient buffer would save %.2f GiB more per GPU in this layout (%.2f GiB of fp32 gradients, %lld elements)\n",
           mt_memory_plan_bf16_grad_savings(p) / gib, p->gradient_bytes / gib, (long long)p->buffer_elements);
}

static void print_memory_plan(mt_trainer* t, const mt_config* c) {
    mt_memory_plan p = mt_trainer_memory_plan(t);
    print_plan(&p, c);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    char name[256];
    size_t free_bytes = 0, total_bytes = 0;
    mt_error err;
    if (mt_device_info(name, sizeof(name), &free_bytes, &total_bytes, &err) != MT_OK) snprintf(name, sizeof(name), "?");
    printf("  total        %8.3f GiB planned; device reports %.3f GiB in use of %.3f GiB (%s; the model state took "
           "%.3f GiB as it counts)\n", p.device_bytes / gib, (total_bytes - free_bytes) / gib, total_bytes / gib, name,
           p.state_bytes_measured / gib);
}

/* The plan against what the device reports once training has run (dev/memory_check.sh). */
static void print_memory_in_use(mt_trainer* t, int64_t iteration) {
    mt_memory_plan p = mt_trainer_memory_plan(t);
    char name[256];
    size_t free_bytes = 0, total_bytes = 0;
    mt_error err;
    if (mt_device_info(name, sizeof(name), &free_bytes, &total_bytes, &err) != MT_OK) return;
    const double gib = 1024.0 * 1024.0 * 1024.0, used = (double)(total_bytes - free_bytes);
    printf("memory after %lld iterations: device reports %.3f GiB in use, the plan %.3f GiB (%+.1f%%)\n",
           (long long)iteration, used / gib, p.device_bytes / gib, 100.0 * (used - p.device_bytes) / p.device_bytes);
}

/* --plan: this layout's plan and whether it fits; --plan-layouts: every layout of the world size
 * that fits, fastest first. No GPU, no data. Returns the exit status (1: nothing fits). */
static int run_plan(const tg_flags* o, const mt_config* c, int sequence_parallel, int global_batch) {
    const double gib = 1024.0 * 1024.0 * 1024.0, budget = o->gpu_memory_gib * gib;
    mt_plan_options opts;
    mt_plan_options_defaults(&opts);
    mt_error err;
    if (!o->plan_layouts) {
        mt_memory_plan p;
        if (mt_memory_plan_compute(c, &opts, &p, &err) != MT_OK) die(2, "%s", err.message);
        print_plan(&p, c);
        if (c->grad_reduce_in_bf16) print_grad_bf16_note(&p);
        if ((double)p.device_bytes <= budget) {
            printf("  fits in %.1f GiB per GPU with %.3f GiB to spare\n", o->gpu_memory_gib, (budget - p.device_bytes) / gib);
            return 0;
        }
        printf("  does NOT fit in %.1f GiB per GPU: %.3f GiB short\n", o->gpu_memory_gib, (p.device_bytes - budget) / gib);
        return 1;
    }
    enum { MAX_LAYOUTS = 4096 };
    mt_layout_candidate* k = (mt_layout_candidate*)malloc(sizeof(mt_layout_candidate) * MAX_LAYOUTS);
    if (!k) die(1, "cannot allocate the layout table");
    mt_config base = *c;
    base.sequence_parallel = sequence_parallel;
    base.global_batch_size = global_batch;
    const int world = o->plan_world_size > 0 ? (int)o->plan_world_size : 1;
    int n = 0, fits = 0;
    if (mt_plan_layouts(&base, &opts, world, k, MAX_LAYOUTS, &n, &err) != MT_OK) die(2, "%s", err.message);
    char batch[64];
    if (global_batch) snprintf(batch, sizeof(batch), "global batch %d", global_batch);
    else snprintf(batch, sizeof(batch), "global batch = micro-batch x DP");
    printf("layouts of %d GPUs that fit in %.1f GiB per GPU (%s, micro-batch %d%s%s), fastest first by the cost model "
           "of DESIGN.md:\n", world, o->gpu_memory_gib, batch, c->micro_batch_size,
           sequence_parallel ? ", SP where TP > 1" : "", c->use_distributed_optimizer ? ", distributed optimizer" : "");
    printf("    TP   PP   VP     DP   global batch   model step (ms)   tokens/s/GPU   GiB per GPU (pipeline rank)   "
           "activation slots\n");
    int refused = 0;
    for (int i = 0; i < n; i++) {
        if (k[i].refused) { refused++; continue; } /* never "fits": listed below with the trainer's line */
        if ((double)k[i].plan.device_bytes > budget) continue;
        fits++;
        printf("  %4d %4d %4d %6d %14d %17.1f %14.0f %21.2f (%d) %21d\n", k[i].tp, k[i].pp, k[i].vp, k[i].dp,
               k[i].global_batch_size, 1e3 * k[i].step_seconds, k[i].tokens_per_second, k[i].plan.device_bytes / gib,
               k[i].plan.pp_rank, k[i].plan.in_flight);
    }
    if (refused) {
        printf("layouts this build refuses (mt_trainer_create would stop with the line shown):\n");
        printf("    TP   PP   VP     DP   why\n");
        for (int i = 0; i < n; i++)
            if (k[i].refused)
                printf("  %4d %4d %4d %6d   refused: %s\n", k[i].tp, k[i].pp, k[i].vp, k[i].dp, k[i].reason);
    }
    printf("  %d of %d layouts fit%s", fits, n, n ? "" : " (no TP x PP divides the model and the batch)");
    if (refused) printf("; %d refused (not built here)", refused);
    printf("\n");
    free(k);
    return fits ? 0 : 1;
}

/* ---- TensorBoard ------------------------------------------------------------------------------ */
/* Megatron's TensorBoard habits (training.py): the rank that prints the log writes the events; every
 * --tensorboard-log-interval iterations learning-rate, batch-size, lm loss (this iteration's),
 * loss-scale, grad-norm (none for a skipped step), num-zeros and params-norm (--log-num-zeros-in-grad,
 * --log-params-norm), world-size and memory when asked, each with its
 * "vs samples" twin where Megatron has one; at each log line iteration-time (s) and throughput
 * (TFLOP/s/GPU) with --log-timers-to-tensorboard; each evaluation's loss (and ppl); the command
 * line's arguments as texts. Events are flushed at every log line (and when the queue fills). */

static mt_tb_writer* tensorboard_open(const tg_flags* o, int argc, char** argv, int64_t iteration) {
    if (o->wandb_project || o->wandb_exp_name || o->wandb_save_dir || o->wandb_entity)
        printf("wandb: this build does not talk to wandb; --wandb-* are not used. Upload the TensorBoard events "
               "with `wandb sync --sync-tensorboard%s%s%s%s %s`%s\n", o->wandb_project ? " --project " : "",
               o->wandb_project ? o->wandb_project : "", o->wandb_entity ? " --entity " : "",
               o->wandb_entity ? o->wandb_entity : "", o->tensorboard_dir ? o->tensorboard_dir : "<dir>",
               o->tensorboard_dir ? "" : " after a run with --tensorboard-dir <dir>");
    if (!o->tensorboard_dir || o->cfg.rank != 0) return NULL;
    mt_error err;
    mt_tb_writer* tb = NULL;
    if (mt_tb_open(&tb, o->tensorboard_dir, o->tensorboard_queue_size, &err) != MT_OK) die(1, "%s", err.message);
    /* the arguments as Megatron writes them (one text per argument, named as argparse's dest): here
     * the ones given on the command line, with their values as given */
    char name[128], value[4096];
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--", 2) != 0) continue;
        const char* eq = strchr(argv[i], '=');
        size_t n = eq ? (size_t)(eq - argv[i] - 2) : strlen(argv[i] + 2);
        if (n >= sizeof(name)) n = sizeof(name) - 1;
        for (size_t k = 0; k < n; k++) name[k] = argv[i][2 + k] == '-' ? '_' : argv[i][2 + k];
        name[n] = 0;
        size_t len = (size_t)snprintf(value, sizeof(value), "%s", eq ? eq + 1 : "");
        for (int j = i + 1; !eq && j < argc && strncmp(argv[j], "--", 2) != 0 && len < sizeof(value); j++)
            len += (size_t)snprintf(value + len, sizeof(value) - len, "%s%s", len ? " " : "", argv[j]);
        if (mt_tb_text(tb, name, value[0] ? value : "True", iteration, &err) != MT_OK) die(1, "%s", err.message);
    }
    if (mt_tb_flush(tb, &err) != MT_OK) die(1, "%s", err.message);
    printf("tensorboard: writing events to %s\n", mt_tb_path(tb));
    return tb;
}

static void tensorboard_check(mt_status st, const mt_error* err) {
    if (st != MT_OK) die(1, "%s", err->message);
}

static void tensorboard_iteration(mt_tb_writer* tb, const tg_flags* o, mt_trainer* t, const mt_step_result* r,
                                  int64_t iteration, int64_t consumed, int batch) {
    const mt_config* c = &o->cfg;
    mt_error err;
    tensorboard_check(mt_tb_scalar_pair(tb, "learning-rate", r->next_learning_rate, iteration, consumed, &err), &err);
    tensorboard_check(mt_tb_scalar_pair(tb, "batch-size", batch, iteration, consumed, &err), &err);
    tensorboard_check(mt_tb_scalar_pair(tb, "lm loss", r->lm_loss, iteration, consumed, &err), &err);
    if (!o->no_log_loss_scale_to_tensorboard)
        tensorboard_check(mt_tb_scalar_pair(tb, "loss-scale", r->loss_scale, iteration, consumed, &err), &err);
    if (o->log_world_size_to_tensorboard)
        tensorboard_check(mt_tb_scalar_pair(tb, "world-size", c->world_size, iteration, consumed, &err), &err);
    if (!r->skipped)
        tensorboard_check(mt_tb_scalar_pair(tb, "grad-norm", r->grad_norm, iteration, consumed, &err), &err);
    if (r->num_zeros_in_grad >= 0) /* --log-num-zeros-in-grad (none for a skipped step) */
        tensorboard_check(mt_tb_scalar_pair(tb, "num-zeros", (double)r->num_zeros_in_grad, iteration, consumed, &err),
                          &err);
    if (r->params_norm >= 0) /* --log-params-norm */
        tensorboard_check(mt_tb_scalar_pair(tb, "params-norm", r->params_norm, iteration, consumed, &err), &err);
    if (o->log_memory_to_tensorboard) {
        /* no caching allocator here: everything is allocated at creation (the plan); "reserved" is
         * what the device reports in use (the CUDA context, cuBLAS and NCCL included) */
        char name[256];
        size_t free_bytes = 0, total_bytes = 0;
        tensorboard_check(mt_device_info(name, sizeof(name), &free_bytes, &total_bytes, &err), &err);
        double planned = (double)mt_trainer_memory_plan(t).total_bytes;
        tensorboard_check(mt_tb_scalar(tb, "mem-reserved-bytes", (double)(total_bytes - free_bytes), iteration, &err), &err);
        tensorboard_check(mt_tb_scalar(tb, "mem-allocated-bytes", planned, iteration, &err), &err);
        tensorboard_check(mt_tb_scalar(tb, "mem-max-allocated-bytes", planned, iteration, &err), &err);
    }
}

static void tensorboard_log_line(mt_tb_writer* tb, const tg_flags* o, int64_t iteration, double seconds_per_iteration,
                                 double tflops) {
    mt_error err;
    if (o->log_timers_to_tensorboard) {
        tensorboard_check(mt_tb_scalar(tb, "iteration-time", seconds_per_iteration, iteration, &err), &err);
        tensorboard_check(mt_tb_scalar(tb, "throughput", tflops, iteration, &err), &err);
    }
    tensorboard_check(mt_tb_flush(tb, &err), &err);
}

/* split_tag: "validation" or "test" (Megatron writes the test loss under the validation tag too;
 * here it has its own, lm loss test, so the two do not share steps) */
static void tensorboard_evaluation(mt_tb_writer* tb, const tg_flags* o, const char* split_tag, double loss,
                                   int64_t iteration, int64_t consumed) {
    mt_error err;
    char tag[64];
    snprintf(tag, sizeof(tag), "lm loss %s", split_tag);
    tensorboard_check(mt_tb_scalar_pair(tb, tag, loss, iteration, consumed, &err), &err);
    if (o->log_validation_ppl_to_tensorboard) {
        snprintf(tag, sizeof(tag), "lm loss %s ppl", split_tag);
        tensorboard_check(mt_tb_scalar_pair(tb, tag, exp(loss < 20 ? loss : 20), iteration, consumed, &err), &err);
    }
    tensorboard_check(mt_tb_flush(tb, &err), &err);
}

/* ---- data ------------------------------------------------------------------------------------- */

/* Fills tokens [micro-batches, mbs, S+1] with this data-parallel rank's part of the global batch
 * that starts at sample `consumed` (Megatron's MegatronPretrainingSampler: micro-batch j of every
 * rank comes from the chunk of mbs * dp samples at consumed + j * mbs * dp; rank r takes the r-th mbs). */
static uint64_t mock_token(uint64_t seed, int split, int64_t sample, int position) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)split << 60) ^ ((uint64_t)sample << 20) ^ (uint64_t)position;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
    return x;
}

/* Samples in a split; --mock-data has no end. */
static int64_t split_samples(const mt_gpt_data* data, int split) {
    return data ? mt_gpt_data_num_samples(data, split) : INT64_MAX;
}

static void fetch_batch(const mt_gpt_data* data, int split, int64_t consumed, int micro, const mt_config* c,
                        int32_t* tokens) {
    mt_error err;
    int64_t n = split_samples(data, split);
    int mbs = c->micro_batch_size, dp = c->data_parallel_size, dp_rank = mt_rank_coordinates(c, c->rank).dp;
    for (int j = 0; j < micro; j++) {
        for (int k = 0; k < mbs; k++) {
            int64_t index = mt_sampler_index(consumed + (int64_t)j * mbs * dp, mbs, dp_rank, k);
            if (index >= n)
                die(1, "the %s split ran out of samples at %lld of %lld", mt_split_name(split), (long long)index, (long long)n);
            int32_t* row = tokens + ((int64_t)j * mbs + k) * (c->seq_length + 1);
            if (!data) { /* --mock-data: a fixed function of (seed, split, sample, position) */
                for (int i = 0; i <= c->seq_length; i++)
                    row[i] = (int32_t)(mock_token(c->seed, split, index, i) % (uint64_t)c->vocab_size);
            } else if (mt_gpt_data_get(data, split, index, row, &err) != MT_OK) {
                die(1, "%s", err.message);
            }
        }
    }
}

/* Mean loss over eval_iters global batches of a split, continuing from *consumed (Megatron's
 * validation iterator carries on across evaluations); with --eod-mask-loss, the loss sum over the
 * counted positions of all of them, as Megatron's evaluate totals numerator and denominator.
 * verbose: Megatron's progress lines (the evaluations after training). */
static double evaluate(mt_trainer* t, const mt_gpt_data* data, int split, int64_t* consumed, int64_t eval_iters,
                       const mt_config* c, int32_t* tokens, int verbose) {
    mt_error err;
    double total = 0.0, counted = 0.0;
    int micro = mt_num_micro_batches(c);
    if (verbose) printf("Evaluating on %lld samples\n", (long long)(eval_iters * c->global_batch_size));
    for (int64_t k = 0; k < eval_iters; k++) {
        if (verbose) printf("Evaluating iter %lld/%lld\n", (long long)k + 1, (long long)eval_iters);
        fetch_batch(data, split, *consumed, micro, c, tokens);
        *consumed += c->global_batch_size;
        double loss = 0.0;
        if (mt_trainer_evaluate(t, tokens, micro, &loss, &err) != MT_OK) die(1, "%s", err.message);
        double n = c->eod_mask_loss ? (double)mt_trainer_last_loss_tokens(t) : 1.0;
        total += loss * n;
        counted += n;
    }
    return total / counted;
}

/* The most micro-batches an iteration of this run has (a step schedule's sizes need not grow). */
static int max_micro_batches(const mt_config* c) {
    int most = mt_num_micro_batches(c);
    for (int i = 0; i < c->num_batch_size_steps; i++) {
        int m = c->batch_size_step_size[i] / (c->micro_batch_size * c->data_parallel_size);
        if (m > most) most = m;
    }
    return most;
}

/* --data-cache-path: rank 0 writes the index arrays of every dataset and split there as .npy files
 * in Megatron's dtypes (document, sample and shuffle index; a blend's dataset and sample index),
 * named after the dataset and what it was built for. The run itself always builds them afresh. */
static void write_index_cache(const mt_gpt_data* data, const char* dir, const mt_config* c) {
    mt_error err;
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) die(1, "--data-cache-path %s: cannot create it: %s", dir, strerror(errno));
    int files = 0;
    for (int split = 0; split < 3; split++) {
        for (int k = 0; k < mt_gpt_data_num_datasets(data); k++) {
            const mt_gpt_dataset* g = mt_gpt_data_dataset(data, split, k);
            if (!g) continue;
            const char* prefix = mt_indexed_dataset_prefix(mt_gpt_data_indexed(data, k));
            const char* base = strrchr(prefix, '/') ? strrchr(prefix, '/') + 1 : prefix;
            char name[512];
            snprintf(name, sizeof(name), "%s-GPTDataset-%s-seq%d-seed%llu-samples%lld-", base, mt_split_name(split),
                     c->seq_length, (unsigned long long)c->seed, (long long)mt_gpt_dataset_num_samples(g));
            if (mt_gpt_dataset_save_indices(g, dir, name, &err) != MT_OK) die(1, "%s", err.message);
            files += 3;
        }
        if (mt_gpt_data_is_blended(data) && mt_gpt_data_num_samples(data, split) > 0) {
            int64_t n = mt_gpt_data_num_samples(data, split);
            char path[1024];
            snprintf(path, sizeof(path), "%s/BlendedDataset-%s-seed%llu-dataset_index.npy", dir, mt_split_name(split),
                     (unsigned long long)c->seed);
            if (mt_npy_write(path, "<i2", 1, &n, mt_gpt_data_blend_dataset_index(data, split), &err) != MT_OK)
                die(1, "%s", err.message);
            snprintf(path, sizeof(path), "%s/BlendedDataset-%s-seed%llu-dataset_sample_index.npy", dir,
                     mt_split_name(split), (unsigned long long)c->seed);
            if (mt_npy_write(path, "<i8", 1, &n, mt_gpt_data_blend_sample_index(data, split), &err) != MT_OK)
                die(1, "%s", err.message);
            files += 2;
        }
    }
    printf("data: wrote %d index arrays to %s\n", files, dir);
}

/* --full-validation: the mean loss per token over every sample of the split, each once, from its
 * first (Megatron's full validation). Whole rounds of micro-batch x data-parallel samples go through
 * mt_trainer_evaluate, up to a global batch at a time (each rank its micro-batches, reduced over DP);
 * the last, partial round is run by every rank alike through mt_trainer_token_losses, its rows past
 * the split's end repeating its first sample and left out of the sum. With --eod-mask-loss only the
 * counted positions (input not the end-of-document token) enter the sum and the count. */
static double evaluate_full(mt_trainer* t, const mt_gpt_data* data, int split, const mt_config* c, int32_t* tokens) {
    mt_error err;
    int64_t n = split_samples(data, split), S = c->seq_length, mbs = c->micro_batch_size;
    int64_t round = mbs * c->data_parallel_size, rounds = n / round;
    int micro = mt_num_micro_batches(c);
    double sum = 0.0, counted = 0.0;
    printf("Evaluating on %lld samples (the whole %s split)\n", (long long)n, mt_split_name(split));
    for (int64_t r = 0; r < rounds; r += micro) {
        int k = rounds - r < micro ? (int)(rounds - r) : micro;
        fetch_batch(data, split, r * round, k, c, tokens);
        double loss = 0.0;
        if (mt_trainer_evaluate(t, tokens, k, &loss, &err) != MT_OK) die(1, "%s", err.message);
        double positions = (double)mt_trainer_last_loss_tokens(t); /* over the DP ranks */
        sum += loss * positions;
        counted += positions;
    }
    float* losses = (float*)malloc(sizeof(float) * (size_t)(mbs * S));
    if (!losses) die(1, "cannot allocate %lld token losses", (long long)(mbs * S));
    for (int64_t first = rounds * round; first < n; first += mbs) {
        for (int64_t b = 0; b < mbs; b++) {
            int64_t index = first + b < n ? first + b : rounds * round;
            if (mt_gpt_data_get(data, split, index, tokens + b * (S + 1), &err) != MT_OK) die(1, "%s", err.message);
        }
        if (mt_trainer_token_losses(t, tokens, losses, &err) != MT_OK) die(1, "%s", err.message);
        for (int64_t i = 0; i < (n - first < mbs ? n - first : mbs) * S; i++) {
            if (c->eod_mask_loss && tokens[(i / S) * (S + 1) + i % S] == c->eod_token) continue;
            sum += losses[i];
            counted += 1.0;
        }
    }
    free(losses);
    return sum / counted;
}

/* Megatron's evaluation line; prefix "iteration N" during training, "iteration N on validation set"
 * and "... on test set" after it. */
static void print_validation(const char* prefix, double loss) {
    char line[256];
    int n = snprintf(line, sizeof(line), " validation loss at %s | lm loss value: %.6E | lm loss PPL: %.6E | ", prefix,
                     loss, exp(loss < 20 ? loss : 20));
    char dashes[256];
    memset(dashes, '-', (size_t)n + 1);
    dashes[n + 1] = 0;
    printf("%s\n%s\n%s\n", dashes, line, dashes);
}

/* ---- sampling --------------------------------------------------------------------------------- */

static void print_sample(mt_trainer* t, const mt_tokenizer* tok, const mt_config* c, int num_tokens, uint64_t seed) {
    if (!tok || num_tokens <= 0) return;
    mt_error err;
    int S = c->seq_length;
    int32_t* context = (int32_t*)malloc(sizeof(int32_t) * (size_t)S);
    float* logits = (float*)malloc(sizeof(float) * (size_t)c->padded_vocab_size);
    double* probs = (double*)malloc(sizeof(double) * (size_t)c->vocab_size);
    int len = 1;
    context[0] = mt_tokenizer_eod(tok);
    uint64_t rng = seed * 2862933555777941757ull + 3037000493ull;
    printf("sample (temperature 0.8, %d tokens):\n---\n", num_tokens);
    for (int i = 0; i < num_tokens; i++) {
        int start = len > S ? len - S : 0;
        if (mt_trainer_next_token_logits(t, context + start, len - start, logits, &err) != MT_OK) die(1, "%s", err.message);
        double mx = -1e30, sum = 0.0;
        for (int64_t v = 0; v < c->vocab_size; v++) if (logits[v] > mx) mx = logits[v];
        for (int64_t v = 0; v < c->vocab_size; v++) sum += probs[v] = exp((logits[v] - mx) / 0.8);
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        double u = (double)(rng >> 11) / 9007199254740992.0 * sum, acc = 0.0;
        int32_t next = (int32_t)(c->vocab_size - 1);
        for (int64_t v = 0; v < c->vocab_size; v++) { acc += probs[v]; if (acc > u) { next = (int32_t)v; break; } }
        if (next == mt_tokenizer_eod(tok)) break;
        const char* bytes = NULL;
        size_t n = mt_tokenizer_token_bytes(tok, next, &bytes);
        fwrite(bytes, 1, n, stdout);
        if (len == S) { memmove(context, context + 1, sizeof(int32_t) * (size_t)(S - 1)); len--; }
        context[len++] = next;
    }
    printf("\n---\n");
    free(context);
    free(logits);
    free(probs);
}

/* ---- faults: Megatron's exit conditions ------------------------------------------------------- */

/* Where checkpoints go and what is kept: --save, --async-save, --save-retain-interval, and for a
 * save in flight the tracker's iteration before it (the one retention may delete once it commits). */
typedef struct {
    const char* dir;
    int async;
    int64_t retain_interval; /* < 1: keep every checkpoint */
    int rank;
    int64_t previous;        /* the tracker's iteration before the save in flight (-1: none) */
} checkpoint_saver;

/* After a committed save of `saved`: rank 0 deletes the previously tracked checkpoint unless
 * --save-retain-interval keeps it (megatron.h mt_checkpoint_retain_apply); a failure is a warning,
 * never the end of the run. */
static void retain_after_save(checkpoint_saver* s, int64_t saved) {
    if (s->retain_interval < 1 || s->rank != 0) return;
    mt_error err;
    int64_t deleted = -1;
    if (mt_checkpoint_retain_apply(s->dir, s->previous, saved, s->retain_interval, -1, &deleted, &err) != MT_OK)
        fprintf(stderr, "train_gpt: warning: --save-retain-interval: %s\n", err.message);
    else if (deleted >= 0)
        printf("deleted the checkpoint of iteration %lld from %s (--save-retain-interval %lld keeps multiples of it and "
               "the newest)\n", (long long)deleted, s->dir, (long long)s->retain_interval);
    s->previous = -1;
}

/* --async-save: commits the save in flight once every rank has written its files (blocking: waits
 * for them); a writer's error ends the run with its line. Collective: every rank calls it at the
 * same points (after each step, before the next save, at the end). */
static void save_poll(mt_trainer* t, checkpoint_saver* s, int blocking) {
    mt_error err;
    int64_t committed = -1;
    if (mt_trainer_save_wait(t, blocking, &committed, &err) != MT_OK) die(1, "%s", err.message);
    if (committed >= 0) {
        printf("saved checkpoint at iteration %lld to %s (written in the background)\n", (long long)committed, s->dir);
        retain_after_save(s, committed);
        fflush(stdout);
    }
}

/* Saves a checkpoint (every rank takes part) and returns the iteration saved. With --async-save the
 * call returns once the files are staged in host memory; the save is committed later (save_poll).
 * Either way the line says how long the step loop waited. */
static int64_t save_checkpoint(mt_trainer* t, checkpoint_saver* s, int64_t iteration, int64_t consumed) {
    mt_error err;
    double t0 = now_seconds();
    if (s->async) save_poll(t, s, 1); /* one in flight commits here, its retention with it */
    int64_t tracked = -1;
    mt_error tracker_err;
    s->previous = s->rank == 0 && mt_checkpoint_read_tracker(s->dir, &tracked, &tracker_err) == MT_OK ? tracked : -1;
    mt_status st = s->async ? mt_trainer_save_async(t, s->dir, iteration, consumed, &err)
                            : mt_trainer_save(t, s->dir, iteration, consumed, &err);
    if (st != MT_OK) die(1, "%s", err.message);
    if (s->async) {
        printf("checkpoint at iteration %lld staged in %.1f ms (the step loop's wait: device-to-host copy, and any "
               "earlier save still in flight); writing it to %s in the background\n", (long long)iteration,
               1000.0 * (now_seconds() - t0), s->dir);
    } else {
        printf("saved checkpoint at iteration %lld to %s (the step loop waited %.1f ms)\n", (long long)iteration, s->dir,
               1000.0 * (now_seconds() - t0));
        retain_after_save(s, iteration);
    }
    fflush(stdout);
    return iteration;
}

/* --exit-signal-handler: SIGTERM (Slurm's preemption notice, Megatron's default signal) or SIGINT
 * asks the run to stop after the current step; a second one takes the default action at once. */
static volatile sig_atomic_t g_exit_signal = 0;

static void on_exit_signal(int sig) {
    if (g_exit_signal) {
        signal(sig, SIG_DFL);
        raise(sig);
    }
    g_exit_signal = sig;
}

static void install_exit_signal_handler(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_exit_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART; /* reads and writes in flight (data, a save) go on */
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0)
        die(1, "cannot install the signal handler: %s", strerror(errno));
}

/* Why the run stops after this iteration (Megatron's checkpoint_and_decide_exit: a signal, the
 * duration, the exit interval), or NULL. Every rank sees the same answer: the signal and the clock
 * are combined over the ranks (as Megatron's all-reduce), the interval is the same everywhere. */
static const char* exit_reason(const tg_flags* o, int64_t iteration, double t_start, char* buf, size_t cap) {
    int why = 0; /* bit 1: a signal, bit 2: the duration */
    double minutes = (now_seconds() - t_start) / 60.0;
    if (o->exit_signal_handler && g_exit_signal) why |= 1;
    if (o->exit_duration_in_mins > 0 && minutes > (double)o->exit_duration_in_mins) why |= 2;
#ifdef MT_USE_MPI
    if (g_world > 1 && (o->exit_signal_handler || o->exit_duration_in_mins > 0))
        MPI_Allreduce(MPI_IN_PLACE, &why, 1, MPI_INT, MPI_BOR, MPI_COMM_WORLD);
#endif
    if (why & 1) snprintf(buf, cap, "after receiving %s", g_exit_signal == SIGINT ? "SIGINT" : "SIGTERM");
    else if (why & 2) snprintf(buf, cap, "after %.1f minutes (--exit-duration-in-mins %lld)", minutes,
                               (long long)o->exit_duration_in_mins);
    else if (o->exit_interval > 0 && iteration % o->exit_interval == 0)
        snprintf(buf, cap, "at iteration %lld (--exit-interval)", (long long)iteration);
    else return NULL;
    return buf;
}

/* ---- the run's steps -------------------------------------------------------------------------- */

/* The run's state, handed from one step of main to the next (the file's only globals are die's
 * rank and the exit signal's flag above, which a handler must reach). */
typedef struct {
    double t_launch;             /* --exit-duration-in-mins counts from here, as Megatron from its start */
    int rank, world, local_rank;
    int last_rank_stdout;        /* the last rank's copy of stdout, for the log line (-1: none) */
    mt_comm_id comm_id;
    tg_flags o;                  /* the flags; o.cfg is the run's configuration */
    int planning;                /* --plan or --plan-layouts: no GPU, no data */
    int sequence_parallel;       /* --sequence-parallel as given (--plan-layouts tries it on every TP) */
    int global_batch;            /* --global-batch-size as given; 0: micro-batch x DP of each layout */
    mt_tokenizer* tok;           /* NULL: NullTokenizer */
    FILE* log_line_out;          /* where the iteration log line goes (NULL: not from this rank) */
    int64_t num_samples[3];      /* per split, as Megatron counts them */
    mt_gpt_data* data;           /* NULL: --mock-data */
    mt_trainer* t;
    mt_tb_writer* tb;            /* NULL: no --tensorboard-dir, or not this rank */
    double peak_tflops;          /* of one GPU, for the log line's MFU */
    int32_t* tokens;             /* the batch: [micro-batches, mbs, S+1] */
    int64_t iteration, consumed, consumed_valid;
    int64_t saved_at;            /* the iteration of the last save (-1: none) */
    checkpoint_saver saver;
    const char* why;             /* why the run stopped early (Megatron's exit conditions), or NULL */
    char why_buf[128];
} run_state;

/* launch: one process per GPU, started by mpirun or srun. MPI gives each its rank and its GPU
 * on the node (the rank among the processes that share the node's memory); rank 0 makes the
 * NCCL id and MPI sends it to everyone. Only rank 0 writes the log. */
static void launch(run_state* run, int* argc, char*** argv) {
    run->rank = 0;
    run->world = 1;
    run->local_rank = -1;
    run->last_rank_stdout = -1;
    memset(&run->comm_id, 0, sizeof(run->comm_id));
#ifdef MT_USE_MPI
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &run->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &run->world);
    g_rank = run->rank;
    g_world = run->world;
    if (run->world > 1) {
        MPI_Comm node;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, run->rank, MPI_INFO_NULL, &node);
        MPI_Comm_rank(node, &run->local_rank);
        MPI_Comm_free(&node);
        mt_error id_err;
        int ok = run->rank != 0 || mt_comm_id_create(&run->comm_id, &id_err) == MT_OK;
        if (!ok) die(1, "%s", id_err.message);
        MPI_Bcast(&run->comm_id, (int)sizeof(run->comm_id), MPI_BYTE, 0, MPI_COMM_WORLD);
        /* the last rank keeps a copy of stdout for the iteration log line (Megatron prints it from the
         * last pipeline stage); every other line comes from rank 0 */
        if (run->rank == run->world - 1) run->last_rank_stdout = dup(STDOUT_FILENO);
        if (run->rank != 0 && !freopen("/dev/null", "w", stdout)) die(1, "cannot silence stdout: %s", strerror(errno));
    }
#else
    (void)argc;
    (void)argv;
#endif
}

/* The flags, the startup line of the informational ones, and the world they run in: this launch's,
 * or with --plan the --world-size GPUs planned for. */
static void read_flags(run_state* run, int argc, char** argv) {
    tg_flags* o = &run->o;
    parse_args(o, argc, argv);
    {
        char info[4096];
        tg_flags_info_line(o, info, sizeof(info));
        if (info[0]) printf("%s\n", info);
    }
    mt_config* c = &o->cfg;
    c->world_size = run->world;
    c->rank = run->rank;
    c->local_rank = run->local_rank;
    c->comm_id = run->comm_id;
    run->planning = o->plan || o->plan_layouts;
    run->sequence_parallel = c->sequence_parallel;
    run->global_batch = c->global_batch_size; /* 0: micro-batch x DP of each layout */
    if (!run->planning) { /* before any work: the launch matches the build */
        mt_error launch_err;
#ifdef MT_USE_MPI
        const int built_with_mpi = 1;
#else
        const int built_with_mpi = 0;
#endif
        if (mt_launcher_check(run->world, built_with_mpi, NULL, NULL, &launch_err) != MT_OK)
            die(2, "%s", launch_err.message);
    }
    if (run->planning) { /* the layout of --world-size GPUs, on none (--plan-layouts: the model checked on one) */
        c->world_size = o->plan_world_size > 0 && !o->plan_layouts ? (int)o->plan_world_size : 1;
        c->rank = 0;
        c->local_rank = -1;
    }
}

/* The tokenizer gives the vocabulary; then the configuration is complete and checked. */
static void finish_config(run_state* run) {
    tg_flags* o = &run->o;
    mt_config* c = &o->cfg;
    run->tok = load_tokenizer(o);
    c->vocab_size = run->tok ? mt_tokenizer_vocab_size(run->tok) : o->null_vocab_size;
    c->eod_token = run->tok ? mt_tokenizer_eod(run->tok) : o->null_vocab_size - 1; /* NullTokenizer: the last id */
    mt_error err;
    /* --load at another TP: keep the checkpoint's padded vocabulary where it divides by this TP, so the
     * model (padded rows included) and its loss curve continue (megatron.h mt_padded_vocab_size_resumed) */
    mt_config_resume_padding(c, o->load);
    if (mt_config_finalize(c, &err) != MT_OK) die(2, "%s", err.message);
    if (c->resumed_padded_vocab_size > 0 && c->padded_vocab_size != c->resumed_padded_vocab_size && run->rank == 0)
        printf("note: the checkpoint in %s pads the vocabulary to %lld, which %s; padded to %lld here: the rows "
               "the checkpoint lacks start at 0 and take part in the softmax, so the loss moves at the first step\n",
               o->load, (long long)c->resumed_padded_vocab_size,
               c->resumed_padded_vocab_size < c->vocab_size ? "does not cover this tokenizer's vocabulary"
                                                            : "does not divide by --tensor-model-parallel-size",
               (long long)c->padded_vocab_size);
    if (o->eval_global_batch_size > 0 && o->eval_global_batch_size != c->global_batch_size)
        die(2, "--eval-global-batch-size %lld: evaluation with its own batch size is not implemented; it runs global "
            "batches of %d (--global-batch-size): give that or drop the flag", (long long)o->eval_global_batch_size,
            c->global_batch_size);
}

/* the iteration log line: from the last rank (the last pipeline stage) with PP > 1, else rank 0 */
static void open_log_line(run_state* run) {
    const mt_config* c = &run->o.cfg;
    run->log_line_out = stdout;
    if (c->pipeline_model_parallel_size > 1 && run->world > 1) {
        run->log_line_out = run->rank == run->world - 1 ? (run->rank == 0 ? stdout : fdopen(run->last_rank_stdout, "w"))
                                                        : NULL;
        if (run->rank == run->world - 1 && !run->log_line_out)
            die(1, "cannot open the last rank's stdout: %s", strerror(errno));
    } else if (run->last_rank_stdout >= 0) {
        close(run->last_rank_stdout);
    }
}

/* --grad-reduce-in-bf16 on a run: this rank's plan, before the trainer (--plan prints its own) */
static void note_grad_bf16(const run_state* run) {
    const mt_config* c = &run->o.cfg;
    if (!run->planning && c->grad_reduce_in_bf16) {
        mt_error err;
        mt_plan_options opts;
        mt_plan_options_defaults(&opts);
        opts.pp_rank = mt_rank_coordinates(c, c->rank).pp;
        opts.dp_rank = mt_rank_coordinates(c, c->rank).dp;
        opts.cp_rank = mt_rank_coordinates(c, c->rank).cp;
        mt_memory_plan p;
        if (mt_memory_plan_compute(c, &opts, &p, &err) == MT_OK) print_grad_bf16_note(&p);
    }
}

/* data: Megatron's sample counts (refused when they overflow); --skip-train: one evaluation's
 * worth (Megatron); --train-samples and --full-validation set their splits' own */
static void count_samples(run_state* run) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    mt_error err;
    if (mt_gpt_num_samples(c->train_iters, o->skip_train ? 0 : o->eval_interval, o->eval_iters, c->global_batch_size,
                           run->num_samples, &err) != MT_OK)
        die(2, "%s", err.message);
    if (c->train_samples > 0) run->num_samples[MT_SPLIT_TRAIN] = c->train_samples;
    if (o->full_validation) run->num_samples[MT_SPLIT_VALID] = -1; /* one epoch of the split */
}

/* the flags are all checked: before the data and the trainer, a GPU to train on */
static void check_gpu(void) {
    mt_error err;
    int gpus = 0;
    if (mt_device_check(&gpus, &err) != MT_OK) die(1, "%s", err.message);
}

/* data: the built-in corpus made on first use, then Megatron's sample indices */
static void open_data(run_state* run) {
    tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    mt_error err;
    if (o->builtin) {
        static const char* builtin_prefix = "dev/data/tinyshakespeare_text_document";
        if (run->rank == 0) prepare_builtin_corpus(run->tok, builtin_prefix);
#ifdef MT_USE_MPI
        MPI_Barrier(MPI_COMM_WORLD); /* the others read what rank 0 wrote */
#endif
        o->data_paths[0] = builtin_prefix;
        o->num_data_paths = 1;
    }

    /* data: Megatron's sample indices */
    run->data = NULL;
    if (o->mock_data) {
        printf("data: --mock-data, random tokens\n");
    } else {
        if (mt_gpt_data_open(&run->data, o->num_data_paths, o->data_paths, o->weighted ? o->data_weights : NULL,
                             o->split, c->seq_length, (uint32_t)c->seed, run->num_samples, &err) != MT_OK)
            die(1, "%s", err.message);
        printf("data: %d dataset(s), split '%s': train %lld, valid %lld, test %lld samples of %d tokens\n",
               o->num_data_paths, o->split, (long long)mt_gpt_data_num_samples(run->data, MT_SPLIT_TRAIN),
               (long long)mt_gpt_data_num_samples(run->data, MT_SPLIT_VALID),
               (long long)mt_gpt_data_num_samples(run->data, MT_SPLIT_TEST), c->seq_length);
        if (o->data_cache_path && run->rank == 0) write_index_cache(run->data, o->data_cache_path, c);
    }
}

/* The model and its layout in two lines, then the trainer: a layout that does not fit is refused
 * with its plan; the plan against the device once it is built. */
static void create_trainer(run_state* run) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    mt_error err;
    printf("model: %d layers, hidden %d, %d heads, ffn %d, seq %d, vocab %lld (padded %lld), micro-batch %d, "
           "global batch %d, %lld iterations\n",
           c->num_layers, c->hidden_size, c->num_attention_heads, c->ffn_hidden_size, c->seq_length,
           (long long)c->vocab_size, (long long)c->padded_vocab_size, c->micro_batch_size, c->global_batch_size,
           (long long)c->train_iters);
    char vp_note[64] = "";
    if (c->virtual_pipeline_size > 1) snprintf(vp_note, sizeof(vp_note), " x %d virtual stages", c->virtual_pipeline_size);
    char cp_note[64] = "";
    if (c->context_parallel_size > 1)
        snprintf(cp_note, sizeof(cp_note), ", context-parallel %d (%s)", c->context_parallel_size,
                 cp_comm_name(c->cp_comm_type));
    printf("parallel: %d GPU(s), data-parallel %d, tensor-parallel %d%s, pipeline-parallel %d%s%s%s%s%s%s\n", c->world_size,
           c->data_parallel_size, c->tensor_model_parallel_size, c->sequence_parallel ? " (sequence parallel)" : "",
           c->pipeline_model_parallel_size, vp_note, cp_note,
           c->use_distributed_optimizer ? ", distributed optimizer" : "",
           c->overlap_grad_reduce ? ", overlapped grad reduce" : "", c->overlap_param_gather ? ", overlapped param gather" : "",
           c->grad_reduce_in_bf16 ? ", bf16 grad reduce" : "");
    run->t = NULL;
    mt_status created = mt_trainer_create(&run->t, c, &err);
    if (created == MT_ERR_OOM) { /* the plan that does not fit, then the shortfall */
        mt_plan_options opts;
        mt_plan_options_defaults(&opts);
        opts.pp_rank = mt_rank_coordinates(c, c->rank).pp;
        mt_memory_plan p;
        mt_error plan_err;
        if (mt_memory_plan_compute(c, &opts, &p, &plan_err) == MT_OK) print_plan(&p, c);
    }
    if (created != MT_OK) die(1, "%s", err.message);
    if (mt_trainer_on_collective_timeout(run->t, collective_timeout, NULL, &err) != MT_OK) die(1, "%s", err.message);
    print_memory_plan(run->t, c);
    /* --async-save: the pinned staging now, so the first save's stall is only its copy */
    if (o->async_save && o->save && mt_trainer_reserve_async_save(run->t, &err) != MT_OK) die(1, "%s", err.message);
}

/* --load: the checkpoint's weights (and optimizer state) and where it stopped: the iteration, the
 * samples consumed, and the validation samples its evaluations used; none there: from scratch. */
static void load_checkpoint(run_state* run) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    mt_error err;
    run->iteration = run->consumed = run->consumed_valid = 0;
    if (o->load) {
        char tracker[4096];
        snprintf(tracker, sizeof(tracker), "%s/latest_checkpointed_iteration.txt", o->load);
        if (access(tracker, R_OK) == 0) {
            /* --no-load-optim / --finetune: the weights only; --finetune also starts at iteration 0 */
            double load_start = now_seconds();
            mt_trainer_set_no_verify_checkpoint(run->t, o->no_verify_checkpoint);
            mt_status st = o->no_load_optim || o->finetune
                               ? mt_trainer_load_weights(run->t, o->load, -1, &run->iteration, &run->consumed, &err)
                               : mt_trainer_load(run->t, o->load, -1, &run->iteration, &run->consumed, &err);
            if (st != MT_OK) die(1, "%s", err.message);
            /* the integrity rule's word (rank 0): an older iteration read instead of a refused one, a
             * checkpoint from before manifests, or one read under --no-verify-checkpoint */
            if (mt_trainer_load_warning(run->t)[0]) fprintf(stderr, "warning: %s\n", mt_trainer_load_warning(run->t));
            printf("loaded checkpoint from %s at iteration %lld (%lld samples consumed) in %.1f ms%s\n", o->load,
                   (long long)run->iteration, (long long)run->consumed, 1e3 * (now_seconds() - load_start),
                   o->finetune ? ": weights only, starting at iteration 0 (--finetune)"
                   : o->no_load_optim ? ": weights only (--no-load-optim)" : "");
            if (o->finetune) run->iteration = run->consumed = 0;
            if (o->finetune && mt_trainer_set_iteration(run->t, 0, &err) != MT_OK) die(1, "%s", err.message);
            /* the checkpoint's counters are range-checked (>= 0); those of a run past this one's end clamp
             * to it, so the products below stay within the sample counts checked above */
            if (run->consumed > run->num_samples[MT_SPLIT_TRAIN] && run->iteration < c->train_iters)
                die(1, "%s: %lld samples consumed, but this run trains on %lld", o->load, (long long)run->consumed,
                    (long long)run->num_samples[MT_SPLIT_TRAIN]);
            int64_t evaluated = run->iteration < c->train_iters ? run->iteration : c->train_iters;
            if (o->eval_interval > 0)
                run->consumed_valid = (evaluated / o->eval_interval) * o->eval_iters * c->global_batch_size;
        } else {
            printf("no checkpoint found in %s: %s\n", o->load,
                   o->skip_train ? "evaluating the initial weights" : "training from scratch");
        }
    }
    if (o->skip_train) run->consumed_valid = 0; /* Megatron evaluates from the split's first sample */
}

/* The log line's tallies since the last one, and the steps refused for NaN in a row. */
typedef struct {
    double loss, time;    /* summed: the steps' losses (those not skipped) and their seconds */
    double moe[4];        /* summed: the MoE load-balancing, seq, global and z losses (mt_step_result.moe_losses) */
    int steps, skipped, nan;
    int nan_in_a_row;
} train_tally;

/* One training step on this iteration's global batch of `micro` micro-batches (`batch` samples):
 * the batch, the profiler's window, the step (a NaN step skipped or the end of the run), the
 * counters and the tallies. */
static void train_step(run_state* run, train_tally* tally, int micro, int batch, mt_step_result* r) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    mt_error err;
    fetch_batch(run->data, MT_SPLIT_TRAIN, run->consumed, micro, c, run->tokens);
    if (o->profile && run->rank == 0 && run->iteration == o->profile_step_start && mt_device_profiler(1, &err) != MT_OK)
        die(1, "--profile: %s", err.message);
    double t0 = now_seconds();
    mt_status st = mt_trainer_train_step_n(run->t, run->tokens, micro, r, &err);
    if (st == MT_ERR_NAN) { /* refused before the optimizer (every rank alike): skipped, or the run stops */
        if (++tally->nan_in_a_row >= o->max_nan_in_a_row)
            die(1, "iteration %lld: %s; %d such step%s in a row (--max-consecutive-nan-iterations %lld)",
                (long long)run->iteration + 1, err.message, tally->nan_in_a_row, tally->nan_in_a_row == 1 ? "" : "s",
                (long long)o->max_nan_in_a_row);
        if (run->log_line_out) {
            fprintf(run->log_line_out, "iteration %lld skipped: %s; %d in a row (--max-consecutive-nan-iterations %lld)\n",
                    (long long)run->iteration + 1, err.message, tally->nan_in_a_row, (long long)o->max_nan_in_a_row);
            fflush(run->log_line_out);
        }
        r->skipped = r->nan = 1;
    } else if (st != MT_OK) {
        die(1, "iteration %lld: %s", (long long)run->iteration + 1, err.message);
    } else {
        tally->nan_in_a_row = 0;
    }
    tally->time += now_seconds() - t0;
    run->iteration++;
    run->consumed += batch;
    if (o->async_save) save_poll(run->t, &run->saver, 0);
    if (o->profile && run->rank == 0 && run->iteration == o->profile_step_end && mt_device_profiler(0, &err) != MT_OK)
        die(1, "--profile: %s", err.message);
    if (r->skipped) tally->skipped++;
    else tally->loss += r->lm_loss;
    for (int k = 0; k < 4 && !r->skipped; k++) tally->moe[k] += r->moe_losses[k];
    if (r->nan) tally->nan++;
    tally->steps++;
}

/* Megatron's iteration log line over the tallies since the last one (then reset), and its
 * TensorBoard timers. */
static void print_log_line(run_state* run, train_tally* tally, const mt_step_result* r, int batch) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    double ms = 1000.0 * tally->time / tally->steps;
    double tflops = mt_flops_per_iteration(c, batch) / (ms / 1000.0) / 1e12 / c->world_size;
    int good = tally->steps - tally->skipped;
    char ts[64], throughput[128] = "", mfu[64] = "", decoupled[96] = "", zeros[64] = "", pnorm[64] = "", moe[256] = "";
    /* Megatron's MoE losses after the lm loss, those the run computes (a coefficient > 0), averaged like it */
    static const char* const moe_names[4] = {"load_balancing_loss", "seq_load_balancing_loss",
                                             "global_load_balancing_loss", "z_loss"};
    const double moe_coef[4] = {c->moe_load_balancing & MT_MOE_AUX_LOSS ? c->moe_aux_loss_coeff[0] : 0.0,
                                c->moe_load_balancing & MT_MOE_SEQ_AUX_LOSS ? c->moe_aux_loss_coeff[1] : 0.0,
                                c->moe_load_balancing & MT_MOE_GLOBAL_AUX_LOSS ? c->moe_aux_loss_coeff[2] : 0.0,
                                c->moe_z_loss_coeff};
    for (int k = 0, at = 0; k < 4 && c->num_experts > 0; k++)
        if (moe_coef[k] > 0 && at < (int)sizeof(moe))
            at += snprintf(moe + at, sizeof(moe) - (size_t)at, " %s: %.6E |", moe_names[k],
                           good ? tally->moe[k] / good : 0.0);
    if (c->decoupled_lr >= 0) /* Megatron's field, after the learning rate */
        snprintf(decoupled, sizeof(decoupled), " decoupled learning rate: %.6E |", r->next_decoupled_learning_rate);
    timestamp(ts, sizeof(ts));
    /* Megatron's fields after the grad norm, this iteration's values, only when computed */
    if (r->num_zeros_in_grad >= 0)
        snprintf(zeros, sizeof(zeros), " num zeros: %lld |", (long long)r->num_zeros_in_grad);
    if (r->params_norm >= 0) snprintf(pnorm, sizeof(pnorm), " params norm: %.3f |", r->params_norm);
    if (o->log_throughput) { /* Megatron prints the field only with --log-throughput; MFU is this build's */
        snprintf(throughput, sizeof(throughput), " throughput per GPU (TFLOP/s/GPU): %.1f |", tflops);
        snprintf(mfu, sizeof(mfu), " MFU: %.1f%% |", run->peak_tflops > 0 ? 100.0 * tflops / run->peak_tflops : 0.0);
    }
    if (run->log_line_out) {
        fprintf(run->log_line_out,
                " [%s] iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f |%s"
                " learning rate: %.6E |%s global batch size: %5d | lm loss: %.6E |%s loss scale: %.1f | grad norm: "
                "%.3f |%s%s number of skipped iterations: %3d | number of nan iterations: %3d |%s\n",
                ts, (long long)run->iteration, (long long)c->train_iters, (long long)run->consumed, ms, throughput,
                r->next_learning_rate, decoupled, batch, good ? tally->loss / good : 0.0, moe, r->loss_scale, r->grad_norm,
                zeros, pnorm, tally->skipped, tally->nan, mfu);
        fflush(run->log_line_out);
    }
    if (run->tb) tensorboard_log_line(run->tb, o, run->iteration, ms / 1000.0, tflops);
    tally->loss = tally->time = 0.0;
    for (int k = 0; k < 4; k++) tally->moe[k] = 0.0;
    tally->steps = tally->skipped = tally->nan = 0;
}

/* The validation loss every --eval-interval iterations (Megatron's validation iterator carries on
 * across evaluations; --full-validation: the whole split each time). */
static void validate_during_training(run_state* run) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    char prefix[64];
    snprintf(prefix, sizeof(prefix), "iteration %lld", (long long)run->iteration);
    double loss = o->full_validation ? evaluate_full(run->t, run->data, MT_SPLIT_VALID, c, run->tokens)
                                     : evaluate(run->t, run->data, MT_SPLIT_VALID, &run->consumed_valid, o->eval_iters,
                                                c, run->tokens, 0);
    print_validation(prefix, loss);
    if (run->tb) tensorboard_evaluation(run->tb, o, "validation", loss, run->iteration, run->consumed);
}

/* The training loop: a step, its TensorBoard scalars, the log line, validation, checkpoints, and
 * Megatron's exit conditions, until --train-iters (or one of them) ends it. */
static void train(run_state* run) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    run->peak_tflops = o->peak_tflops > 0 ? o->peak_tflops : mt_device_peak_tflops(c->precision);
    size_t rank_samples = (size_t)max_micro_batches(c) * c->micro_batch_size; /* this rank's largest share */
    run->tokens = (int32_t*)malloc(sizeof(int32_t) * rank_samples * (c->seq_length + 1));
    if (!run->tokens) die(1, "cannot allocate the batch");
    train_tally tally;
    memset(&tally, 0, sizeof(tally));
    double t_start = now_seconds();
    /* the iteration of the last save (a resumed iteration on the --save-interval grid is on disk) */
    const int64_t resumed = run->iteration;
    run->saved_at = o->save_interval > 0 && resumed > 0 && resumed % o->save_interval == 0 ? resumed : -1;
    run->why = NULL;
    run->saver = (checkpoint_saver){o->save, o->async_save, o->save_retain_interval, run->rank, -1};
    if (o->exit_signal_handler) install_exit_signal_handler();
    if (o->skip_train) printf("skipping training (--skip-train is on) ...\n");
    while (!o->skip_train && run->iteration < c->train_iters) {
        /* this iteration's global batch (a --rampup-batch-size / --step-batch-size-schedule grows it) */
        int micro = mt_num_micro_batches_at(c, run->consumed);
        int batch = micro * c->micro_batch_size * c->data_parallel_size;
        mt_step_result r;
        train_step(run, &tally, micro, batch, &r);
        if (run->tb && run->iteration % o->tensorboard_log_interval == 0)
            tensorboard_iteration(run->tb, o, run->t, &r, run->iteration, run->consumed, batch);
        if (run->iteration % o->log_interval == 0 || run->iteration == c->train_iters)
            print_log_line(run, &tally, &r, batch);
        if (o->eval_interval > 0 && run->iteration % o->eval_interval == 0 && (o->eval_iters > 0 || o->full_validation) &&
            split_samples(run->data, MT_SPLIT_VALID) > 0)
            validate_during_training(run);
        if (o->save && o->save_interval > 0 && run->iteration % o->save_interval == 0)
            run->saved_at = save_checkpoint(run->t, &run->saver, run->iteration, run->consumed);
        /* Megatron's exit conditions: save (unless just saved) and stop, without the final evaluations */
        if ((run->why = exit_reason(o, run->iteration, run->t_launch, run->why_buf, sizeof(run->why_buf))) != NULL) {
            if (o->save && run->saved_at != run->iteration)
                run->saved_at = save_checkpoint(run->t, &run->saver, run->iteration, run->consumed);
            printf("exiting program %s\n", run->why);
            break;
        }
    }
    if (!run->why && !o->skip_train) {
        printf("training took %.1f s\n", now_seconds() - t_start);
        print_memory_in_use(run->t, run->iteration); /* the plan against the device once training has run */
    }
}

/* as Megatron: validation and test losses at the end of training, or instead of it with
 * --skip-train (then nothing goes to TensorBoard, as in Megatron) */
static void evaluate_at_end(run_state* run) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    mt_tb_writer* final_tb = o->skip_train ? NULL : run->tb;
    char prefix[96];
    int validate = o->full_validation ? split_samples(run->data, MT_SPLIT_VALID) > 0
                                      : o->eval_iters > 0 && split_samples(run->data, MT_SPLIT_VALID) >=
                                                                 run->consumed_valid + o->eval_iters * c->global_batch_size;
    if (validate) {
        double loss = o->full_validation ? evaluate_full(run->t, run->data, MT_SPLIT_VALID, c, run->tokens)
                                         : evaluate(run->t, run->data, MT_SPLIT_VALID, &run->consumed_valid,
                                                    o->eval_iters, c, run->tokens, 1);
        snprintf(prefix, sizeof(prefix), "iteration %lld on validation set", (long long)run->iteration);
        print_validation(prefix, loss);
        if (final_tb) tensorboard_evaluation(final_tb, o, "validation", loss, run->iteration, run->consumed);
    }
    if (o->eval_iters > 0 && split_samples(run->data, MT_SPLIT_TEST) >= o->eval_iters * c->global_batch_size) {
        int64_t consumed_test = 0;
        double loss = evaluate(run->t, run->data, MT_SPLIT_TEST, &consumed_test, o->eval_iters, c, run->tokens, 1);
        snprintf(prefix, sizeof(prefix), "iteration %lld on test set", (long long)run->iteration);
        print_validation(prefix, loss);
        if (final_tb) tensorboard_evaluation(final_tb, o, "test", loss, run->iteration, run->consumed);
    }
}

/* The end of a run: the events closed, the last checkpoint (a save in flight committed first), and
 * the text sample unless an exit condition stopped the run. */
static void finish_run(run_state* run) {
    const tg_flags* o = &run->o;
    const mt_config* c = &o->cfg;
    mt_error err;
    if (run->tb && mt_tb_close(run->tb, &err) != MT_OK) die(1, "%s", err.message);
    if (o->save && !o->skip_train && run->saved_at != run->iteration)
        save_checkpoint(run->t, &run->saver, run->iteration, run->consumed);
    if (o->async_save) save_poll(run->t, &run->saver, 1); /* a save still in flight completes before the run ends */
    if (run->why) {
        /* Megatron's exit conditions end the run without a sample */
    } else if (c->pipeline_model_parallel_size > 1 && o->sample_tokens > 0)
        printf("sample: skipped (generation needs the whole model on one stage: --pipeline-model-parallel-size 1)\n");
    else if (c->context_parallel_size > 1 && o->sample_tokens > 0)
        printf("sample: skipped (generation needs whole sequences on one rank: --context-parallel-size 1)\n");
    else /* every rank samples (the same tokens: same seed; with tensor parallelism the forward needs the
          * whole TP group); only rank 0's stdout is open */
        print_sample(run->t, run->tok, c, o->sample_tokens, c->seed);
}

/* Everything the run holds released (what a --plan run never made is NULL), then MPI's end. */
static void shut_down(run_state* run) {
    free(run->tokens);
    if (run->t) mt_trainer_free(run->t);
    if (run->data) mt_gpt_data_close(run->data);
    if (run->tok) mt_tokenizer_free(run->tok);
#ifdef MT_USE_MPI
    MPI_Finalize();
#endif
}

/* ---- main ------------------------------------------------------------------------------------- */

int main(int argc, char** argv) {
    run_state run;
    memset(&run, 0, sizeof(run));
    run.t_launch = now_seconds(); /* --exit-duration-in-mins counts from here, as Megatron from its start */
    launch(&run, &argc, &argv);
    read_flags(&run, argc, argv);
    finish_config(&run);
    open_log_line(&run);
    note_grad_bf16(&run);
    if (run.planning) { /* --plan, --plan-layouts: no GPU, no data */
        int status = run_plan(&run.o, &run.o.cfg, run.sequence_parallel, run.global_batch);
        shut_down(&run);
        return status;
    }
    count_samples(&run);
    check_gpu();
    open_data(&run);
    create_trainer(&run);
    load_checkpoint(&run);
    run.tb = tensorboard_open(&run.o, argc, argv, run.iteration);
    train(&run);
    if (!run.why) evaluate_at_end(&run); /* an exit condition stops as Megatron does: no final evaluation */
    finish_run(&run);
    shut_down(&run);
    return 0;
}
