// kvcached_kv.cpp: llama.cpp's KV cache in kvcached-serve pages (see
// kvcached_kv.h and docs/llama-cpp.md of kvcached-service).
//
// Built into libllama by integrations/llama.cpp/apply.py (src/kvcached_kv.cpp) or
// by Ollama's compat mechanism (llama/compat/*.cpp). Compiled to nothing for
// Ollama's mtmd target, to pass-throughs without the C client (LLAMA_KVCACHED
// undefined).

#if !defined(OLLAMA_COMPAT_MTMD_BUILD)

#include "kvcached_kv.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>

#if defined(LLAMA_KVCACHED)

#include "ggml-backend-impl.h"
#include "llama-impl.h"

#include <kvcached.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

// An anonymous namespace inside a named one: internal linkage, and names
// that cannot collide when llama's unity build puts this file into one
// translation unit with others.
namespace llama_kvcached_impl {
namespace {

constexpr double MiB = 1024.0 * 1024.0;

int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// ---- the C client, found at run time ---------------------------------------
//
// The hook calls libkvcached through this table, filled from the symbols the
// program itself carries (llama-server links the self-contained static
// client, kvcached::kvcached_embed, and exports kvc_*) or else from
// libkvcached.so.1 (or $KVCACHED_CLIENT_LIBRARY). So libllama needs nothing
// at link time, and a program without the client runs as before.

#define LLAMA_KVCACHED_CLIENT_FUNCS(X)                                                                      \
    X(kvc_api_version) X(kvc_status_to_string) X(kvc_last_error) X(kvc_client_create) X(kvc_client_destroy) \
    X(kvc_client_set_timeout) X(kvc_session_options_init) X(kvc_session_open) X(kvc_session_close)          \
    X(kvc_session_id) X(kvc_session_page_size) X(kvc_session_kind) X(kvc_session_ended)                     \
    X(kvc_session_is_resuming) X(kvc_session_resume_count) X(kvc_session_set_reclaim_callback)              \
    X(kvc_session_set_wait) X(kvc_region_create) X(kvc_region_destroy) X(kvc_region_base)                   \
    X(kvc_region_mapped_bytes) X(kvc_region_is_mapped) X(kvc_region_map) X(kvc_region_map_ranges)           \
    X(kvc_region_unmap_ranges) X(kvc_region_memset) X(kvc_region_clear) X(kvc_region_read) X(kvc_region_write) \
    X(kvc_region_rebind)

struct client_api {
#define LLAMA_KVCACHED_FIELD(name) decltype(&::name) name = nullptr;
    LLAMA_KVCACHED_CLIENT_FUNCS(LLAMA_KVCACHED_FIELD)
#undef LLAMA_KVCACHED_FIELD
    // optional (API 1.3): without it a reclaim's answer is only logged
    decltype(&::kvc_session_answer_reclaim) kvc_session_answer_reclaim = nullptr;
};

constexpr int NEED_API = 10200;  // 1.2: kvc_session_set_wait, kvc_region_rebind

// ---- books -------------------------------------------------------------------

struct kv_tensor {
    uint64_t offset;  // from the region base
    uint64_t row;     // bytes per cell (nb[1])
    uint64_t stride;  // bytes per stream (nb[2])
    uint64_t bytes;   // the tensor
    uint64_t extent;  // up to the next tensor (its alignment padding), the last one to the buffer end
    bool     whole;   // map the whole tensor (transposed V)
};

struct kv_cache;

struct kv_buffer {
    // First two members mirror ggml-cuda's ggml_backend_cuda_buffer_context
    // {int device; void * dev_ptr;}: ggml-cuda recognises buffers of its
    // buffer type by the type's function pointers and may read these two.
    int                    device       = 0;
    void *                 dev_ptr      = nullptr;
    ggml_backend_buffer_t  buf          = nullptr;
    kvc_region *           region       = nullptr;
    kv_cache *             cache        = nullptr;
    bool                   host         = true;
    bool                   whole_mapped = false;
    std::string            name;  // as in "<name> KV buffer size"
    std::vector<kv_tensor> tensors;
};

struct kv_cache {
    llama_kvcached_cache_info info;
    std::vector<kv_buffer *>  bufs;
    std::vector<uint32_t>     mapped;  // cells backed per stream (at least)
};

struct kv_line {
    uint64_t logged    = 0;  // bytes in the last "KV buffer size" line
    int64_t  logged_at = 0;  // when (ms)
};

enum class mode { untried, off, on };

struct state {
    std::mutex           reg;     // everything below that is not atomic
    std::recursive_mutex server;  // llama_kvcached_lock: the server's main loop holds it

    mode               m = mode::untried;
    client_api         api;
    std::string        api_from;
    std::string        socket;
    kvc_client *       client  = nullptr;
    kvc_session *      session = nullptr;
    std::vector<kvc_session *> ended_sessions;  // kept: regions may have been rebound away from them
    std::vector<kvc_client *>  old_clients;
    uint64_t           page = 0;
    std::string        kind;

    // session options from the environment (ChildEnv of clients/go sets them)
    std::string                                      name, device;
    std::vector<std::pair<std::string, std::string>> labels;
    uint64_t                                         guaranteed = 0, max = 0;
    int32_t                                          priority   = 0;

    // decode path policy
    uint32_t wait_ms        = 1000;  // KVCACHED_WAIT_MS: one Allocate waits at most this
    uint32_t fail_fast_ms   = 2000;  // KVCACHED_FAIL_FAST_MS: after a refusal, no waiting this long
    uint32_t wait_daemon_ms = 5000;  // KVCACHED_WAIT_DAEMON_MS: a batch that needs new pages while the daemon is away waits this long for it
    bool     wait_spent     = false; // such a wait ran out: no more waiting until the daemon is back
    int64_t  no_wait_until  = 0;
    bool     wait_set       = false;
    bool     wait_on        = false;
    std::string last_error;          // why the last batch could not be backed ("" = it could)
    std::string logged_error;        // the last one logged, and when: the retries of one
    int64_t     logged_error_at = 0; // request (llama-server halves the batch) log it once

    // daemon loss
    bool    lost          = false;   // the session ended: reconnecting
    bool    resuming_said = false;
    uint64_t resumes_seen = 0;
    int64_t next_reconnect = 0;
    int64_t reconnect_backoff = 250;

    std::unordered_map<const void *, kv_cache *>           caches;
    std::unordered_map<ggml_backend_buffer_t, kv_buffer *> buffers;
    std::map<std::string, kv_line>                         lines;
    bool                                                   lines_pending = false;
    bool                                                   debug         = false;

    // reclaim requests: set on the client's Watch thread, answered by the
    // hook's thread or the server's main loop
    std::atomic<bool>     reclaim_pending{ false };
    std::atomic<uint64_t> reclaim_bytes{ 0 };
    std::atomic<uint64_t> reclaim_id{ 0 };  // the latest request's id (API 1.3; answering one settles the device's)
    std::atomic<bool>     trim_pending{ false };  // no server lock: trim at the next batch
    void (*idle_release)(void *, uint64_t) = nullptr;
    void * idle_user                        = nullptr;

