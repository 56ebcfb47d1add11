/* tests/test_watchdog.h — the collectives' watchdog (--distributed-timeout-minutes, issue #23).
 * Host: the flag and the config refuse a timeout that is not a positive finite number of minutes.
 * GPU: the watchdog of megatron.cu section 15 on a stream of the test's own: a kernel that never ends
 * (it spins on a flag in mapped host memory, as a collective waits for a dead peer) is reported once,
 * after the timeout and not before, in one line naming the rank and the stream; a stream that is busy
 * but makes progress (0.2 s kernels one after another, the host waiting for each as training does)
 * is never reported with a timeout of 1 s; a stuck stream whose queue another thread has filled (its
 * launches wait, and so does the watchdog's event record) is still reported once. The multi-GPU case (a rank stopped with SIGSTOP in the
 * middle of a PP = 2 run: the other rank ends the job with the line) is dev/timeout_check.sh. */
#ifndef MT_TEST_WATCHDOG_H
#define MT_TEST_WATCHDOG_H

#include "../train_gpt_flags.h"

static test_result test_watchdog_flag(void) {
    const char* bad[] = {"0", "-1", "nan", "inf", "1e7", "abc"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char* argv[] = {(char*)"train_gpt", (char*)"--distributed-timeout-minutes", (char*)bad[i]};
        tg_flags v;
        char msg[512];
        tg_flags_init(&v);
        int r = tg_flags_parse(&v, 3, argv, msg, sizeof(msg));
        if (r == 0) r = tg_flags_apply(&v, msg, sizeof(msg));
        EXPECT(r != 0 && strstr(msg, "--distributed-timeout-minutes"), "--distributed-timeout-minutes %s: %s", bad[i],
               r ? msg : "accepted");
    }
    char* argv[] = {(char*)"train_gpt", (char*)"--distributed-timeout-minutes", (char*)"0.5"};
    tg_flags v;
    char msg[512];
    tg_flags_init(&v);
    EXPECT(tg_flags_parse(&v, 3, argv, msg, sizeof(msg)) == 0 && tg_flags_apply(&v, msg, sizeof(msg)) == 0, "%s", msg);
    EXPECT(v.cfg.distributed_timeout_minutes == 0.5, "read %g", v.cfg.distributed_timeout_minutes);
    mt_config c = small_test_config();
    mt_error err;
    EXPECT(c.distributed_timeout_minutes == 10.0, "default %g, Megatron's is 10", c.distributed_timeout_minutes);
    c.distributed_timeout_minutes = NAN;
    EXPECT(mt_config_finalize(&c, &err) == MT_ERR_CONFIG && strstr(err.message, "--distributed-timeout-minutes"),
           "a NaN timeout: %s", err.message);
    return TEST_PASS;
}

/* spins until *flag is set from the host (a collective whose peer never comes) */
__global__ void watchdog_spin_kernel(volatile int* flag) {
    while (*flag == 0) __nanosleep(10000);
}
/* busy for ns nanoseconds of the GPU's global timer */
__global__ void watchdog_busy_kernel(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(10000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < ns);
}

typedef struct {
    int calls;
    double at;
    char line[512];
} watchdog_report;
static void watchdog_test_handler(const char* message, void* user) {
    watchdog_report* r = (watchdog_report*)user;
    snprintf(r->line, sizeof(r->line), "%s", message);
    r->at = watchdog_now();
    __atomic_add_fetch(&r->calls, 1, __ATOMIC_SEQ_CST);
}

/* A thread that queues WATCHDOG_FLOOD empty kernels on one stream (it waits wherever the queue is full). */
#define WATCHDOG_FLOOD 200000
__global__ void watchdog_empty_kernel(void) {}
typedef struct {
    cudaStream_t stream;
    int device, launched;
    cudaError_t status;
} watchdog_flood;
static void* watchdog_flood_main(void* arg) {
    watchdog_flood* f = (watchdog_flood*)arg;
    cudaSetDevice(f->device);
    for (int i = 0; i < WATCHDOG_FLOOD; i++) {
        watchdog_empty_kernel<<<1, 1, 0, f->stream>>>();
        __atomic_store_n(&f->launched, i + 1, __ATOMIC_SEQ_CST);
    }
    f->status = cudaGetLastError();
    return NULL;
}

static mt_watchdog* watchdog_on(cudaStream_t s, double timeout_s, watchdog_report* r, mt_error* err) {
    mt_watchdog* w = (mt_watchdog*)calloc(1, sizeof(mt_watchdog));
    w->num_streams = 1;
    w->stream[0] = s;
    w->stream_name[0] = "test";
    w->rank = 3;
    cudaGetDevice(&w->device);
    w->timeout_s = timeout_s;
    w->handler = watchdog_test_handler;
    w->user = r;
    if (watchdog_start(w, err) != MT_OK) {
        watchdog_stop(w);
        return NULL;
    }
    return w;
}

