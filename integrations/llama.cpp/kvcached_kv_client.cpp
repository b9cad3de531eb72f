// kvcached_kv_client.cpp: the C client found at run time, and the settings
// the environment gives the hook (kvcached_kv_client.h).

#if !defined(OLLAMA_COMPAT_MTMD_BUILD) && defined(LLAMA_KVCACHED)

#include "kvcached_kv_client.h"

#include "llama-impl.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace llama_kvcached_impl {

int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

constexpr const char * HC_NAMES[HC_COUNT] = {
    "alloc_kv", "buffer_size", "active", "map", "map_all", "map_used", "trim", "lock", "unlock",
    "set_idle_release", "held_bytes", "poll", "decode_error",
    "buf_free", "buf_clear", "buf_memset_tensor", "buf_set_tensor", "buf_get_tensor", "buf_cpy_tensor",
    "buf_get_base",
};

void print_stats(const hook_stats & s) {
    uint64_t     n = 0, ns = 0;
    std::string  parts;
    for (int i = 0; i < HC_COUNT; ++i) {
        const uint64_t c = s.calls[i].load(std::memory_order_relaxed), t = s.ns[i].load(std::memory_order_relaxed);
        if (c) {
            n += c;
            ns += t;
            char one[96];
            snprintf(one, sizeof one, "%s%s %llu / %.1f us", parts.empty() ? "" : ", ", HC_NAMES[i],
                     (unsigned long long) c, t / 1e3);
            parts += one;
        }
    }
    fprintf(stderr, "kvcached: hook stats: calls %llu in %.1f us; %s\n", (unsigned long long) n, ns / 1e3,
            parts.c_str());
    fflush(stderr);
}

bool stats_wanted() {
    const char * v = getenv("KVCACHED_HOOK_STATS");
    return v && *v && strcmp(v, "0") != 0;
}

std::string fmt(const char * f, ...) {
    char    buf[1024];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

const char * status_name(const client_api & a, kvc_status st) {
    return a.kvc_status_to_string ? a.kvc_status_to_string(st) : "?";
}

const char * last_err(const client_api & a) {
    return a.kvc_last_error ? a.kvc_last_error() : "";
}

namespace {  // this file's own

// The program's own symbols first (h = RTLD_DEFAULT, which is a null
// pointer), else the shared library. False (logged) when there is neither.
bool client_library(client_api & a, void *& h) {
    h = RTLD_DEFAULT;
    if (dlsym(RTLD_DEFAULT, "kvc_api_version")) {
        a.from = "built into this program";
        return true;
    }
    const char * lib = getenv("KVCACHED_CLIENT_LIBRARY");
    if (!lib || !*lib) {
        lib = "libkvcached.so.1";
    }
    h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char * e = dlerror();
        LLAMA_LOG_WARN("kvcached: the daemon socket is set but this program has no kvcached C client (not linked in, "
                       "and %s: %s); KV cache in ordinary memory\n",
                       lib, e ? e : "not found");
        return false;
    }
    a.from = lib;
    return true;
}

}  // namespace