    // the hook's thread
    std::mutex              tmu;
    std::condition_variable tcv;
    std::string             reclaim_reason;  // tmu
    bool                    stop = false;    // tmu
    bool                    exited = false;  // tmu
    std::thread             th;
};

state & S() {
    static state * s = new state();  // never destroyed: the hook's thread may outlive static destruction
    return *s;
}

// ---- helpers -----------------------------------------------------------------

std::string fmt(const char * f, ...) {
    char    buf[1024];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

const char * status_name(kvc_status st) {
    return S().api.kvc_status_to_string ? S().api.kvc_status_to_string(st) : "?";
}

const char * last_err() {
    return S().api.kvc_last_error ? S().api.kvc_last_error() : "";
}

// Strict parsers: a malformed variable is an error that names it.
bool parse_u64(const char * v, uint64_t & out) {
    if (!v || !*v) {
        return false;
    }
    uint64_t x = 0;
    for (const char * p = v; *p; ++p) {
        if (*p < '0' || *p > '9') {
            return false;
        }
        const uint64_t d = (uint64_t) (*p - '0');
        if (x > (UINT64_MAX - d) / 10) {
            return false;
        }
        x = x * 10 + d;
    }
    out = x;
    return true;
}

bool parse_i32(const char * v, int32_t & out) {
    if (!v || !*v) {
        return false;
    }
    errno     = 0;
    char * e  = nullptr;
    long long x = strtoll(v, &e, 10);
    if (errno || *e || e == v || x < INT32_MIN || x > INT32_MAX) {
        return false;
    }
    out = (int32_t) x;
    return true;
}

// Reads the environment; false (with a logged error naming the variable) if
// something is malformed.
bool read_env(state & g) {
    auto u64 = [](const char * var, uint64_t & out) {
        const char * v = getenv(var);
        if (!v || !*v) {
            return true;
        }
        if (!parse_u64(v, out)) {
            LLAMA_LOG_ERROR("kvcached: %s=\"%s\" is not a byte count (decimal digits); KV cache in ordinary memory\n", var,
                            v);
            return false;
        }
        return true;
    };
    auto ms = [&](const char * var, uint32_t & out) {
        uint64_t x = out;
        if (!u64(var, x)) {
            return false;
        }
        if (x > 600000) {
            LLAMA_LOG_ERROR("kvcached: %s=%llu is more than 600000 ms; KV cache in ordinary memory\n", var,
                            (unsigned long long) x);
            return false;
        }
        out = (uint32_t) x;
        return true;
    };
    if (!u64("KVCACHED_GUARANTEED_BYTES", g.guaranteed) || !u64("KVCACHED_MAX_BYTES", g.max) ||
        !ms("KVCACHED_WAIT_MS", g.wait_ms) || !ms("KVCACHED_FAIL_FAST_MS", g.fail_fast_ms) ||
        !ms("KVCACHED_WAIT_DAEMON_MS", g.wait_daemon_ms)) {
        return false;
    }
    if (const char * v = getenv("KVCACHED_PRIORITY"); v && *v && !parse_i32(v, g.priority)) {
        LLAMA_LOG_ERROR("kvcached: KVCACHED_PRIORITY=\"%s\" is not a 32-bit integer; KV cache in ordinary memory\n", v);
        return false;
    }
    if (const char * v = getenv("KVCACHED_SESSION_NAME"); v && *v) {
        g.name = v;
    } else {
        g.name = std::string("llama.cpp pid ") + std::to_string((long) getpid());
    }
    if (const char * v = getenv("KVCACHED_SESSION_LABELS"); v && *v) {
        // k=v,k=v (clients/go ChildEnv): keys non-empty, no ',' in values
        std::string s = v;
        size_t      at = 0;
        while (at <= s.size()) {
            size_t      comma = s.find(',', at);
            std::string kv    = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
            size_t      eq    = kv.find('=');
            if (eq == std::string::npos || eq == 0) {
                LLAMA_LOG_ERROR("kvcached: KVCACHED_SESSION_LABELS=\"%s\": \"%s\" is not key=value; KV cache in "
                                "ordinary memory\n",
                                v, kv.c_str());
                return false;
            }
            g.labels.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
            if (comma == std::string::npos) {
                break;
            }
            at = comma + 1;
        }
    }
    if (const char * v = getenv("KVCACHED_DEVICE"); v && *v) {
        g.device = v;
    }
    g.debug = getenv("KVCACHED_DEBUG") && strcmp(getenv("KVCACHED_DEBUG"), "0") != 0;
    return true;
}

// Fill the table: the program's own symbols first, else the shared library.
bool load_api(state & g) {
    void * h = RTLD_DEFAULT;
    if (dlsym(RTLD_DEFAULT, "kvc_api_version")) {
        g.api_from = "built into this program";
    } else {
        const char * lib = getenv("KVCACHED_CLIENT_LIBRARY");
        if (!lib || !*lib) {
            lib = "libkvcached.so.1";
        }
        h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char * e = dlerror();
            LLAMA_LOG_WARN("kvcached: the daemon socket is set but this program has no kvcached C client (not linked "
                           "in, and %s: %s); KV cache in ordinary memory\n",
                           lib, e ? e : "not found");
            return false;
        }
        g.api_from = lib;
    }
    bool ok = true;
#define LLAMA_KVCACHED_RESOLVE(name)                                                                    \
    g.api.name = reinterpret_cast<decltype(&::name)>(dlsym(h, #name));                                  \
    if (!g.api.name) {                                                                                  \
        LLAMA_LOG_WARN("kvcached: the C client (%s) lacks %s (needs API 1.2 or later); KV cache in "      \
                       "ordinary memory\n",                                                             \
                       g.api_from.c_str(), #name);                                                      \
        ok = false;                                                                                     \
    }
    LLAMA_KVCACHED_CLIENT_FUNCS(LLAMA_KVCACHED_RESOLVE)
#undef LLAMA_KVCACHED_RESOLVE
    if (ok && g.api.kvc_api_version() >= 10300) {  // kvc_reclaim.id exists from 1.3 on
        g.api.kvc_session_answer_reclaim =
            reinterpret_cast<decltype(&::kvc_session_answer_reclaim)>(dlsym(h, "kvc_session_answer_reclaim"));
    }
    if (ok && (g.api.kvc_api_version() / 10000 != NEED_API / 10000 || g.api.kvc_api_version() < NEED_API)) {
        LLAMA_LOG_WARN("kvcached: the C client (%s) has API %d; the hook needs %d.x >= %d; KV cache in ordinary memory\n",
                       g.api_from.c_str(), g.api.kvc_api_version(), NEED_API / 10000, NEED_API);
        ok = false;
    }
    return ok;
}

void on_reclaim(void * user, const kvc_reclaim * rq);
void thread_main();

// Open a client and session with the options from the environment (fixed
// after the first call, so no lock is needed). On failure `err` says why.
kvc_status open_session(state & g, kvc_client ** pc, kvc_session ** ps, std::string & err) {
    *pc = nullptr;
    *ps = nullptr;
    kvc_status st = g.api.kvc_client_create(g.socket.c_str(), pc);
    if (st != KVC_OK) {
        err = last_err();
        return st;
    }
    std::vector<kvc_label> labels;
    for (auto & [k, v] : g.labels) {
        labels.push_back({ k.c_str(), v.c_str() });
    }
    kvc_session_options o;
    g.api.kvc_session_options_init(&o);
    o.name             = g.name.c_str();
    o.device           = g.device.empty() ? nullptr : g.device.c_str();
    o.guaranteed_bytes = g.guaranteed;
    o.max_bytes        = g.max;
    o.priority         = g.priority;
    o.labels           = labels.empty() ? nullptr : labels.data();
    o.num_labels       = labels.size();
    o.wait             = 1;
    o.wait_timeout_ms  = g.wait_ms;
    st = g.api.kvc_session_open(*pc, &o, ps);
    if (st != KVC_OK) {
        err = last_err();
        g.api.kvc_client_destroy(*pc);
        *pc = nullptr;
        *ps = nullptr;
        return st;
    }
    kvc_status cb = g.api.kvc_session_set_reclaim_callback(*ps, on_reclaim, nullptr);
    if (cb != KVC_OK) {
        LLAMA_LOG_WARN("kvcached: no reclaim callback (%s: %s): this process only gives pages back when its own cells "
                       "shrink\n",
                       status_name(cb), last_err());
    }
    return KVC_OK;
}

// The daemon session of this process, opened on first use. nullptr when the
// variable is unset or the hook cannot work (then llama.cpp allocates as
// before). Called with g.reg held.
kvc_session * session_locked() {
    state & g = S();
    if (g.m == mode::off) {
        return nullptr;
    }
    if (g.m == mode::on) {
        return g.session;
    }
    g.m            = mode::off;
    const char * v = getenv("OLLAMA_KVCACHED_SOCKET");
    if (!v || !*v) {
        v = getenv("KVCACHED_SOCKET");
    }
    if (!v || !*v) {
        return nullptr;  // not asked for: stay silent
    }
    g.socket = v;
    if (!read_env(g) || !load_api(g)) {
        return nullptr;
    }
    kvc_client *  c = nullptr;
    kvc_session * s = nullptr;
    std::string   err;
    kvc_status    st = open_session(g, &c, &s, err);
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("kvcached: cannot open a session with the daemon at %s (%s: %s); KV cache in ordinary memory\n",
                       g.socket.c_str(), status_name(st), err.c_str());
        return nullptr;
    }
    g.client  = c;
    g.session = s;
    g.page    = g.api.kvc_session_page_size(s);
    g.kind    = g.api.kvc_session_kind(s);
    g.m       = mode::on;
    std::string lab;
    for (auto & [k, val] : g.labels) {
        lab += (lab.empty() ? "" : ",") + k + "=" + val;
    }
    LLAMA_LOG_INFO("kvcached: session %llu \"%s\" at %s (%s pages of %.2f MiB; guaranteed %llu, max %llu, priority %d, "
                   "labels {%s}; C client %s; an Allocate waits at most %u ms)\n",
                   (unsigned long long) g.api.kvc_session_id(s), g.name.c_str(), g.socket.c_str(), g.kind.c_str(),
                   g.page / MiB, (unsigned long long) g.guaranteed, (unsigned long long) g.max, g.priority,
                   lab.c_str(), g.api_from.c_str(), g.wait_ms);
    {
        std::lock_guard<std::mutex> t(g.tmu);
        g.th = std::thread(thread_main);
    }
    atexit([] {
        // stop the hook's thread; if it is stuck (a reconnect in progress, or
        // exit() called with the server lock held) leave it rather than hang
        state &                      st = S();
        std::unique_lock<std::mutex> t(st.tmu);
        st.stop = true;
        st.tcv.notify_all();
        const bool done = st.tcv.wait_for(t, std::chrono::seconds(2), [&] { return st.exited; });
        t.unlock();
        if (done && st.th.joinable()) {
            st.th.join();
        } else if (st.th.joinable()) {
            st.th.detach();
        }
    });
    return g.session;
}

uint64_t held_locked() {
    uint64_t n = 0;
    for (auto & [_, b] : S().buffers) {
        n += S().api.kvc_region_mapped_bytes(b->region);
    }
    return n;
}

void wake_thread() {
    S().tcv.notify_all();
}

// ---- the "KV buffer size" line -------------------------------------------
//
// Ollama (memoryParsingWriter) reads "<component>: <name> KV buffer size =
// X MiB" lines from the child's stderr for as long as it lives, keyed by
// (component, name, "KV"): a later line replaces the earlier value. The
// constructor's line (0.00: nothing mapped yet) is followed by one line per
// buffer name whenever the bytes held change, at most one per name per
// second; a change inside that second is logged when it ends (by the hook's
// thread), so the last line always shows what is held. The value is the sum
// over this process's KV caches of that name.

void log_lines_locked() {
    state &                         g = S();
    std::map<std::string, uint64_t> now;
    for (auto & [_, b] : g.buffers) {
        now[b->name] += g.api.kvc_region_mapped_bytes(b->region);
    }
    for (auto & [name, l] : g.lines) {
        if (!now.count(name)) {
            now[name] = 0;
        }
    }
    const int64_t t = now_ms();
    g.lines_pending = false;
    for (auto & [name, bytes] : now) {
        kv_line & l = g.lines[name];
        if (bytes == l.logged) {
            continue;
        }
        if (t - l.logged_at < 1000) {
            g.lines_pending = true;
            continue;
        }
        LLAMA_LOG_INFO("llama_kv_cache: %10s KV buffer size = %8.2f MiB\n", name.c_str(), bytes / MiB);
        l.logged    = bytes;
        l.logged_at = t;
    }
    if (g.lines_pending) {
        wake_thread();
    }
}

// ---- ggml buffer functions ---------------------------------------------------

kv_buffer * lookup(ggml_backend_buffer_t buf) {
    std::lock_guard<std::mutex> lk(S().reg);
    auto it = S().buffers.find(buf);
    return it == S().buffers.end() ? nullptr : it->second;
}

void buf_free(ggml_backend_buffer_t buf) {
    state &     g = S();
    kv_buffer * b = nullptr;
    {
        std::lock_guard<std::mutex> lk(g.reg);
        auto it = g.buffers.find(buf);
        if (it == g.buffers.end()) {
            return;
        }
        b = it->second;
        g.buffers.erase(it);
        if (b->cache) {
            auto & v = b->cache->bufs;
            v.erase(std::remove(v.begin(), v.end(), b), v.end());
            if (v.empty()) {
                g.caches.erase(b->cache->info.owner);
                delete b->cache;
            }
        }
        g.api.kvc_region_destroy(b->region);  // unmap, one Free, release the reservation
        log_lines_locked();
    }
    delete b;
}

void buf_clear(ggml_backend_buffer_t buf, uint8_t value) {
    std::lock_guard<std::mutex> lk(S().reg);  // region calls run under reg (a reconnect rebinds regions)
    auto it = S().buffers.find(buf);
    GGML_ASSERT(it != S().buffers.end());
    kv_buffer * b = it->second;
    // mapped pages only: unmapped ones come back zeroed from the daemon
    kvc_status st = S().api.kvc_region_clear(b->region, value);
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: clear failed (%s: %s)", status_name(st), last_err());
    }
}

uint64_t tensor_offset(const kv_buffer * b, const ggml_tensor * t, size_t offset) {
    return (uint64_t) ((const char *) t->data - (const char *) b->dev_ptr) + offset;
}

void buf_memset_tensor(ggml_backend_buffer_t buf, ggml_tensor * t, uint8_t value, size_t offset, size_t size) {
    std::lock_guard<std::mutex> lk(S().reg);
    auto it = S().buffers.find(buf);
    GGML_ASSERT(it != S().buffers.end());
    kv_buffer *      b   = it->second;
    const uint64_t   off = tensor_offset(b, t, offset);
    kvc_status       st  = KVC_OK;
    const client_api & a = S().api;
    if (value != 0) {
        st = a.kvc_region_map(b->region, off, size);  // a hole would read 0, not value
    }
    if (st == KVC_OK) {
        st = a.kvc_region_memset(b->region, off, size, value);
    }
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: memset failed (%s: %s)", status_name(st), last_err());
    }
}

// device buffers (CUDA): data moves through the client library, which uses
// the driver (cuMemcpyHtoD/DtoH, cuMemsetD8) on the region's device pointers
void * dev_get_base(ggml_backend_buffer_t buf) {
    return ((kv_buffer *) buf->context)->dev_ptr;
}

void dev_set_tensor(ggml_backend_buffer_t buf, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    kv_buffer * b  = (kv_buffer *) buf->context;
    kvc_status  st = S().api.kvc_region_write(b->region, tensor_offset(b, t, offset), data, size);
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: set_tensor failed (%s: %s)", status_name(st), last_err());
    }
}

void dev_get_tensor(ggml_backend_buffer_t buf, const ggml_tensor * t, void * data, size_t offset, size_t size) {
    kv_buffer * b  = (kv_buffer *) buf->context;
    kvc_status  st = S().api.kvc_region_read(b->region, tensor_offset(b, t, offset), data, size);
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: get_tensor failed (%s: %s)", status_name(st), last_err());
    }
}

