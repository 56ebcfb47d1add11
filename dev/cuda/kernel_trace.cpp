// dev/cuda/kernel_trace.cpp — a timeline for machines without Nsight Systems: a CUPTI activity tracer that
// CUDA's injection mechanism loads into any CUDA program, unchanged and unrelinked:
//   CUDA_INJECTION64_PATH=$PWD/dev/cuda/libkernel_trace.so MT_TRACE_OUT=/tmp/t.csv ./train_gpt ...
// The driver dlopens this library in cuInit and calls InitializeInjection(). We enable activity records for
// kernels, memcpys, memsets (GPU intervals), runtime and driver API calls (host intervals, whose correlation
// ids name the GPU work they launched) and synchronisations (host waits), and write them as one CSV
//   kind,name,start_ns,end_ns,correlation_id,stream_id,device_id
// (kind: kernel memcpy memset runtime driver sync; empty fields where a kind has no such value; lines
// starting with '#' are comments). All timestamps are CUPTI's, one clock for GPU and host records.
// Analysis: dev/bench/trace_gaps.py. A dev tool only: never linked into train_gpt.
// Environment: MT_TRACE_OUT (default kernel_trace.csv; "%p" becomes the process id, one file per MPI rank),
// MT_TRACE_MAX (records kept, default 2000000; later ones are discarded so a long run cannot fill the disk),
// MT_TRACE_START_MS (discard records starting earlier than that many ms after initialisation: start-up).
// A failing CUPTI call prints "kernel_trace: <call> failed: <reason>" and stops tracing; the traced program
// runs on as it would have, with its own exit status.
#include <cupti.h>
#include <cxxabi.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

constexpr size_t kBufferBytes = 4u << 20;  // CUPTI fills these and hands them back on its worker thread

struct State {
    std::mutex mu;                 // the buffer callback runs on CUPTI's thread and on the flushing one
    std::atomic<bool> on{false};   // false before init, after a failure and after the exit flush
    std::atomic<const char*> failed{nullptr};  // the first failed call, reported in the CSV
    FILE* f = nullptr;             // the temporary file, renamed to `path` at exit (never a half file there)
    std::string path, tmp;
    uint64_t t_min = 0, max_records = 2000000;
    uint64_t written = 0, early = 0, over_max = 0, incomplete = 0, cupti_dropped = 0;
    std::unordered_map<const char*, std::string> kernel_names;  // CUPTI shares one name pointer per kernel
    std::unordered_map<uint64_t, std::string> api_names;        // (domain << 32 | cbid) -> function name
};
// Never destroyed: CUPTI may still call back while the process's static destructors run.
State& g = *new State;

bool ok(CUptiResult r, const char* call) {
    if (r == CUPTI_SUCCESS) return true;
    const char* s = nullptr;
    if (cuptiGetResultString(r, &s) != CUPTI_SUCCESS || !s) s = "unknown error";
    fprintf(stderr, "kernel_trace: %s failed: %s\n", call, s);
    const char* none = nullptr;
    g.failed.compare_exchange_strong(none, call);
    g.on = false;
    return false;
}

// Demangling costs microseconds, once per distinct kernel thanks to the cache.
const char* kernel_name(const char* mangled) {
    if (!mangled) return "?";
    auto it = g.kernel_names.find(mangled);
    if (it != g.kernel_names.end()) return it->second.c_str();
    int status = 0;
    char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    std::string s = (status == 0 && d) ? d : mangled;
    free(d);
    return g.kernel_names.emplace(mangled, std::move(s)).first->second.c_str();
}

// "cudaLaunchKernel_v7000" -> "cudaLaunchKernel". A name CUPTI cannot give (an id newer than this
// CUPTI) is not a tracing failure: the record keeps its id as its name.
const char* api_name(CUpti_CallbackDomain domain, uint32_t cbid) {
    uint64_t key = (uint64_t)domain << 32 | cbid;
    auto it = g.api_names.find(key);
    if (it != g.api_names.end()) return it->second.c_str();
    const char* n = nullptr;
    std::string s;
    if (cuptiGetCallbackName(domain, cbid, &n) == CUPTI_SUCCESS && n) {
        s = n;
        size_t v = s.rfind("_v");
        if (v != std::string::npos && v + 2 < s.size() && strspn(s.c_str() + v + 2, "0123456789") == s.size() - v - 2)
            s.resize(v);
    } else {
        s = std::string(domain == CUPTI_CB_DOMAIN_RUNTIME_API ? "runtime_cbid_" : "driver_cbid_") + std::to_string(cbid);
    }
    return g.api_names.emplace(key, std::move(s)).first->second.c_str();
}

