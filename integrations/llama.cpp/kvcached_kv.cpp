// kvcached_kv.cpp: llama.cpp's KV cache in kvcached-serve pages (see
// kvcached_kv.h and docs/llama-cpp.md of kvcached-service).
//
// Built into libllama by integrations/llama.cpp/apply.py (src/kvcached_kv.cpp) or
// by Ollama's compat mechanism (llama/compat/*.cpp). Compiled to nothing for
// Ollama's mtmd target, to pass-throughs without the C client (LLAMA_KVCACHED
// undefined).
//
// This file holds the entry points: what llama.cpp calls (kvcached_kv.h),
// what ggml calls of a daemon KV buffer, and the atexit handlers. They make
// the hook's state (kvcached_kv_hook.h), one object per process, and hand it
// to the parts, each a translation unit of its own that owns one concern
// (docs/llama-cpp.md, "The hook's parts"):
//   kvcached_kv_client.{h,cpp}   the C client found at run time; the settings
//   kvcached_kv_link.{h,cpp}     the daemon session, its loss and return; locks
//   kvcached_kv_books.{h,cpp}    the KV buffers: layout, ggml buffer, the KV line
//   kvcached_kv_cells.{h,cpp}    cells to pages: map, trim, the decode policy
//   kvcached_kv_reclaim.{h,cpp}  reclaim requests and the hook's thread
// Only this file knows that there is one hook per process (the_hook()).

#if !defined(OLLAMA_COMPAT_MTMD_BUILD)

#include "kvcached_kv.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>

#if defined(LLAMA_KVCACHED)

#include "kvcached_kv_hook.h"

#include "ggml-backend-impl.h"
#include "llama-impl.h"

#include <mutex>
#include <string>
#include <vector>

using namespace llama_kvcached_impl;

namespace {

hook & the_hook();

// ggml's calls of a daemon KV buffer (kvcached_kv_books.h), and the atexit
// handlers: each finds the process's hook and hands it to the part.
void entry_buf_free(ggml_backend_buffer_t buf) {
    buf_free(the_hook(), buf);
}

void * entry_get_base(ggml_backend_buffer_t buf) {
    return dev_get_base(the_hook(), buf);
}

void entry_memset_tensor(ggml_backend_buffer_t buf, ggml_tensor * t, uint8_t value, size_t offset, size_t size) {
    buf_memset_tensor(the_hook(), buf, t, value, offset, size);
}

void entry_set_tensor(ggml_backend_buffer_t buf, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    buf_set_tensor(the_hook(), buf, t, data, offset, size);
}

void entry_get_tensor(ggml_backend_buffer_t buf, const ggml_tensor * t, void * data, size_t offset, size_t size) {
    dev_get_tensor(the_hook(), buf, t, data, offset, size);
}

bool entry_cpy_tensor(ggml_backend_buffer_t buf, const ggml_tensor * src, ggml_tensor * dst) {
    return dev_cpy_tensor(the_hook(), buf, src, dst);
}

void entry_clear(ggml_backend_buffer_t buf, uint8_t value) {
    buf_clear(the_hook(), buf, value);
}

void entry_stop_thread() {
    stop_thread(the_hook());
}

void entry_print_stats() {
    print_stats(the_hook().stats);
}

// The process's hook: the one object of the hook's state, and the only
// place that knows there is one per process. Made at the first entry, never
// destroyed (the hook's thread and the atexit handlers may run after static
// destruction).
hook & the_hook() {
    static hook * const h = new hook(hook_entries{
        buffer_entries{ entry_buf_free, entry_get_base, entry_memset_tensor, entry_set_tensor, entry_get_tensor,
                        entry_cpy_tensor, entry_clear },
        entry_stop_thread, entry_print_stats });
    return *h;
}

}  // namespace

ggml_backend_buffer_t llama_kvcached_alloc_kv(ggml_context * ctx, ggml_backend_buffer_type_t buft,
                                              const llama_kvcached_cache_info & info) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_ALLOC_KV);
    std::unique_lock<std::mutex> lk(h.locks.reg);
    kvc_session *                s   = session_locked(h, [&](uint64_t page, uint64_t & g, uint64_t & m) {
        plan_limits(ctx, buft, info, page, g, m);
    });
    ggml_backend_buffer_t        buf = s && !h.link.lost ? alloc_kv_locked(h, s, ctx, buft, info) : nullptr;
    if (buf && h.cfg.premap) {  // KVCACHED_PREMAP: the whole buffer now, as stock holds it
        kv_cache * c = cache_of(h, info.owner);
        if (!map_locked(h, c, std::vector<uint32_t>(c->info.n_stream, c->info.kv_size), lk)) {
            LLAMA_LOG_WARN("kvcached: KVCACHED_PREMAP: cannot map the whole KV buffer now (%s); mapped as the cells "
                           "need it\n",
                           h.policy.last_error.c_str());
        }
    }
    lk.unlock();
    return buf ? buf : ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
}