bool dev_cpy_tensor(ggml_backend_buffer_t, const ggml_tensor *, ggml_tensor *) {
    return false;  // ggml falls back to get + set
}

// ---- layout ------------------------------------------------------------------

// The stock layout (ggml-alloc's): tensors back to back, each at the buffer
// type's alignment, so the reservation is the stock KV buffer and the pages
// held never exceed it rounded up to one page. Tensors smaller than a page
// share pages; a page is mapped while any byte of it backs a needed cell.
bool build_layout(ggml_context * ctx, ggml_backend_buffer_type_t buft, const llama_kvcached_cache_info & info,
                  std::vector<ggml_tensor *> & ts, std::vector<uint64_t> & sizes, std::vector<uint64_t> & offs,
                  uint64_t & total) {
    const uint64_t align = ggml_backend_buft_get_alignment(buft);
    if (align == 0 || (align & (align - 1)) != 0) {
        LLAMA_LOG_WARN("%s: kvcached: buffer alignment %llu is not a power of two\n", __func__,
                       (unsigned long long) align);
        return false;
    }
    total = 0;
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (t->view_src || t->data) {
            continue;
        }
        if (t->ne[1] != (int64_t) info.kv_size || t->ne[2] != (int64_t) info.n_stream || t->ne[3] != 1) {
            LLAMA_LOG_WARN("%s: kvcached: tensor %s is not [n_embd, %u, %u]\n", __func__, t->name, info.kv_size,
                           info.n_stream);
            return false;
        }
        total = (total + align - 1) & ~(align - 1);
        ts.push_back(t);
        sizes.push_back(ggml_backend_buft_get_alloc_size(buft, t));
        offs.push_back(total);
        total += sizes.back();
    }
    return !ts.empty();
}

