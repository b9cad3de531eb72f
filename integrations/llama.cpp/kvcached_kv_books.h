// kvcached_kv_books.h: the KV buffers in daemon pages: their layout, the
// ggml buffer they are, the books of this process's caches, and the "KV
// buffer size" line Ollama reads. Part of the hook (kvcached_kv_books.cpp).
//
// Owns: hook::books (every cache, buffer and logged line), under locks.reg.
#pragma once

#include "kvcached_kv.h"

#include "ggml-backend.h"

#include <kvcached.h>

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

// the hook's own: not exported from libllama
#pragma GCC visibility push(hidden)

namespace llama_kvcached_impl {

struct hook;

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
    uint64_t               reserved = 0;  // the reservation's bytes (its share of KVCACHED_STANDBY_BYTES)
};

struct kv_cache {
    llama_kvcached_cache_info info;
    std::vector<kv_buffer *>  bufs;
    std::vector<uint32_t>     mapped;  // cells backed per stream (at least)
    bool recheck = false;  // local pages under those cells were given back: the next batch looks at the pages
};

struct kv_line {
    uint64_t logged         = 0;  // bytes in the last "KV buffer size" line (in use and standby: held)
    uint64_t logged_standby = 0;  // the standby part in the last standby line
    int64_t  logged_at      = 0;  // when (ms)
};

struct books {
    std::unordered_map<const void *, kv_cache *>           caches;
    std::unordered_map<ggml_backend_buffer_t, kv_buffer *> buffers;
    std::map<std::string, kv_line>                         lines;
    bool                                                   lines_pending     = false;
    bool                                                   per_model_max_said = false;
};

// The functions of a daemon KV buffer that ggml calls (kvcached_kv.cpp
// defines them: they find the process's hook, then call the ones below).
struct buffer_entries {
    void (*free_buffer)(ggml_backend_buffer_t);
    void * (*get_base)(ggml_backend_buffer_t);
    void (*memset_tensor)(ggml_backend_buffer_t, ggml_tensor *, uint8_t, size_t, size_t);
    void (*set_tensor)(ggml_backend_buffer_t, ggml_tensor *, const void *, size_t, size_t);
    void (*get_tensor)(ggml_backend_buffer_t, const ggml_tensor *, void *, size_t, size_t);
    bool (*cpy_tensor)(ggml_backend_buffer_t, const ggml_tensor *, ggml_tensor *);
    void (*clear)(ggml_backend_buffer_t, uint8_t);
};

kv_cache * cache_of(hook & h, const void * owner);

// The books' buffer of buf (nullptr: not a daemon KV buffer). Takes reg.
kv_buffer * lookup(hook & h, ggml_backend_buffer_t buf);

// Standby bytes of one buffer (0 without API 1.7).
uint64_t standby_of(const hook & h, const kv_buffer * b);

// What this process holds: in use and standby (the daemon's held). reg held.
uint64_t held_locked(hook & h);

// The new session a reconnect opened takes over every KV buffer. reg held.
void rebind_buffers_locked(hook & h, kvc_session * s);

// One "KV buffer size" line per buffer name whose bytes changed. reg held.
void log_lines_locked(hook & h);

// The plan session_locked() asks for: this buffer's layout, for a page size.
void plan_limits(ggml_context * ctx, ggml_backend_buffer_type_t buft, const llama_kvcached_cache_info & info,
                 uint64_t page, uint64_t & g, uint64_t & m);

// The KV buffer of ctx's tensors in one region of session s, nothing mapped
// yet; nullptr (logged) when this buffer must stay in ordinary memory.
// reg held.
ggml_backend_buffer_t alloc_kv_locked(hook & h, kvc_session * s, ggml_context * ctx, ggml_backend_buffer_type_t buft,
                                      const llama_kvcached_cache_info & info);

// What ggml's calls of a daemon KV buffer do (buffer_entries).
void     buf_free(hook & h, ggml_backend_buffer_t buf);
void     buf_clear(hook & h, ggml_backend_buffer_t buf, uint8_t value);
void     buf_memset_tensor(hook & h, ggml_backend_buffer_t buf, ggml_tensor * t, uint8_t value, size_t offset,
                           size_t size);
void     buf_set_tensor(hook & h, ggml_backend_buffer_t buf, ggml_tensor * t, const void * data, size_t offset,
                        size_t size);
void *   dev_get_base(hook & h, ggml_backend_buffer_t buf);
void     dev_get_tensor(hook & h, ggml_backend_buffer_t buf, const ggml_tensor * t, void * data, size_t offset,
                        size_t size);
bool     dev_cpy_tensor(hook & h, ggml_backend_buffer_t buf, const ggml_tensor * src, ggml_tensor * dst);

}  // namespace llama_kvcached_impl

#pragma GCC visibility pop