// One CSV line; stream or device < 0: not applicable (empty field). Called with g.mu held.
void put(const char* kind, const char* name, uint64_t start, uint64_t end, uint32_t corr, int64_t stream, int64_t dev) {
    if (end < start || start == 0) { g.incomplete++; return; }  // a forced flush can hand over unfinished work
    if (start < g.t_min) { g.early++; return; }
    if (g.written >= g.max_records) { g.over_max++; return; }
    fprintf(g.f, "%s,\"", kind);
    for (const char* c = name; *c; c++) {  // demangled names hold commas: quote, doubling any quote
        if (*c == '"') fputc('"', g.f);
        fputc(*c, g.f);
    }
    fprintf(g.f, "\",%llu,%llu,%u,", (unsigned long long)start, (unsigned long long)end, corr);
    if (stream >= 0) fprintf(g.f, "%lld", (long long)stream);
    fputc(',', g.f);
    if (dev >= 0) fprintf(g.f, "%lld", (long long)dev);
    fputc('\n', g.f);
    g.written++;
}

const char* memcpy_name(uint8_t kind) {
    switch (kind) {
        case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
        case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
        case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
        case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "memcpy HtoH";
        case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "memcpy PtoP";
        default: return "memcpy";
    }
}

// stream_wait_event is a GPU-side wait recorded on the host call; the others block the host.
const char* sync_name(CUpti_ActivitySynchronizationType t) {
    switch (t) {
        case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_EVENT_SYNCHRONIZE: return "event_sync";
        case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_WAIT_EVENT: return "stream_wait_event";
        case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_SYNCHRONIZE: return "stream_sync";
        case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_CONTEXT_SYNCHRONIZE: return "context_sync";
        default: return "sync";
    }
}

// The record layouts are the versions of the CUDA 13 headers (Kernel10, Memcpy6, Memset4).
void write_record(const CUpti_Activity* r) {
    switch (r->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            auto k = (const CUpti_ActivityKernel10*)r;
            put("kernel", kernel_name(k->name), k->start, k->end, k->correlationId, k->streamId, k->deviceId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            auto m = (const CUpti_ActivityMemcpy6*)r;
            put("memcpy", memcpy_name(m->copyKind), m->start, m->end, m->correlationId, m->streamId, m->deviceId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            auto m = (const CUpti_ActivityMemset4*)r;
            put("memset", "memset", m->start, m->end, m->correlationId, m->streamId, m->deviceId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_RUNTIME:
        case CUPTI_ACTIVITY_KIND_DRIVER: {
            auto a = (const CUpti_ActivityAPI*)r;
            bool rt = r->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
            put(rt ? "runtime" : "driver", api_name(rt ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid),
                a->start, a->end, a->correlationId, -1, -1);
            break;
        }
        case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
            auto s = (const CUpti_ActivitySynchronization*)r;
            int64_t stream = s->streamId == CUPTI_SYNCHRONIZATION_INVALID_VALUE ? -1 : (int64_t)s->streamId;
            put("sync", sync_name(s->type), s->start, s->end, s->correlationId, stream, -1);
            break;
        }
        default: break;  // kinds we did not enable (none expected)
    }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = (uint8_t*)aligned_alloc(8, kBufferBytes);  // CUPTI wants 8-byte alignment
    *size = *buffer ? kBufferBytes : 0;                  // no memory: CUPTI drops records and counts them
    *max_records = 0;                                    // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t, size_t valid) {
    {
        std::lock_guard<std::mutex> lock(g.mu);
        if (g.on && g.f) {
            CUpti_Activity* r = nullptr;
            for (;;) {
                CUptiResult res = cuptiActivityGetNextRecord(buffer, valid, &r);
                if (res == CUPTI_ERROR_MAX_LIMIT_REACHED) break;  // the end of this buffer
                if (!ok(res, "cuptiActivityGetNextRecord")) break;
                write_record(r);
            }
            size_t dropped = 0;
            if (ok(cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped), "cuptiActivityGetNumDroppedRecords"))
                g.cupti_dropped += dropped;
        }
    }
    free(buffer);
}

// Runs at exit (atexit, registered at init): flush CUPTI's buffers, end the CSV with what was left out, and
// move it into place. Records of work still running are incomplete and skipped.
void at_exit() {
    if (g.on) ok(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
    std::lock_guard<std::mutex> lock(g.mu);
    g.on = false;
    if (!g.f) return;
    fprintf(g.f, "# %llu records; left out: %llu before MT_TRACE_START_MS, %llu incomplete, %llu dropped by CUPTI",
            (unsigned long long)g.written, (unsigned long long)g.early, (unsigned long long)g.incomplete,
            (unsigned long long)g.cupti_dropped);
    if (g.over_max) fprintf(g.f, ", %llu past MT_TRACE_MAX=%llu (recording stopped there)",
                            (unsigned long long)g.over_max, (unsigned long long)g.max_records);
    fputc('\n', g.f);
    if (const char* f = g.failed.load()) fprintf(g.f, "# tracing stopped early: %s failed\n", f);
    bool good = !ferror(g.f);
    good = fclose(g.f) == 0 && good;
    g.f = nullptr;
    if (!good || rename(g.tmp.c_str(), g.path.c_str()) != 0) {
        fprintf(stderr, "kernel_trace: writing %s failed: %s\n", g.path.c_str(), strerror(errno));
        unlink(g.tmp.c_str());
        return;
    }
    fprintf(stderr, "kernel_trace: %llu records in %s\n", (unsigned long long)g.written, g.path.c_str());
}

// A numeric environment variable in [0, max]; false (with one line) if set and malformed.
bool env_u64(const char* name, uint64_t max, uint64_t* out) {
    const char* s = getenv(name);
    if (!s || !*s) return true;
    char* end = nullptr;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || s[0] == '-' || v > max) {
        fprintf(stderr, "kernel_trace: %s=%s is not an integer in [0, %llu]; not tracing\n", name, s,
                (unsigned long long)max);
        return false;
    }
    *out = v;
    return true;
}

#define KIND(k) {CUPTI_ACTIVITY_KIND_##k, "cuptiActivityEnable(CUPTI_ACTIVITY_KIND_" #k ")"}
const struct { CUpti_ActivityKind kind; const char* call; } kKinds[] = {
    KIND(CONCURRENT_KERNEL), KIND(MEMCPY), KIND(MEMSET), KIND(RUNTIME), KIND(DRIVER), KIND(SYNCHRONIZATION)};

}  // namespace