// Sorted, with ranges that touch or overlap merged: a page that lies wholly
// in two neighbours' free ranges (the tail of one tensor, the head of the
// next) is in one merged range, so unmapping (which narrows each range to
// the pages wholly inside it) gives it back, and a page shared with a
// needed range is never in one.
void merge_ranges(std::vector<kvc_range> & rs) {
    std::sort(rs.begin(), rs.end(), [](const kvc_range & a, const kvc_range & b) { return a.offset < b.offset; });
    size_t n = 0;
    for (const auto & r : rs) {
        if (n > 0 && rs[n - 1].offset + rs[n - 1].size >= r.offset) {
            rs[n - 1].size = std::max(rs[n - 1].offset + rs[n - 1].size, r.offset + r.size) - rs[n - 1].offset;
        } else {
            rs[n++] = r;
        }
    }
    rs.resize(n);
}

// Ranges of cells [from[s], to[s]) of every elastic tensor of b (not
// merged: merge_ranges). A range that runs to the tensor's end runs to the
// next tensor's start (the alignment padding belongs to the tensor; the
// last tensor's runs to the region's end, whose page the client then gives
// back whole).
void cell_ranges(const kv_buffer * b, const std::vector<uint32_t> & from, const std::vector<uint32_t> & to,
                 std::vector<kvc_range> & out) {
    for (const auto & t : b->tensors) {
        if (t.whole) {
            continue;
        }
        for (size_t s = 0; s < from.size(); ++s) {
            if (to[s] <= from[s]) {
                continue;
            }
            uint64_t lo = t.offset + s * t.stride + (uint64_t) from[s] * t.row;
            uint64_t hi = t.offset + s * t.stride + (uint64_t) to[s] * t.row;
            if (hi >= t.offset + t.bytes) {
                hi = t.offset + t.extent;
            }
            out.push_back({ lo, hi - lo });
        }
    }
}

// ---- the session: liveness, errors -------------------------------------------

// Notices a session that ended (daemon gone, not resumable) or is resuming.
// reg held.
void check_session_locked() {
    state & g = S();
    if (g.m != mode::on || !g.session || g.lost) {
        return;
    }
    if (g.api.kvc_session_ended(g.session)) {
        g.lost              = true;
        g.next_reconnect    = now_ms();
        g.reconnect_backoff = 250;
        LLAMA_LOG_WARN("kvcached: lost the daemon at %s (session %llu ended); serving from the %.2f MiB already "
                       "mapped, new KV memory waits for the daemon; reconnecting\n",
                       g.socket.c_str(), (unsigned long long) g.api.kvc_session_id(g.session), held_locked() / MiB);
        wake_thread();
        return;
    }
    if (g.api.kvc_session_is_resuming(g.session)) {
        if (!g.resuming_said) {
            g.resuming_said = true;
            LLAMA_LOG_WARN("kvcached: the daemon at %s went away; session %llu resumes when it is back; serving from "
                           "the %.2f MiB already mapped\n",
                           g.socket.c_str(), (unsigned long long) g.api.kvc_session_id(g.session), held_locked() / MiB);
        }
        return;
    }
    const uint64_t r = g.api.kvc_session_resume_count(g.session);
    if (r != g.resumes_seen) {
        g.resumes_seen  = r;
        g.resuming_said = false;
        g.wait_spent    = false;
        LLAMA_LOG_INFO("kvcached: the daemon at %s is back: session %llu resumed with its pages\n", g.socket.c_str(),
                       (unsigned long long) g.api.kvc_session_id(g.session));
    }
}

