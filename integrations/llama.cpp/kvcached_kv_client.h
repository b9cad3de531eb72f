// kvcached_kv_client.h: the C client found at run time, and the settings
// the environment gives the hook. Part of the hook (kvcached_kv.cpp holds
// its entry points; docs/llama-cpp.md, "The hook's parts").
//
// Owns: the function table (client_api) and the settings (settings), both
// fields of the hook's state (kvcached_kv_hook.h), written once, by
// session_locked() under the link's lock, before anything else reads them;
// and the entry points' counters (hook_stats, KVCACHED_HOOK_STATS).
#pragma once

#include <kvcached.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <cstdlib>
#include <utility>
#include <vector>

// the hook's own: not exported from libllama
#pragma GCC visibility push(hidden)

namespace llama_kvcached_impl {

constexpr double MiB = 1024.0 * 1024.0;

int64_t now_ms();

// printf into a std::string (at most 1023 characters)
std::string fmt(const char * f, ...) __attribute__((format(printf, 1, 2)));

// ---- KVCACHED_HOOK_STATS: every entry point counted and timed ------------
//
// With KVCACHED_HOOK_STATS=1 (read once, when the hook's state is made at
// the first entry, whether or not a daemon is set) each entry point of
// kvcached_kv.h and each function of a daemon KV buffer counts its calls and
// the time spent inside them (steady clock, per call; a call made from
// inside another is counted in both), and the process prints one line to
// stderr at exit: "kvcached: hook stats: calls N in T us; <entry> N / T us,
// ...". What the hook itself costs a generated token is that total over the
// tokens (tests/helpers/gpu_llama.py decode). Off: one load of a flag per
// entry.

enum hook_call {
    HC_ALLOC_KV, HC_BUFFER_SIZE, HC_ACTIVE, HC_MAP, HC_MAP_ALL, HC_MAP_USED, HC_TRIM, HC_LOCK, HC_UNLOCK,
    HC_SET_IDLE_RELEASE, HC_HELD_BYTES, HC_POLL, HC_DECODE_ERROR,
    HC_BUF_FREE, HC_BUF_CLEAR, HC_BUF_MEMSET_TENSOR, HC_BUF_SET_TENSOR, HC_BUF_GET_TENSOR, HC_BUF_CPY_TENSOR,
    HC_BUF_GET_BASE, HC_COUNT
};

struct hook_stats {
    bool                  on = false;  // KVCACHED_HOOK_STATS
    std::atomic<uint64_t> calls[HC_COUNT] = {};
    std::atomic<uint64_t> ns[HC_COUNT]    = {};
};

// Whether KVCACHED_HOOK_STATS asks for the counters.
bool stats_wanted();

// The line printed at exit.
void print_stats(const hook_stats & s);

// One call of entry `id`, counted and timed from here to the end of the scope.
struct hook_timer {
    hook_stats &                          stats;
    int                                   id;
    std::chrono::steady_clock::time_point t0;
    hook_timer(hook_stats & s, int i) : stats(s), id(s.on ? i : -1) {
        if (id >= 0) {
            t0 = std::chrono::steady_clock::now();
        }
    }
    ~hook_timer() {
        if (id >= 0) {
            const auto d = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
            stats.calls[id].fetch_add(1, std::memory_order_relaxed);
            stats.ns[id].fetch_add((uint64_t) d.count(), std::memory_order_relaxed);
        }
    }
    hook_timer(const hook_timer &)             = delete;
    hook_timer & operator=(const hook_timer &) = delete;
};

// ---- the function table ------------------------------------------------------
//
// The hook calls libkvcached through this table, filled from the symbols the
// program itself carries (llama-server links the self-contained static
// client, kvcached::kvcached_embed, and exports kvc_*) or else from
// libkvcached.so.1 (or $KVCACHED_CLIENT_LIBRARY). So libllama needs nothing
// at link time, and a program without the client runs as before.

#define LLAMA_KVCACHED_CLIENT_FUNCS(X)                                                                      \
    X(kvc_api_version) X(kvc_status_to_string) X(kvc_last_error) X(kvc_client_create) X(kvc_client_destroy) \
    X(kvc_client_set_timeout) X(kvc_client_device_count) X(kvc_client_device) X(kvc_session_options_init) X(kvc_session_open) X(kvc_session_close)          \
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
    // optional (API 1.5): local pages; without them KVCACHED_ON_DAEMON_LOSS=local acts as fail
    decltype(&::kvc_region_map_ranges_local)   kvc_region_map_ranges_local   = nullptr;
    decltype(&::kvc_region_unmap_ranges_local) kvc_region_unmap_ranges_local = nullptr;
    decltype(&::kvc_region_local_bytes)        kvc_region_local_bytes        = nullptr;
    // optional (API 1.7): standby pages; without them a trim gives every page back (KVCACHED_STANDBY_BYTES unused)
    decltype(&::kvc_region_unmap_ranges_standby) kvc_region_unmap_ranges_standby = nullptr;
    decltype(&::kvc_region_set_standby_limit)    kvc_region_set_standby_limit    = nullptr;
    decltype(&::kvc_region_standby_bytes)        kvc_region_standby_bytes        = nullptr;
    decltype(&::kvc_region_release_standby)      kvc_region_release_standby      = nullptr;
    std::string from;  // where the table came from, for the log
};

