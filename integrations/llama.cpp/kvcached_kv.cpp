// kvcached_kv.cpp: llama.cpp's KV cache in kvcached-serve pages (see
// kvcached_kv.h and docs/llama-cpp.md of kvcached-service).
//
// Built into libllama by integrations/llama.cpp/apply.py (src/kvcached_kv.cpp) or
// by Ollama's compat mechanism (llama/compat/*.cpp). Compiled to nothing for
// Ollama's mtmd target, to pass-throughs without the C client (LLAMA_KVCACHED
// undefined).
//
// One translation unit in parts, each owning its state (docs/llama-cpp.md,
// "The hook's parts"), included in this order:
//   kvcached_kv_client.inc   the C client found at run time; the settings
//   kvcached_kv_link.inc     the daemon session, its loss and return; locks
//   kvcached_kv_books.inc    the KV buffers: layout, ggml buffer, the KV line
//   kvcached_kv_cells.inc    cells to pages: map, trim, the decode policy
//   kvcached_kv_reclaim.inc  reclaim requests and the hook's thread
// This file holds the entry points llama.cpp calls (kvcached_kv.h).

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

#include "kvcached_kv_client.inc"
#include "kvcached_kv_link.inc"
#include "kvcached_kv_books.inc"
#include "kvcached_kv_cells.inc"
#include "kvcached_kv_reclaim.inc"

}  // namespace
}  // namespace llama_kvcached_impl

using namespace llama_kvcached_impl;

ggml_backend_buffer_t llama_kvcached_alloc_kv(ggml_context * ctx, ggml_backend_buffer_type_t buft,
                                              const llama_kvcached_cache_info & info) {
    hook_timer kvc_t(HC_ALLOC_KV);
    std::unique_lock<std::mutex> lk(L().reg);
    kvc_session *                s   = session_locked([&](uint64_t page, uint64_t & g, uint64_t & m) {
        plan_limits(ctx, buft, info, page, g, m);
    });
    ggml_backend_buffer_t        buf = s && !LINK().lost ? alloc_kv_locked(s, ctx, buft, info) : nullptr;
    if (buf && CFG().premap) {  // KVCACHED_PREMAP: the whole buffer now, as stock holds it
        kv_cache * c = cache_of(info.owner);
        if (!map_locked(c, std::vector<uint32_t>(c->info.n_stream, c->info.kv_size), lk)) {
            LLAMA_LOG_WARN("kvcached: KVCACHED_PREMAP: cannot map the whole KV buffer now (%s); mapped as the cells "
                           "need it\n",
                           POLICY().last_error.c_str());
        }
    }
    lk.unlock();
    return buf ? buf : ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
}

size_t llama_kvcached_buffer_size(ggml_backend_buffer_t buf) {
    hook_timer kvc_t(HC_BUFFER_SIZE);
    if (kv_buffer * b = lookup(buf)) {
        return API().kvc_region_mapped_bytes(b->region) + standby_of(b);  // physical: standby pages too
    }
    return ggml_backend_buffer_get_size(buf);
}

bool llama_kvcached_active(const void * owner) {
    hook_timer kvc_t(HC_ACTIVE);
    std::lock_guard<std::mutex> lk(L().reg);
    return cache_of(owner) != nullptr;
}

bool llama_kvcached_map(const void * owner, const uint32_t * n_cells, uint32_t n_stream) {
    hook_timer kvc_t(HC_MAP);
    std::unique_lock<std::mutex> lk(L().reg);
    kv_cache *                   c = cache_of(owner);
    if (!c) {
        return true;
    }
    trim_owed_locked();
    if (!n_cells) {  // the batch failed before the hook (no slot): not the daemon's doing
        POLICY().last_error.clear();
        return true;
    }
    std::vector<uint32_t> need(c->info.n_stream, 0);
    for (uint32_t s = 0; s < n_stream && s < c->info.n_stream; ++s) {
        need[s] = n_cells[s];
    }
    return map_locked(c, need, lk);
}

bool llama_kvcached_map_all(const void * owner) {
    hook_timer kvc_t(HC_MAP_ALL);
    std::unique_lock<std::mutex> lk(L().reg);
    kv_cache *                   c = cache_of(owner);
    if (!c) {
        return true;
    }
    if (!map_locked(c, std::vector<uint32_t>(c->info.n_stream, c->info.kv_size), lk)) {
        LLAMA_LOG_ERROR("kvcached: a K shift / stream copy reads the whole KV cache: %s\n", POLICY().last_error.c_str());
        return false;
    }
    return true;
}

bool llama_kvcached_map_used(const void * owner) {
    hook_timer kvc_t(HC_MAP_USED);
    std::unique_lock<std::mutex> lk(L().reg);
    kv_cache *                   c = cache_of(owner);
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
    hook_timer kvc_t(HC_TRIM);
    std::lock_guard<std::mutex> lk(L().reg);
    kv_cache *                  c = cache_of(owner);
    if (!c) {
        return;
    }
    // seq_rm / clear: a new prompt trims the old one's cells to standby just before its batch maps
    // them again; the idle clock starts here too, so the hook's thread never gives that standby back
    // in between (KVCACHED_STANDBY_IDLE_MS)
    POLICY().last_batch = now_ms();
    if (!trim_owed_locked()) {
        trim_locked(c);
    }
}

extern "C" {

void llama_kvcached_lock(void) {
    hook_timer kvc_t(HC_LOCK);
    L().server.lock();
}

void llama_kvcached_unlock(void) {
    hook_timer kvc_t(HC_UNLOCK);
    L().server.unlock();
}

void llama_kvcached_set_idle_release(void (*fn)(void *, uint64_t), void * user) {
    hook_timer kvc_t(HC_SET_IDLE_RELEASE);
    std::lock_guard<std::recursive_mutex> server(L().server);
    RECLAIM().idle_release = fn;
    RECLAIM().idle_user    = user;
}

uint64_t llama_kvcached_held_bytes(void) {
    hook_timer kvc_t(HC_HELD_BYTES);
    std::lock_guard<std::mutex> lk(L().reg);
    if (LINK().m != mode::on) {
        return 0;
    }
    return held_locked();
}

void llama_kvcached_poll(void) {
    hook_timer kvc_t(HC_POLL);
    if (RECLAIM().pending.load()) {
        std::lock_guard<std::recursive_mutex> server(L().server);  // the caller holds it: recursive
        serve_reclaim_server_locked();
    }
}

const char * llama_kvcached_decode_error(const char * fallback) {
    hook_timer kvc_t(HC_DECODE_ERROR);
    thread_local std::string    out;
    std::lock_guard<std::mutex> lk(L().reg);
    if (POLICY().last_error.empty()) {
        return fallback;
    }
    out = POLICY().last_error;
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