// Reconnect after the session ended (hook thread, reg NOT held).
void try_reconnect() {
    state & g = S();
    {
        std::lock_guard<std::mutex> lk(g.reg);
        if (!g.lost || now_ms() < g.next_reconnect) {
            return;
        }
    }
    kvc_client *  c  = nullptr;
    kvc_session * s  = nullptr;
    std::string   err;
    kvc_status    st = open_session(g, &c, &s, err);
    std::lock_guard<std::mutex> lk(g.reg);
    if (st != KVC_OK) {
        g.next_reconnect    = now_ms() + g.reconnect_backoff;
        g.reconnect_backoff = std::min<int64_t>(g.reconnect_backoff * 2, 2000);
        return;
    }
    if (g.api.kvc_session_page_size(s) != g.page || g.kind != g.api.kvc_session_kind(s)) {
        LLAMA_LOG_ERROR("kvcached: the daemon at %s is back with %s pages of %.2f MiB (this cache uses %s pages of %.2f "
                        "MiB): new KV memory cannot come from it; restart this server\n",
                        g.socket.c_str(), g.api.kvc_session_kind(s), g.api.kvc_session_page_size(s) / MiB,
                        g.kind.c_str(), g.page / MiB);
        g.api.kvc_session_close(s);
        g.api.kvc_client_destroy(c);
        g.next_reconnect = LLONG_MAX;
        return;
    }
    for (auto & [_, b] : g.buffers) {
        kvc_status rb = g.api.kvc_region_rebind(b->region, s);
        if (rb != KVC_OK) {
            LLAMA_LOG_ERROR("kvcached: cannot move a KV buffer to the new session (%s: %s)\n", status_name(rb),
                            last_err());
        }
    }
    // the ended session and its client stay (never closed): a region call
    // on another thread may still be using the old session's mapper
    g.ended_sessions.push_back(g.session);
    g.old_clients.push_back(g.client);
    g.client        = c;
    g.session       = s;
    g.lost          = false;
    g.wait_set      = false;
    g.resuming_said = false;
    g.resumes_seen  = 0;
    g.no_wait_until = 0;
    g.wait_spent    = false;
    g.last_error.clear();
    LLAMA_LOG_INFO("kvcached: reconnected to the daemon at %s: session %llu; new KV memory comes from it (the %.2f MiB "
                   "mapped before stay in use until their cells are freed)\n",
                   g.socket.c_str(), (unsigned long long) g.api.kvc_session_id(s), held_locked() / MiB);
}

// The message for a batch the daemon could not back. reg held.
std::string map_error_locked(kvc_status st, const std::string & why, bool waited) {
    state &        g    = S();
    const uint64_t held = held_locked();
    check_session_locked();
    if (g.lost || (st == KVC_ERR_FAILED_PRECONDITION && g.api.kvc_session_ended(g.session))) {
        return fmt("kvcached: the daemon at %s is gone: no new KV memory until it is back (this server keeps serving "
                   "from the %.2f MiB it has mapped; reconnecting)",
                   g.socket.c_str(), held / MiB);
    }
    if (st == KVC_ERR_UNAVAILABLE || g.api.kvc_session_is_resuming(g.session)) {
        return fmt("kvcached: the daemon at %s is unreachable: no new KV memory until it is back (this server keeps "
                   "serving from the %.2f MiB it has mapped) (%s)",
                   g.socket.c_str(), held / MiB, why.c_str());
    }
    if (st == KVC_ERR_RESOURCE_EXHAUSTED || st == KVC_ERR_DEADLINE_EXCEEDED) {
        const std::string how = waited ? fmt("within %u ms", g.wait_ms) : std::string("(no wait: it refused moments ago)");
        return fmt("kvcached: the daemon at %s could not lend more KV memory %s; this server holds %.2f MiB (%s)",
                   g.socket.c_str(), how.c_str(), held / MiB, why.c_str());
    }
    return fmt("kvcached: backing the KV cache with daemon pages failed (%s: %s)", status_name(st), why.c_str());
}

// The daemon is away: the session ended (reconnecting) or is resuming. reg held.
bool daemon_away_locked() {
    state & g = S();
    check_session_locked();
    return g.lost || g.api.kvc_session_is_resuming(g.session);
}

// Wait for the daemon to be back, at most KVCACHED_WAIT_DAEMON_MS (a
// supervised restart takes about a second), releasing reg meanwhile so the
// hook's thread can reconnect. Once a wait ran out, no batch waits again
// until the daemon is back: an outage longer than a restart fails requests
// at once (and llama-server's retries of a failed batch, halved each time,
// never wait). True when the daemon is back.
bool wait_daemon_locked(std::unique_lock<std::mutex> & lk) {
    state &       g        = S();
    const int64_t start    = now_ms();
    const int64_t deadline = start + g.wait_daemon_ms;
    if (g.wait_spent) {
        return false;
    }
    wake_thread();
    while (now_ms() < deadline) {
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        lk.lock();
        if (!daemon_away_locked()) {
            LLAMA_LOG_INFO("kvcached: a batch that needed new KV memory waited %lld ms for the daemon at %s\n",
                           (long long) (now_ms() - start), g.socket.c_str());
            return true;
        }
    }
    g.wait_spent = true;
    LLAMA_LOG_WARN("kvcached: the daemon at %s did not come back within %u ms (KVCACHED_WAIT_DAEMON_MS); batches "
                   "that need new KV memory fail until it is back\n",
                   g.socket.c_str(), g.wait_daemon_ms);
    return false;
}

// The ranges that back cells [0, need[s]) of every stream of b (and its
// whole tensors once anything is needed) and are not all mapped yet.
std::vector<kvc_range> missing_ranges(const kv_buffer * b, const std::vector<uint32_t> & need, bool anything) {
    state &                g = S();
    std::vector<kvc_range> ranges;
    for (const auto & t : b->tensors) {
        if (t.whole) {
            if (anything) {
                ranges.push_back({ t.offset, t.extent });
            }
            continue;
        }
        for (size_t s = 0; s < need.size(); ++s) {
            if (need[s] > 0) {
                ranges.push_back({ t.offset + s * t.stride, (uint64_t) need[s] * t.row });
            }
        }
    }
    // what the pages cover decides, not the cells counted so far: a page
    // backs more cells than the batch that mapped it asked for
    ranges.erase(std::remove_if(ranges.begin(), ranges.end(),
                                [&](const kvc_range & r) { return g.api.kvc_region_is_mapped(b->region, r.offset, r.size); }),
                 ranges.end());
    return ranges;
}

// A batch the daemon could not back: say why (once per 5 s for the same
// message). reg held.
void map_failed_locked(kvc_status st, const std::string & why, bool waited) {
    state & g = S();
    if (st == KVC_ERR_RESOURCE_EXHAUSTED || st == KVC_ERR_DEADLINE_EXCEEDED) {
        g.no_wait_until = now_ms() + g.fail_fast_ms;
    }
    g.last_error    = map_error_locked(st, why, waited);
    const int64_t t = now_ms();
    if (g.last_error != g.logged_error || t - g.logged_error_at >= 5000) {
        LLAMA_LOG_WARN("%s\n", g.last_error.c_str());
        g.logged_error    = g.last_error;
        g.logged_error_at = t;
    }
}