size_t llama_kvcached_buffer_size(ggml_backend_buffer_t buf) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_BUFFER_SIZE);
    if (kv_buffer * b = lookup(h, buf)) {
        return h.api.kvc_region_mapped_bytes(b->region) + standby_of(h, b);  // physical: standby pages too
    }
    return ggml_backend_buffer_get_size(buf);
}

bool llama_kvcached_active(const void * owner) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_ACTIVE);
    std::lock_guard<std::mutex> lk(h.locks.reg);
    return cache_of(h, owner) != nullptr;
}

bool llama_kvcached_map(const void * owner, const uint32_t * n_cells, uint32_t n_stream) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_MAP);
    std::unique_lock<std::mutex> lk(h.locks.reg);
    kv_cache *                   c = cache_of(h, owner);
    if (!c) {
        return true;
    }
    trim_owed_locked(h);
    if (!n_cells) {  // the batch failed before the hook (no slot): not the daemon's doing
        h.policy.last_error.clear();
        return true;
    }
    std::vector<uint32_t> need(c->info.n_stream, 0);
    for (uint32_t s = 0; s < n_stream && s < c->info.n_stream; ++s) {
        need[s] = n_cells[s];
    }
    return map_locked(h, c, need, lk);
}

bool llama_kvcached_map_all(const void * owner) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_MAP_ALL);
    std::unique_lock<std::mutex> lk(h.locks.reg);
    kv_cache *                   c = cache_of(h, owner);
    if (!c) {
        return true;
    }
    if (!map_locked(h, c, std::vector<uint32_t>(c->info.n_stream, c->info.kv_size), lk)) {
        LLAMA_LOG_ERROR("kvcached: a K shift / stream copy reads the whole KV cache: %s\n", h.policy.last_error.c_str());
        return false;
    }
    return true;
}

bool llama_kvcached_map_used(const void * owner) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_MAP_USED);
    std::unique_lock<std::mutex> lk(h.locks.reg);
    kv_cache *                   c = cache_of(h, owner);
    if (!c) {
        return true;
    }
    std::vector<uint32_t> need(c->info.n_stream);
    for (uint32_t s = 0; s < c->info.n_stream; ++s) {
        need[s] = keep_cells(c, c->info.used_cells ? c->info.used_cells(s) : c->info.kv_size);
    }
    return map_locked(h, c, need, lk);
}

void llama_kvcached_trim(const void * owner) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_TRIM);
    std::lock_guard<std::mutex> lk(h.locks.reg);
    kv_cache *                  c = cache_of(h, owner);
    if (!c) {
        return;
    }
    // seq_rm / clear: a new prompt trims the old one's cells to standby just before its batch maps
    // them again; the idle clock starts here too, so the hook's thread never gives that standby back
    // in between (KVCACHED_STANDBY_IDLE_MS)
    h.policy.last_batch = now_ms();
    if (!trim_owed_locked(h)) {
        trim_locked(h, c);
    }
}

extern "C" {

void llama_kvcached_lock(void) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_LOCK);
    h.locks.server.lock();
}

void llama_kvcached_unlock(void) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_UNLOCK);
    h.locks.server.unlock();
}

void llama_kvcached_set_idle_release(void (*fn)(void *, uint64_t), void * user) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_SET_IDLE_RELEASE);
    std::lock_guard<std::recursive_mutex> server(h.locks.server);
    h.reclaim.idle_release = fn;
    h.reclaim.idle_user    = user;
}

uint64_t llama_kvcached_held_bytes(void) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_HELD_BYTES);
    std::lock_guard<std::mutex> lk(h.locks.reg);
    if (h.link.m != mode::on) {
        return 0;
    }
    return held_locked(h);
}

void llama_kvcached_poll(void) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_POLL);
    if (h.reclaim.pending.load()) {
        std::lock_guard<std::recursive_mutex> server(h.locks.server);  // the caller holds it: recursive
        serve_reclaim_server_locked(h);
    }
}

const char * llama_kvcached_decode_error(const char * fallback) {
    hook & h = the_hook();
    hook_timer kvc_t(h.stats, HC_DECODE_ERROR);
    thread_local std::string    out;
    std::lock_guard<std::mutex> lk(h.locks.reg);
    if (h.policy.last_error.empty()) {
        return fallback;
    }
    out = h.policy.last_error;
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