// Fill the table; false (logged) when the client is missing or too old.
bool load_api(client_api & a) {
    void *       h = nullptr;
    if (!client_library(a, h)) {
        return false;
    }
    bool ok = true;
#define LLAMA_KVCACHED_RESOLVE(name)                                                                    \
    a.name = reinterpret_cast<decltype(&::name)>(dlsym(h, #name));                                      \
    if (!a.name) {                                                                                      \
        LLAMA_LOG_WARN("kvcached: the C client (%s) lacks %s (needs API 1.2 or later); KV cache in "      \
                       "ordinary memory\n",                                                             \
                       a.from.c_str(), #name);                                                          \
        ok = false;                                                                                     \
    }
    LLAMA_KVCACHED_CLIENT_FUNCS(LLAMA_KVCACHED_RESOLVE)
#undef LLAMA_KVCACHED_RESOLVE
    if (ok && a.kvc_api_version() >= 10300) {  // kvc_reclaim.id exists from 1.3 on
        a.kvc_session_answer_reclaim =
            reinterpret_cast<decltype(&::kvc_session_answer_reclaim)>(dlsym(h, "kvc_session_answer_reclaim"));
    }
    if (ok && a.kvc_api_version() >= 10500) {
        a.kvc_region_map_ranges_local =
            reinterpret_cast<decltype(&::kvc_region_map_ranges_local)>(dlsym(h, "kvc_region_map_ranges_local"));
        a.kvc_region_unmap_ranges_local =
            reinterpret_cast<decltype(&::kvc_region_unmap_ranges_local)>(dlsym(h, "kvc_region_unmap_ranges_local"));
        a.kvc_region_local_bytes =
            reinterpret_cast<decltype(&::kvc_region_local_bytes)>(dlsym(h, "kvc_region_local_bytes"));
    }
    if (!a.kvc_region_map_ranges_local || !a.kvc_region_unmap_ranges_local || !a.kvc_region_local_bytes) {
        a.kvc_region_map_ranges_local   = nullptr;  // all three or none
        a.kvc_region_unmap_ranges_local = nullptr;
        a.kvc_region_local_bytes        = nullptr;
    }
    if (ok && a.kvc_api_version() >= 10700) {
        a.kvc_region_unmap_ranges_standby = reinterpret_cast<decltype(&::kvc_region_unmap_ranges_standby)>(
            dlsym(h, "kvc_region_unmap_ranges_standby"));
        a.kvc_region_set_standby_limit =
            reinterpret_cast<decltype(&::kvc_region_set_standby_limit)>(dlsym(h, "kvc_region_set_standby_limit"));
        a.kvc_region_standby_bytes =
            reinterpret_cast<decltype(&::kvc_region_standby_bytes)>(dlsym(h, "kvc_region_standby_bytes"));
        a.kvc_region_release_standby =
            reinterpret_cast<decltype(&::kvc_region_release_standby)>(dlsym(h, "kvc_region_release_standby"));
    }
    if (!a.kvc_region_unmap_ranges_standby || !a.kvc_region_set_standby_limit || !a.kvc_region_standby_bytes ||
        !a.kvc_region_release_standby) {
        a.kvc_region_unmap_ranges_standby = nullptr;  // all four or none
        a.kvc_region_set_standby_limit    = nullptr;
        a.kvc_region_standby_bytes        = nullptr;
        a.kvc_region_release_standby      = nullptr;
    }
    if (ok && (a.kvc_api_version() / 10000 != NEED_API / 10000 || a.kvc_api_version() < NEED_API)) {
        LLAMA_LOG_WARN("kvcached: the C client (%s) has API %d; the hook needs %d.x >= %d; KV cache in ordinary memory\n",
                       a.from.c_str(), a.kvc_api_version(), NEED_API / 10000, NEED_API);
        ok = false;
    }
    return ok;
}

// ---- settings ----------------------------------------------------------------

namespace {  // this file's own

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
    errno       = 0;
    char *    e = nullptr;
    long long x = strtoll(v, &e, 10);
    if (errno || *e || e == v || x < INT32_MIN || x > INT32_MAX) {
        return false;
    }
    out = (int32_t) x;
    return true;
}

bool env_bytes(const char * var, uint64_t & out) {
    const char * v = getenv(var);
    if (!v || !*v) {
        return true;
    }
    if (!parse_u64(v, out)) {
        LLAMA_LOG_ERROR("kvcached: %s=\"%s\" is not a byte count (decimal digits); KV cache in ordinary memory\n", var, v);
        return false;
    }
    return true;
}

// KVCACHED_GUARANTEED_BYTES / KVCACHED_MAX_BYTES: bytes, or "auto" (the
// model's own figure). `set`: the operator gave bytes (they always win).
bool env_limit(const char * var, uint64_t & out, bool & set, bool & is_auto) {
    const char * v = getenv(var);
    is_auto        = v && strcmp(v, "auto") == 0;
    set            = v && *v && !is_auto;
    return is_auto || env_bytes(var, out);
}

bool env_ms(const char * var, uint32_t & out) {
    uint64_t x = out;
    if (!env_bytes(var, x)) {
        return false;
    }
    if (x > 600000) {
        LLAMA_LOG_ERROR("kvcached: %s=%llu is more than 600000 ms; KV cache in ordinary memory\n", var,
                        (unsigned long long) x);
        return false;
    }
    out = (uint32_t) x;
    return true;
}

// KVCACHED_SESSION_LABELS: k=v,k=v (clients/go ChildEnv): keys non-empty, no ',' in values.
bool env_labels(settings & c) {
    const char * v = getenv("KVCACHED_SESSION_LABELS");
    if (!v || !*v) {
        return true;
    }
    std::string s  = v;
    size_t      at = 0;
    while (at <= s.size()) {
        size_t      comma = s.find(',', at);
        std::string kv    = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
        size_t      eq    = kv.find('=');
        if (eq == std::string::npos || eq == 0) {
            LLAMA_LOG_ERROR("kvcached: KVCACHED_SESSION_LABELS=\"%s\": \"%s\" is not key=value; KV cache in ordinary "
                            "memory\n",
                            v, kv.c_str());
            return false;
        }
        c.labels.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
        if (comma == std::string::npos) {
            break;
        }
        at = comma + 1;
    }
    return true;
}

// ---- the model this process serves (the session's default name) ------------
//
// llama-server's router (--models-dir) starts one child llama-server per
// model with `--alias NAME --model PATH` and the router's environment, so a
// child's session is named after its model: the first alias, else the model
// file's name without ".gguf". Read from the process's own arguments
// (/proc/self/cmdline; the last occurrence wins, as in llama.cpp's parser),
// else from LLAMA_ARG_ALIAS / LLAMA_ARG_MODEL (which the parser also reads).

std::vector<std::string> own_args() {
    std::vector<std::string> out;
    FILE *                   f = fopen("/proc/self/cmdline", "rb");
    if (!f) {
        return out;
    }
    std::string cur;
    for (int ch; (ch = fgetc(f)) != EOF;) {
        if (ch == 0) {
            out.push_back(cur);
            cur.clear();
        } else {
            cur += (char) ch;
        }
    }
    fclose(f);
    return out;
}

std::string arg_value(const std::vector<std::string> & args, const char * s, const char * l, const char * env) {
    std::string v;
    for (size_t i = 1; i < args.size(); ++i) {
        if ((args[i] == s || args[i] == l) && i + 1 < args.size()) {
            v = args[++i];
        } else if (args[i].rfind(std::string(l) + "=", 0) == 0) {
            v = args[i].substr(strlen(l) + 1);
        }
    }
    if (v.empty() && getenv(env)) {
        v = getenv(env);
    }
    return v;
}

// The model's name; empty when the process names none. At most 128
// printable ASCII characters (a session name's rule; others become '_').
std::string model_name() {
    const std::vector<std::string> args = own_args();
    std::string                    n    = arg_value(args, "-a", "--alias", "LLAMA_ARG_ALIAS");
    n                                   = n.substr(0, n.find(','));
    n.erase(0, n.find_first_not_of(' '));
    n.erase(n.find_last_not_of(' ') + 1);
    if (n.empty()) {
        n = arg_value(args, "-m", "--model", "LLAMA_ARG_MODEL");
        n = n.substr(n.find_last_of('/') + 1);
        if (n.size() > 5 && n.compare(n.size() - 5, 5, ".gguf") == 0) {
            n.resize(n.size() - 5);
        }
    }
    for (char & ch : n) {
        ch = (ch < 0x20 || ch > 0x7e) ? '_' : ch;
    }
    return n.substr(0, 128);
}

}  // namespace

bool read_env(settings & c) {
    if (!env_limit("KVCACHED_GUARANTEED_BYTES", c.guaranteed, c.guaranteed_set, c.guaranteed_auto) ||
        !env_limit("KVCACHED_MAX_BYTES", c.max, c.max_set, c.max_auto) ||
        !env_ms("KVCACHED_WAIT_MS", c.wait_ms) || !env_ms("KVCACHED_FAIL_FAST_MS", c.fail_fast_ms) ||
        !env_ms("KVCACHED_WAIT_DAEMON_MS", c.wait_daemon_ms) || !env_bytes("KVCACHED_STANDBY_BYTES", c.standby) ||
        !env_ms("KVCACHED_STANDBY_IDLE_MS", c.standby_idle_ms)) {
        return false;
    }
    c.load_wait_ms = c.wait_daemon_ms;  // unless KVCACHED_LOAD_WAIT_MS says otherwise
    if (!env_ms("KVCACHED_LOAD_WAIT_MS", c.load_wait_ms)) {
        return false;
    }
    // A child of llama-server's router (llama.cpp's own test, server_child::is_child)
    // gets its model's maximum and guarantee unless the operator gave them: every
    // child inherits the router's variables, so no one value fits them all.
    if (getenv("LLAMA_SERVER_ROUTER_PORT")) {
        c.max_auto        = c.max_auto || !c.max_set;
        c.guaranteed_auto = c.guaranteed_auto || !c.guaranteed_set;
    }
    if (const char * v = getenv("KVCACHED_ON_DAEMON_LOSS"); v && *v) {
        if (strcmp(v, "local") != 0 && strcmp(v, "fail") != 0) {
            LLAMA_LOG_ERROR("kvcached: KVCACHED_ON_DAEMON_LOSS=\"%s\" is neither local nor fail; KV cache in ordinary "
                            "memory\n",
                            v);
            return false;
        }
        c.loss_local = strcmp(v, "local") == 0;
    }
    if (const char * v = getenv("KVCACHED_PRIORITY"); v && *v && !parse_i32(v, c.priority)) {
        LLAMA_LOG_ERROR("kvcached: KVCACHED_PRIORITY=\"%s\" is not a 32-bit integer; KV cache in ordinary memory\n", v);
        return false;
    }
    if (const char * v = getenv("KVCACHED_SESSION_NAME"); v && *v) {
        c.name = v;
    } else if (c.name = model_name(); c.name.empty()) {
        c.name = std::string("llama.cpp pid ") + std::to_string((long) getpid());
    }
    if (!env_labels(c)) {
        return false;
    }
    if (const char * v = getenv("KVCACHED_DEVICE"); v && *v) {
        c.device = v;
    }
    c.debug  = getenv("KVCACHED_DEBUG") && strcmp(getenv("KVCACHED_DEBUG"), "0") != 0;
    c.premap = getenv("KVCACHED_PREMAP") && strcmp(getenv("KVCACHED_PREMAP"), "0") != 0;
    return true;
}

}  // namespace llama_kvcached_impl

#endif  // !OLLAMA_COMPAT_MTMD_BUILD && LLAMA_KVCACHED