// Back cells [0, need[s]) of every stream. What the mapped pages cover is
// served without the daemon (also while it is away); pages are asked for
// only for the rest. reg held (by lk; released while waiting for a daemon
// that is away). On failure g.last_error says why.
bool map_locked(kv_cache * c, const std::vector<uint32_t> & need_in, std::unique_lock<std::mutex> & lk) {
    state &               g        = S();
    std::vector<uint32_t> need     = need_in;
    bool                  anything = false;
    bool                  beyond   = false;  // cells past what this cache has backed so far
    for (size_t s = 0; s < need.size(); ++s) {
        need[s]  = std::min(need[s], c->info.kv_size);
        anything = anything || need[s] > 0;
        beyond   = beyond || need[s] > c->mapped[s];
    }
    for (kv_buffer * b : c->bufs) {
        beyond = beyond || (anything && !b->whole_mapped);
    }
    if (!beyond) {  // the decode path's common case: no page to look at
        g.last_error.clear();
        return true;
    }
    std::vector<std::vector<kvc_range>> missing(c->bufs.size());
    bool                                any = false;
    for (size_t i = 0; i < c->bufs.size(); ++i) {
        missing[i] = missing_ranges(c->bufs[i], need, anything);
        any        = any || !missing[i].empty();
    }
    if (any && daemon_away_locked()) {
        if (!wait_daemon_locked(lk)) {
            map_failed_locked(KVC_ERR_UNAVAILABLE, "", false);
            return false;
        }
        for (size_t i = 0; i < c->bufs.size(); ++i) {  // reg was released: look again
            missing[i] = missing_ranges(c->bufs[i], need, anything);
        }
    }
    // the decode path waits at most wait_ms, and not at all shortly after a
    // refusal (llama-server then halves the batch and retries: those retries
    // must not wait again)
    const bool wait = now_ms() >= g.no_wait_until;
    if (any && (!g.wait_set || g.wait_on != wait)) {
        g.api.kvc_session_set_wait(g.session, wait ? 1 : 0, g.wait_ms);
        g.wait_set = true;
        g.wait_on  = wait;
    }
    bool changed = false;
    for (size_t i = 0; i < c->bufs.size(); ++i) {
        kv_buffer * b = c->bufs[i];
        if (!missing[i].empty()) {
            const uint64_t before = g.api.kvc_region_mapped_bytes(b->region);
            kvc_status     st     = g.api.kvc_region_map_ranges(b->region, missing[i].data(), missing[i].size());
            if (st != KVC_OK) {
                map_failed_locked(st, last_err(), wait);
                if (changed) {
                    log_lines_locked();
                }
                return false;
            }
            const uint64_t after = g.api.kvc_region_mapped_bytes(b->region);
            changed              = changed || after != before;
            if (g.debug) {
                LLAMA_LOG_INFO("kvcached: mapped %.2f -> %.2f MiB\n", before / MiB, after / MiB);
            }
        }
        b->whole_mapped = b->whole_mapped || anything;
    }
    if (any) {
        g.no_wait_until = 0;
    }
    g.last_error.clear();
    for (size_t s = 0; s < need.size(); ++s) {
        c->mapped[s] = std::max(c->mapped[s], need[s]);
    }
    if (changed) {
        log_lines_locked();
    }
    return true;
}

uint32_t keep_cells(const kv_cache * c, uint32_t used) {
    if (used == 0) {
        return 0;
    }
    const uint32_t pad = std::max<uint32_t>(c->info.n_pad, 1);
    return std::min<uint32_t>(c->info.kv_size, ((used + pad - 1) / pad) * pad);
}

// Unmap what the cells do not use; with no cell in use, everything (also a
// transposed V that is otherwise mapped whole). reg held, on the thread
// that owns the cache (or under the server lock).
void trim_locked(kv_cache * c) {
    state & g = S();
    if (daemon_away_locked()) {
        // nothing is unmapped while the daemon is away: the pages could not
        // come back until it returns; trimmed at the first batch after that
        g.trim_pending = true;
        return;
    }
    std::vector<uint32_t> keep(c->info.n_stream), to(c->info.n_stream);
    bool                  any   = false;
    bool                  empty = true;
    for (uint32_t s = 0; s < c->info.n_stream; ++s) {
        keep[s] = keep_cells(c, c->info.used_cells ? c->info.used_cells(s) : c->info.kv_size);
        to[s]   = c->info.kv_size;
        any     = any || keep[s] < c->mapped[s];
        empty   = empty && keep[s] == 0;
    }
    for (kv_buffer * b : c->bufs) {
        any = any || (empty && b->whole_mapped);
    }
    if (!any) {
        return;
    }
    bool changed = false;
    for (kv_buffer * b : c->bufs) {
        std::vector<kvc_range> ranges;
        cell_ranges(b, keep, to, ranges);
        const bool drop_whole = empty && b->whole_mapped;
        if (drop_whole) {
            for (const auto & t : b->tensors) {
                if (t.whole) {
                    ranges.push_back({ t.offset, t.extent });
                }
            }
        }
        if (ranges.empty()) {
            continue;
        }
        merge_ranges(ranges);
        const uint64_t before = g.api.kvc_region_mapped_bytes(b->region);
        kvc_status     st     = g.api.kvc_region_unmap_ranges(b->region, ranges.data(), ranges.size());
        if (st != KVC_OK) {
            LLAMA_LOG_WARN("kvcached: cannot give KV pages back (%s: %s)\n", status_name(st), last_err());
            return;
        }
        if (drop_whole) {
            b->whole_mapped = false;
        }
        const uint64_t after = g.api.kvc_region_mapped_bytes(b->region);
        changed              = changed || after != before;
        if (g.debug) {
            LLAMA_LOG_INFO("kvcached: trimmed %.2f -> %.2f MiB\n", before / MiB, after / MiB);
        }
    }
    for (uint32_t s = 0; s < c->info.n_stream; ++s) {
        c->mapped[s] = std::min(c->mapped[s], keep[s]);
    }
    if (changed) {
        log_lines_locked();
    }
}

void trim_all_locked() {
    for (auto & [_, c] : S().caches) {
        trim_locked(c);
    }
}

// ---- reclaim -----------------------------------------------------------------

// The answer to a reclaim request: what went back at once and what is kept.
// Logged, and sent to the daemon (an ANSWER record through
// kvc_session_answer_reclaim, C API 1.3) so the request is settled at once:
// `kvcachedctl shrink` prints it and a waiting Allocate asks the next
// session instead of waiting for pages that will not come.
void answer_reclaim(const std::string & reason, uint64_t id, uint64_t asked, uint64_t given, uint64_t kept,
                    const char * why) {
    state & g = S();
    LLAMA_LOG_INFO("kvcached: reclaim (%s): asked %.2f MiB, gave back %.2f MiB at once, keeping %.2f MiB%s%s\n",
                   reason.c_str(), asked / MiB, given / MiB, kept / MiB, why && *why ? ": " : "", why ? why : "");
    if (!id || !g.api.kvc_session_answer_reclaim) {
        return;  // a client before API 1.3: the daemon sees the Frees only
    }
    kvc_session * s;
    {
        std::lock_guard<std::mutex> lk(g.reg);
        s = g.lost ? nullptr : g.session;  // sessions are never freed while the process runs
    }
    if (!s) {
        return;
    }
    kvc_status st = g.api.kvc_session_answer_reclaim(s, id, given, kept, why ? why : "");
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("kvcached: could not send the reclaim answer to the daemon (%s: %s)\n", status_name(st),
                       last_err());
    }
}

