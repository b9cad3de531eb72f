// kvcached_kv.h: llama.cpp's KV cache in kvcached-serve pages.
//
// Part of kvcached-service (integrations/llama.cpp, docs/llama-cpp.md).
// integrations/llama.cpp/apply.py puts this file and kvcached_kv.cpp into a
// llama.cpp build, either copied into the tree as src/kvcached_kv.{h,cpp} or, in
// Ollama's compat form, beside Ollama's own llama/compat/*.cpp, and inserts
// the calls below at named anchor points of src/llama-kv-cache.cpp and
// tools/server/server-context.cpp.
//
// Three ways this compiles:
//   - LLAMA_KVCACHED undefined (the C client was not found at configure
//     time): every function is a pass-through, llama.cpp allocates exactly
//     as before.
//   - LLAMA_KVCACHED defined: the hook is built in. It reaches the C client
//     (libkvcached, API 1.2+) at run time: the functions linked into the
//     program (llama-server links the self-contained static client) or else
//     libkvcached.so.1. When OLLAMA_KVCACHED_SOCKET (or KVCACHED_SOCKET) is
//     set and the daemon answers, every KV buffer of a llama_kv_cache
//     becomes one kvc_region of the process's daemon session: its K/V
//     tensors sit back to back in one reservation, as stock lays them out
//     (so it never holds more than the stock buffer, rounded up to one
//     page), and only the pages the cells use are backed by daemon pages. Without the variable, or when
//     no C client or daemon is there, the calls are pass-throughs.
//   - OLLAMA_COMPAT_MTMD_BUILD defined (Ollama also compiles llama/compat/
//     *.cpp into libmtmd): kvcached_kv.cpp compiles to nothing.
#pragma once

#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <functional>

#if defined(_WIN32)
#    define LLAMA_KVCACHED_API
#else
#    define LLAMA_KVCACHED_API __attribute__((visibility("default")))
#endif

// What the hook needs to know about one llama_kv_cache. Built in the cache's
// constructor (the lambdas capture `this` and so may read its private cells).
struct llama_kvcached_cache_info {
    const void * owner    = nullptr; // the llama_kv_cache (registry key)
    uint32_t     kv_size  = 0;       // cells per stream
    uint32_t     n_stream = 1;
    uint32_t     n_pad    = 256;     // n_kv is padded to this (get_n_kv)
    bool         v_trans  = true;    // V stored transposed (no flash attention)
    std::function<bool(const ggml_tensor *)> is_v;      // V tensor of a layer?
    std::function<uint32_t(uint32_t)>        used_cells; // used_max_p1 of a stream
};

// Drop-in for ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft) in the
// constructor. With the daemon: one region, tensors packed as stock packs
// them, nothing mapped yet. Without it: exactly ggml_backend_alloc_ctx_tensors_from_buft.
ggml_backend_buffer_t llama_kvcached_alloc_kv(ggml_context * ctx, ggml_backend_buffer_type_t buft,
                                              const llama_kvcached_cache_info & info);

// Physical bytes of a KV buffer: pages mapped for a daemon buffer,
// ggml_backend_buffer_get_size() for any other buffer.
size_t llama_kvcached_buffer_size(ggml_backend_buffer_t buf);

// Whether the cache `owner` lives in daemon pages.
bool llama_kvcached_active(const void * owner);

// Back cells [0, n_cells[s]) of stream s of every K tensor (and V tensor,
// with flash attention) with pages: one Allocate for everything missing.
// false when the daemon cannot lend them in time (the batch then fails the
// way a full cache does; llama_kvcached_decode_error says why).
bool llama_kvcached_map(const void * owner, const uint32_t * n_cells, uint32_t n_stream);

// Back every cell (K shift and stream copies read whole tensors).
bool llama_kvcached_map_all(const void * owner);

// Back what the cells use now (state restore writes cells directly).
bool llama_kvcached_map_used(const void * owner);

// Give back pages past what the cells use (rounded up to n_pad cells), and
// every page when the cache holds no cell.
void llama_kvcached_trim(const void * owner);

// Trims when the enclosing scope ends (seq_rm, seq_keep, clear: every
// return path).
struct llama_kvcached_trim_on_exit {
    const void * owner;
    explicit llama_kvcached_trim_on_exit(const void * o) : owner(o) {}
    ~llama_kvcached_trim_on_exit() { llama_kvcached_trim(owner); }
    llama_kvcached_trim_on_exit(const llama_kvcached_trim_on_exit &) = delete;
    llama_kvcached_trim_on_exit & operator=(const llama_kvcached_trim_on_exit &) = delete;
};

// For the server (C linkage so the server can declare them without this
// header). The daemon's reclaim requests arrive on the C client's Watch
// thread; the hook answers them from its own thread (or from the server's
// main loop, llama_kvcached_poll), never blocking the Watch thread. A server
// that registers an idle-release function and holds llama_kvcached_lock()
// whenever its main loop touches slots lets the hook release idle slots
// safely at any time, also while the server waits for requests.
extern "C" {
// Recursive, process-wide.
LLAMA_KVCACHED_API void llama_kvcached_lock(void);
LLAMA_KVCACHED_API void llama_kvcached_unlock(void);
// fn(user, bytes): drop idle sequences (least recently used first) until
// about `bytes` were given back; called with the lock held.
LLAMA_KVCACHED_API void llama_kvcached_set_idle_release(void (*fn)(void * user, uint64_t bytes), void * user);
// Bytes of daemon pages mapped by all KV buffers of this process.
LLAMA_KVCACHED_API uint64_t llama_kvcached_held_bytes(void);
// Called by the server's main loop with the lock held, before each round of
// slot updates: answers a pending reclaim request at once.
LLAMA_KVCACHED_API void llama_kvcached_poll(void);
// The error for a batch that did not fit: the hook's message when the last
// batch failed because the daemon could not lend memory (budget spent,
// daemon gone), else `fallback` (llama.cpp's own "context size exceeded").
// Valid until the calling thread's next call.
LLAMA_KVCACHED_API const char * llama_kvcached_decode_error(const char * fallback);
}