constexpr int NEED_API = 10200;  // 1.2: kvc_session_set_wait, kvc_region_rebind

const char * status_name(const client_api & a, kvc_status st);
const char * last_err(const client_api & a);

// Fill the table; false (logged) when the client is missing or too old.
bool load_api(client_api & a);

// ---- settings ----------------------------------------------------------------

// KVCACHED_STANDBY_BYTES's and KVCACHED_STANDBY_IDLE_MS's defaults (docs/llama-cpp.md, "Standby pages":
// measured). 256 MiB: one 2048-token request of an 8B f16 model (32 layers x 8 KV heads x 128 x 2 (K and
// V) x 2 bytes = 128 KiB per token); every standby page goes back once no batch ran for 1 s, so an idle
// process holds only what its cells use.
constexpr uint64_t DEFAULT_STANDBY_BYTES   = 256ull << 20;
constexpr uint32_t DEFAULT_STANDBY_IDLE_MS = 1000;

struct settings {
    std::string socket;
    // session options (ChildEnv of clients/go sets them)
    std::string                                      name, device;
    std::vector<std::pair<std::string, std::string>> labels;
    uint64_t                                         guaranteed = 0, max = 0;
    // given as bytes by the environment, or "auto": per model, at the first KV
    // buffer (unset: 0, no maximum and no guarantee, except in a router child,
    // where both are per model)
    bool guaranteed_set = false, max_set = false, guaranteed_auto = false, max_auto = false;
    int32_t                                          priority   = 0;
    // decode path policy
    uint32_t wait_ms        = 1000;  // KVCACHED_WAIT_MS: one Allocate waits at most this
    uint32_t fail_fast_ms   = 2000;  // KVCACHED_FAIL_FAST_MS: after a refusal, no waiting this long
    uint32_t wait_daemon_ms = 5000;  // KVCACHED_WAIT_DAEMON_MS: a batch that needs new pages while the daemon is away waits this long for it
    bool     loss_local     = true;  // KVCACHED_ON_DAEMON_LOSS: local (the default) or fail, after that wait
    uint32_t load_wait_ms   = 5000;  // KVCACHED_LOAD_WAIT_MS: at load, wait this long for a daemon that does not answer (default: wait_daemon_ms)
    bool     premap         = false; // KVCACHED_PREMAP=1: every page mapped when the buffer is made, never trimmed
    // KVCACHED_STANDBY_BYTES: a trim keeps up to this many bytes (per process, split over its KV buffers
    // by size) mapped as standby pages (C API 1.7), so a slot that grows again maps nothing new; 0: off
    uint64_t standby         = DEFAULT_STANDBY_BYTES;
    // KVCACHED_STANDBY_IDLE_MS: once no batch ran (and no seq_rm trimmed) for this long the hook's thread
    // gives every standby page back (an idle process holds what its cells use); 0: never on idle (a reclaim
    // still takes them)
    uint32_t standby_idle_ms = DEFAULT_STANDBY_IDLE_MS;
    bool     debug           = false;
};

// Reads the environment into c; false (with a logged error naming the
// variable) if something is malformed.
bool read_env(settings & c);

}  // namespace llama_kvcached_impl

#pragma GCC visibility pop