// Answer the pending reclaim request. The server lock is held (the main loop
// is parked or is the caller), so cells and slots are stable.
void serve_reclaim_server_locked() {
    state & g = S();
    if (!g.reclaim_pending.exchange(false)) {
        return;
    }
    const uint64_t asked = g.reclaim_bytes.exchange(0);
    const uint64_t id    = g.reclaim_id.exchange(0);
    std::string    reason;
    {
        std::lock_guard<std::mutex> t(g.tmu);
        reason = g.reclaim_reason;
    }
    uint64_t before, now;
    {
        std::lock_guard<std::mutex> lk(g.reg);
        before = held_locked();
        trim_all_locked();
        now = held_locked();
    }
    if (before - now < asked && g.idle_release) {
        // idle slots: the server clears them (their seq_rm trims through the guard)
        g.idle_release(g.idle_user, asked - (before - now));
        std::lock_guard<std::mutex> lk(g.reg);
        now = held_locked();
    }
    const uint64_t given = before - std::min(before, now);
    answer_reclaim(reason, id, asked, given, now,
                   given >= asked ? "" : "the rest is in use by busy slots (or is not elastic: V without flash attention)");
}

void on_reclaim(void * /*user*/, const kvc_reclaim * rq) {
    // The client's Watch thread: never block here. The hook's thread (or the
    // server's main loop, whichever comes first) answers.
    state & g = S();
    {
        std::lock_guard<std::mutex> t(g.tmu);
        g.reclaim_reason = rq->reason ? rq->reason : "";
    }
    if (g.api.kvc_session_answer_reclaim) {  // API 1.3: rq->id exists
        g.reclaim_id = rq->id;
    }
    uint64_t cur = g.reclaim_bytes.load();
    while (cur < rq->bytes && !g.reclaim_bytes.compare_exchange_weak(cur, rq->bytes)) {
    }
    g.reclaim_pending = true;
    wake_thread();
}

// The hook's own thread: answers reclaim requests, logs deferred KV lines,
// notices daemon loss and reconnects.
void thread_main() {
    state & g = S();
    for (;;) {
        {
            std::unique_lock<std::mutex> t(g.tmu);
            g.tcv.wait_for(t, std::chrono::milliseconds(200));
            if (g.stop) {
                g.exited = true;
                g.tcv.notify_all();
                return;
            }
        }
        if (g.reclaim_pending.load()) {
            std::unique_lock<std::recursive_mutex> server(g.server);  // waits for the main loop to park
            if (g.idle_release) {
                serve_reclaim_server_locked();
            } else {
                server.unlock();
                // no server lock: the cells may be changing on another
                // thread; the next batch or seq_rm on the cache's own thread trims
                g.reclaim_pending = false;
                const uint64_t asked = g.reclaim_bytes.exchange(0);
                g.reclaim_id         = 0;  // not answered: the Frees at the next batch settle it
                g.trim_pending       = true;
                std::string reason;
                {
                    std::lock_guard<std::mutex> t(g.tmu);
                    reason = g.reclaim_reason;
                }
                LLAMA_LOG_INFO("kvcached: reclaim (%s): asked %.2f MiB; this program trims at its next batch\n",
                               reason.c_str(), asked / MiB);
            }
        }
        bool lost;
        {
            std::lock_guard<std::mutex> lk(g.reg);
            check_session_locked();
            if (g.lines_pending) {
                log_lines_locked();
            }
            lost = g.lost;
        }
        if (lost) {
            try_reconnect();
        }
    }
}

kv_cache * cache_of(const void * owner) {
    auto it = S().caches.find(owner);
    return it == S().caches.end() ? nullptr : it->second;
}

}  // namespace
}  // namespace llama_kvcached_impl

using namespace llama_kvcached_impl;

ggml_backend_buffer_t llama_kvcached_alloc_kv(ggml_context * ctx, ggml_backend_buffer_type_t buft,
                                              const llama_kvcached_cache_info & info) {
    state &                      g = S();
    std::unique_lock<std::mutex> lk(g.reg);
    kvc_session *                s = session_locked();
    if (!s || g.lost) {
        lk.unlock();
        return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    }
    const client_api & a         = g.api;
    const bool host_buft  = ggml_backend_buft_is_host(buft);
    const bool host_pages = g.kind == "host";
    if (host_buft != host_pages) {
        LLAMA_LOG_WARN("%s: kvcached: %s buffer but the daemon lends %s pages; this KV buffer in ordinary memory\n",
                       __func__, ggml_backend_buft_name(buft), g.kind.c_str());
        lk.unlock();
        return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    }

    std::vector<ggml_tensor *> ts;
    std::vector<uint64_t>      sizes, offs;
    uint64_t                   total = 0;
    if (!build_layout(ctx, buft, info, ts, sizes, offs, total)) {
        LLAMA_LOG_WARN("%s: kvcached: unexpected KV layout; this KV buffer in ordinary memory\n", __func__);
        lk.unlock();
        return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    }

    kvc_region * region = nullptr;
    kvc_status   st     = a.kvc_region_create(s, total, &region);
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("%s: kvcached: cannot reserve %.2f MiB (%s: %s); this KV buffer in ordinary memory\n", __func__,
                       total / MiB, status_name(st), last_err());
        lk.unlock();
        return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    }
    char * base = (char *) a.kvc_region_base(region);

    auto * b   = new kv_buffer();
    b->region  = region;
    b->dev_ptr = base;
    b->host    = host_buft;

    ggml_backend_buffer_t buf = nullptr;
    if (host_buft) {
        // CPU: wrap the reservation; keep the CPU buffer's own functions
        // (base, get/set/cpy are memcpy) and the caller's buffer type (so the
        // scheduler and the "CPU KV buffer" log line are unchanged); replace
        // what must not touch unmapped pages and what owns the region.
        buf                      = ggml_backend_cpu_buffer_from_ptr(base, total);
        buf->buft                = buft;
        buf->iface.free_buffer   = buf_free;
        buf->iface.clear         = buf_clear;
        buf->iface.memset_tensor = buf_memset_tensor;
    } else {
        // Device (CUDA): keep the device's buffer type (ggml-cuda recognises
        // its buffers by the type's functions) and replace only the buffer's
        // function table. Tested against the test driver only
        // (docs/llama-cpp.md).
        const char * dn = ggml_backend_buft_name(buft);
        while (*dn && (*dn < '0' || *dn > '9')) {
            ++dn;
        }
        b->device                   = atoi(dn);
        ggml_backend_buffer_i iface = {};
        iface.free_buffer           = buf_free;
        iface.get_base              = dev_get_base;
        iface.init_tensor           = nullptr;
        iface.memset_tensor         = buf_memset_tensor;
        iface.set_tensor            = dev_set_tensor;
        iface.get_tensor            = dev_get_tensor;
        iface.cpy_tensor            = dev_cpy_tensor;
        iface.clear                 = buf_clear;
        iface.reset                 = nullptr;
        buf                         = ggml_backend_buffer_init(buft, iface, b, total);
    }
    b->buf  = buf;
    b->name = ggml_backend_buffer_name(buf);

    for (size_t i = 0; i < ts.size(); ++i) {
        ggml_tensor * t = ts[i];
        if (ggml_backend_tensor_alloc(buf, t, base + offs[i]) != GGML_STATUS_SUCCESS) {
            GGML_ABORT("kvcached: cannot place %s", t->name);
        }
        const bool     whole  = info.v_trans && info.is_v && info.is_v(t);
        const uint64_t extent = (i + 1 < ts.size() ? offs[i + 1] : total) - offs[i];
        b->tensors.push_back({ offs[i], (uint64_t) t->nb[1], (uint64_t) t->nb[2], ggml_nbytes(t), extent, whole });
    }
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (t->view_src && !t->data) {
            if (ggml_backend_view_init(t) != GGML_STATUS_SUCCESS) {
                GGML_ABORT("kvcached: cannot init view %s", t->name);
            }
        }
    }

    kv_cache * c = cache_of(info.owner);
    if (!c) {
        c       = new kv_cache();
        c->info = info;
        c->mapped.assign(info.n_stream, 0);
        g.caches[info.owner] = c;
    }
    b->cache = c;
    c->bufs.push_back(b);
    g.buffers[buf] = b;
    g.lines[b->name];  // the constructor's own line says 0.00 for it

    size_t n_whole = 0;
    for (const auto & t : b->tensors) {
        n_whole += t.whole;
    }
    LLAMA_LOG_INFO("%s: kvcached: %s KV buffer reserved %.2f MiB in daemon pages (%zu tensors packed as stock, %u cells x %u "
                   "streams, %s)\n",
                   __func__, b->name.c_str(), total / MiB, ts.size(), info.kv_size, info.n_stream,
                   n_whole ? "V transposed: V mapped whole while any cell is used, K elastic (use flash attention "
                             "for elastic V)"
                           : "K and V elastic");
    return buf;
}