static test_result test_watchdog_stuck_and_busy(void) {
    REQUIRE_GPU();
    cudaStream_t s;
    EXPECT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
    mt_error err;
    /* a stream that never moves: reported once, after 0.5 s and within the timeout + 2 periods */
    int* flag = NULL;
    int* flag_dev = NULL;
    EXPECT(cudaHostAlloc((void**)&flag, sizeof(int), cudaHostAllocMapped) == cudaSuccess, "mapped flag");
    EXPECT(cudaHostGetDevicePointer((void**)&flag_dev, flag, 0) == cudaSuccess, "device pointer");
    *(volatile int*)flag = 0;
    watchdog_spin_kernel<<<1, 1, 0, s>>>(flag_dev);
    EXPECT(cudaGetLastError() == cudaSuccess, "spin launch");
    watchdog_report stuck;
    memset(&stuck, 0, sizeof(stuck));
    const double t0 = watchdog_now();
    mt_watchdog* w = watchdog_on(s, 0.5, &stuck, &err);
    EXPECT(w != NULL, "%s", err.message);
    while (__atomic_load_n(&stuck.calls, __ATOMIC_SEQ_CST) == 0 && watchdog_now() - t0 < 10.0) usleep(10000);
    usleep(600000); /* a second report would come within a period */
    *(volatile int*)flag = 1; /* the kernel ends */
    cudaError_t e = cudaStreamSynchronize(s);
    watchdog_stop(w);
    EXPECT(e == cudaSuccess, "the spinning kernel: %s", cudaGetErrorString(e));
    printf("      stuck stream: %d report(s) after %.2f s: %s\n", stuck.calls, stuck.at - t0, stuck.line);
    EXPECT(stuck.calls == 1, "%d reports of a stuck stream, want 1", stuck.calls);
    EXPECT(stuck.at - t0 >= 0.5 && stuck.at - t0 <= 0.5 + 2 * 0.125 + 0.5, "reported after %.2f s", stuck.at - t0);
    EXPECT(strstr(stuck.line, "rank 3: the test stream has made no progress") &&
           strstr(stuck.line, "last NCCL operation issued here: none yet"), "line: %s", stuck.line);

    /* stuck with the GPU's queue full: behind a kernel that never ends, another thread queues tiny
     * kernels (as the training thread goes on queueing a step's work behind a collective whose peer
     * is gone) until a launch waits for room; then the watchdog's own event record on that stream
     * waits too. Still reported once, after the timeout. */
    *(volatile int*)flag = 0;
    watchdog_spin_kernel<<<1, 1, 0, s>>>(flag_dev);
    EXPECT(cudaGetLastError() == cudaSuccess, "spin launch");
    watchdog_flood flood;
    memset(&flood, 0, sizeof(flood));
    flood.stream = s;
    cudaGetDevice(&flood.device);
    pthread_t flooder;
    EXPECT(pthread_create(&flooder, NULL, watchdog_flood_main, &flood) == 0, "launching thread");
    watchdog_report full;
    memset(&full, 0, sizeof(full));
    const double t1 = watchdog_now();
    w = watchdog_on(s, 0.5, &full, &err);
    EXPECT(w != NULL, "%s", err.message);
    while (__atomic_load_n(&full.calls, __ATOMIC_SEQ_CST) == 0 && watchdog_now() - t1 < 10.0) usleep(10000);
    usleep(600000);
    const int launched_then = __atomic_load_n(&flood.launched, __ATOMIC_SEQ_CST);
    *(volatile int*)flag = 1;
    pthread_join(flooder, NULL);
    e = cudaStreamSynchronize(s);
    watchdog_stop(w);
    cudaFreeHost(flag);
    EXPECT(e == cudaSuccess && flood.status == cudaSuccess, "the queued kernels: %s",
           cudaGetErrorString(e != cudaSuccess ? e : flood.status));
    printf("      full queue (the launching thread waited after %d of %d launches): %d report(s) after %.2f s: %s\n",
           launched_then, WATCHDOG_FLOOD, full.calls, full.at - t1, full.line);
    EXPECT(launched_then < WATCHDOG_FLOOD, "the queue never filled (%d launches): the case is not tested", launched_then);
    EXPECT(full.calls == 1, "%d reports of a stuck stream with a full queue, want 1", full.calls);
    EXPECT(full.at - t1 >= 0.5 && full.at - t1 <= 0.5 + 2 * 0.125 + 0.5, "reported after %.2f s", full.at - t1);
    EXPECT(strstr(full.line, "rank 3: the test stream has made no progress"), "line: %s", full.line);

    /* busy but moving: 20 kernels of 0.2 s, the host waiting for each; timeout 1 s */
    watchdog_report busy;
    memset(&busy, 0, sizeof(busy));
    w = watchdog_on(s, 1.0, &busy, &err);
    EXPECT(w != NULL, "%s", err.message);
    for (int i = 0; i < 20; i++) {
        watchdog_busy_kernel<<<1, 1, 0, s>>>(200000000LL);
        e = cudaStreamSynchronize(s);
        if (e != cudaSuccess) break;
    }
    watchdog_stop(w);
    cudaStreamDestroy(s);
    EXPECT(e == cudaSuccess, "busy kernels: %s", cudaGetErrorString(e));
    EXPECT(busy.calls == 0, "a stream making progress was reported: %s", busy.line);
    return TEST_PASS;
}

static const test_case watchdog_tests[] = {
    {"watchdog_flag", test_watchdog_flag},
};
static const test_case watchdog_gpu_tests[] = {
    {"watchdog_stuck_and_busy", test_watchdog_stuck_and_busy},
};

#endif