// Called by the driver inside cuInit. Returns 1 whatever happens: the program must run as without us.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
    static std::atomic<bool> once{false};
    if (once.exchange(true)) return 1;
    uint64_t start_ms = 0;
    if (!env_u64("MT_TRACE_MAX", UINT64_MAX, &g.max_records) || !env_u64("MT_TRACE_START_MS", 86400000ull, &start_ms))
        return 1;
    const char* out = getenv("MT_TRACE_OUT");
    std::string p = out && *out ? out : "kernel_trace.csv";
    for (size_t i; (i = p.find("%p")) != std::string::npos;) p.replace(i, 2, std::to_string(getpid()));
    g.path = p;
    g.tmp = p + ".tmp" + std::to_string(getpid());
    uint64_t t0 = 0;
    if (!ok(cuptiGetTimestamp(&t0), "cuptiGetTimestamp")) return 1;
    g.t_min = t0 + start_ms * 1000000ull;
    g.f = fopen(g.tmp.c_str(), "w");
    if (!g.f) {
        fprintf(stderr, "kernel_trace: fopen %s failed: %s\n", g.tmp.c_str(), strerror(errno));
        return 1;
    }
    fputs("kind,name,start_ns,end_ns,correlation_id,stream_id,device_id\n", g.f);
    bool good = atexit(at_exit) == 0;  // first: without the exit hook no CSV would ever be finished
    if (!good) fprintf(stderr, "kernel_trace: atexit failed; not tracing\n");
    good = good && ok(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    size_t n = 0;  // kinds enabled so far
    while (good && n < sizeof kKinds / sizeof kKinds[0]) {
        if (ok(cuptiActivityEnable(kKinds[n].kind), kKinds[n].call)) n++;
        else good = false;
    }
    if (!good) {  // undo what was enabled (best effort: we are already failing) and leave no file behind
        for (size_t i = 0; i < n; i++) (void)cuptiActivityDisable(kKinds[i].kind);
        std::lock_guard<std::mutex> lock(g.mu);
        fclose(g.f);
        g.f = nullptr;
        unlink(g.tmp.c_str());
        return 1;
    }
    g.on = true;
    return 1;
}