size_t llama_kvcached_buffer_size(ggml_backend_buffer_t buf) {
    if (kv_buffer * b = lookup(buf)) {
        return S().api.kvc_region_mapped_bytes(b->region);
    }
    return ggml_backend_buffer_get_size(buf);
}

bool llama_kvcached_active(const void * owner) {
    std::lock_guard<std::mutex> lk(S().reg);
    return cache_of(owner) != nullptr;
}

bool llama_kvcached_map(const void * owner, const uint32_t * n_cells, uint32_t n_stream) {
    state &                     g = S();
    std::unique_lock<std::mutex> lk(g.reg);
    kv_cache *                  c = cache_of(owner);
    if (!c) {
        return true;
    }
    if (g.trim_pending.exchange(false)) {
        trim_all_locked();
    }
    if (!n_cells) {  // the batch failed before the hook (no slot): not the daemon's doing
        g.last_error.clear();
        return true;
    }
    std::vector<uint32_t> need(c->info.n_stream, 0);
    for (uint32_t s = 0; s < n_stream && s < c->info.n_stream; ++s) {
        need[s] = n_cells[s];
    }
    return map_locked(c, need, lk);
}

bool llama_kvcached_map_all(const void * owner) {
    state &                     g = S();
    std::unique_lock<std::mutex> lk(g.reg);
    kv_cache *                  c = cache_of(owner);
    if (!c) {
        return true;
    }
    if (!map_locked(c, std::vector<uint32_t>(c->info.n_stream, c->info.kv_size), lk)) {
        LLAMA_LOG_ERROR("kvcached: a K shift / stream copy reads the whole KV cache: %s\n", g.last_error.c_str());
        return false;
    }
    return true;
}

bool llama_kvcached_map_used(const void * owner) {
    state &                     g = S();
    std::unique_lock<std::mutex> lk(g.reg);
    kv_cache *                  c = cache_of(owner);
    if (!c) {
        return true;
    }
    std::vector<uint32_t> need(c->info.n_stream);
    for (uint32_t s = 0; s < c->info.n_stream; ++s) {
        need[s] = keep_cells(c, c->info.used_cells ? c->info.used_cells(s) : c->info.kv_size);
    }
    return map_locked(c, need, lk);
}

void llama_kvcached_trim(const void * owner) {
    state &                     g = S();
    std::lock_guard<std::mutex> lk(g.reg);
    kv_cache *                  c = cache_of(owner);
    if (!c) {
        return;
    }
    if (g.trim_pending.exchange(false)) {
        trim_all_locked();
    } else {
        trim_locked(c);
    }
}

extern "C" {

void llama_kvcached_lock(void) {
    S().server.lock();
}

void llama_kvcached_unlock(void) {
    S().server.unlock();
}

void llama_kvcached_set_idle_release(void (*fn)(void *, uint64_t), void * user) {
    std::lock_guard<std::recursive_mutex> server(S().server);
    S().idle_release = fn;
    S().idle_user    = user;
}

uint64_t llama_kvcached_held_bytes(void) {
    std::lock_guard<std::mutex> lk(S().reg);
    if (S().m != mode::on) {
        return 0;
    }
    return held_locked();
}

void llama_kvcached_poll(void) {
    if (S().reclaim_pending.load()) {
        std::lock_guard<std::recursive_mutex> server(S().server);  // the caller holds it: recursive
        serve_reclaim_server_locked();
    }
}

const char * llama_kvcached_decode_error(const char * fallback) {
    thread_local std::string out;
    std::lock_guard<std::mutex> lk(S().reg);
    if (S().last_error.empty()) {
        return fallback;
    }
    out = S().last_error;
    return out.c_str();
}

}  // extern "C"

#else  // !LLAMA_KVCACHED: built without the C client, every call is a pass-through

#include "llama-impl.h"

#include <cstdlib>
#include <mutex>

ggml_backend_buffer_t llama_kvcached_alloc_kv(ggml_context * ctx, ggml_backend_buffer_type_t buft,
                                              const llama_kvcached_cache_info & /*info*/) {
    static std::once_flag once;
    std::call_once(once, [] {
        const char * v = getenv("OLLAMA_KVCACHED_SOCKET");
        if (!v || !*v) {
            v = getenv("KVCACHED_SOCKET");
        }
        if (v && *v) {
            LLAMA_LOG_WARN("kvcached: the daemon socket is set (%s) but this llama.cpp was built without the kvcached "
                           "C client (find_package(kvcached) found none at configure time); KV cache in ordinary "
                           "memory\n",
                           v);
        }
    });
    return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
}

size_t llama_kvcached_buffer_size(ggml_backend_buffer_t buf) {
    return ggml_backend_buffer_get_size(buf);
}

bool llama_kvcached_active(const void *) {
    return false;
}

bool llama_kvcached_map(const void *, const uint32_t *, uint32_t) {
    return true;
}

bool llama_kvcached_map_all(const void *) {
    return true;
}

bool llama_kvcached_map_used(const void *) {
    return true;
}

void llama_kvcached_trim(const void *) {}

extern "C" {
void llama_kvcached_lock(void) {}

void llama_kvcached_unlock(void) {}

void llama_kvcached_set_idle_release(void (*)(void *, uint64_t), void *) {}

uint64_t llama_kvcached_held_bytes(void) {
    return 0;
}

void llama_kvcached_poll(void) {}

const char * llama_kvcached_decode_error(const char * fallback) {
    return fallback;
}
}  // extern "C"

#endif  // LLAMA_KVCACHED
#endif  // !OLLAMA_COMPAT_MTMD_BUILD
