// kvcached_kv.cpp: llama.cpp's KV cache in kvcached-serve pages (see
// kvcached_kv.h and docs/llama-cpp.md). Part of kvcached-service; copied
// into a llama.cpp tree as src/kvcached/ by integrations/llama.cpp/apply.py.

#include "kvcached_kv.h"

#include "ggml-alloc.h"
#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "llama-impl.h"

#include <kvcached.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct kv_tensor {
    uint64_t offset;   // from the region base
    uint64_t row;      // bytes per cell (nb[1])
    uint64_t stride;   // bytes per stream (nb[2])
    uint64_t bytes;    // whole tensor
    bool     whole;    // map the whole tensor (transposed V)
};

struct kv_cache;

struct kv_buffer {
    // First two members mirror ggml-cuda's ggml_backend_cuda_buffer_context
    // {int device; void * dev_ptr;}: ggml-cuda recognises buffers of its
    // buffer type by the type's function pointers and may read these two.
    int                   device  = 0;
    void *                dev_ptr = nullptr;
    ggml_backend_buffer_t buf     = nullptr;
    kvc_region *          region  = nullptr;
    kv_cache *            cache   = nullptr;
    bool                  host    = true;
    bool                  whole_mapped = false;
    std::vector<kv_tensor> tensors;
};

struct kv_cache {
    llama_kvcached_cache_info info;
    std::vector<kv_buffer *>  bufs;
    std::vector<uint32_t>     mapped; // cells backed per stream (at least)
};

// Process-wide state. g_reg guards the registry and the regions' books;
// g_server is the recursive lock the patched server holds while its main
// loop works (llama_kvcached_lock).
std::mutex                                         g_reg;
std::recursive_mutex                               g_server;
bool                                               g_tried   = false;
kvc_client *                                       g_client  = nullptr;
kvc_session *                                      g_session = nullptr;
std::unordered_map<const void *, kv_cache *>       g_caches;
std::unordered_map<ggml_backend_buffer_t, kv_buffer *> g_buffers;
std::atomic<bool>                                  g_trim_pending{false};
void (*g_idle_release)(void *, uint64_t) = nullptr;
void *                                             g_idle_user = nullptr;
bool                                               g_debug   = false;

constexpr double MiB = 1024.0 * 1024.0;

uint64_t env_u64(const char * name, uint64_t def) {
    const char * v = getenv(name);
    if (!v || !*v) {
        return def;
    }
    char * end = nullptr;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v) {
        return def;
    }
    return (uint64_t) x;
}

uint64_t held_locked() {
    uint64_t n = 0;
    for (auto & [_, b] : g_buffers) {
        n += kvc_region_mapped_bytes(b->region);
    }
    return n;
}

void on_reclaim(void * /*user*/, const kvc_reclaim * rq);

// The daemon session of this process, opened on first use. nullptr when the
// variable is unset or the daemon cannot be reached (then llama.cpp
// allocates as before). Called with g_reg held.
kvc_session * session_locked() {
    if (g_tried) {
        return g_session;
    }
    g_tried = true;
    const char * sock = kvc_socket_from_env();
    if (!sock) {
        return nullptr;
    }
    g_debug = env_u64("KVCACHED_DEBUG", 0) != 0;
    kvc_status st = kvc_client_create(sock, &g_client);
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("%s: kvcached: cannot reach the daemon at %s (%s: %s); KV cache in ordinary memory\n",
                       __func__, sock, kvc_status_to_string(st), kvc_last_error());
        g_client = nullptr;
        return nullptr;
    }
    kvc_session_options o;
    kvc_session_options_init(&o);
    std::string name;
    if (const char * n = getenv("KVCACHED_SESSION_NAME")) {
        name = n;
    }
    if (name.empty()) {
        name = std::string("llama.cpp pid ") + std::to_string((long) getpid());
    }
    o.name            = name.c_str();
    o.device          = getenv("KVCACHED_DEVICE");
    o.wait            = 1;
    o.wait_timeout_ms = (uint32_t) env_u64("KVCACHED_WAIT_MS", 10000);
    o.priority        = (int32_t) env_u64("KVCACHED_PRIORITY", 0);
    st = kvc_session_open(g_client, &o, &g_session);
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("%s: kvcached: cannot open a session at %s (%s: %s); KV cache in ordinary memory\n",
                       __func__, sock, kvc_status_to_string(st), kvc_last_error());
        kvc_client_destroy(g_client);
        g_client  = nullptr;
        g_session = nullptr;
        return nullptr;
    }
    st = kvc_session_set_reclaim_callback(g_session, on_reclaim, nullptr);
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("%s: kvcached: no reclaim callback (%s: %s)\n", __func__, kvc_status_to_string(st),
                       kvc_last_error());
    }
    LLAMA_LOG_INFO("%s: kvcached: session %llu \"%s\" at %s (%s pages of %.2f MiB)\n", __func__,
                   (unsigned long long) kvc_session_id(g_session), name.c_str(), sock, kvc_session_kind(g_session),
                   kvc_session_page_size(g_session) / MiB);
    return g_session;
}

// ---- ggml buffer functions ---------------------------------------------

kv_buffer * lookup(ggml_backend_buffer_t buf) {
    std::lock_guard<std::mutex> lk(g_reg);
    auto it = g_buffers.find(buf);
    return it == g_buffers.end() ? nullptr : it->second;
}

void buf_free(ggml_backend_buffer_t buf) {
    kv_buffer * b = nullptr;
    {
        std::lock_guard<std::mutex> lk(g_reg);
        auto it = g_buffers.find(buf);
        if (it == g_buffers.end()) {
            return;
        }
        b = it->second;
        g_buffers.erase(it);
        if (b->cache) {
            auto & v = b->cache->bufs;
            v.erase(std::remove(v.begin(), v.end(), b), v.end());
            if (v.empty()) {
                g_caches.erase(b->cache->info.owner);
                delete b->cache;
            }
        }
    }
    kvc_region_destroy(b->region); // unmap, one Free, release the reservation
    delete b;
}

void buf_clear(ggml_backend_buffer_t buf, uint8_t value) {
    kv_buffer * b = lookup(buf);
    GGML_ASSERT(b);
    // mapped pages only: unmapped ones come back zeroed from the daemon
    kvc_status st = kvc_region_clear(b->region, value);
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: clear failed (%s: %s)", kvc_status_to_string(st), kvc_last_error());
    }
}

uint64_t tensor_offset(const kv_buffer * b, const ggml_tensor * t, size_t offset) {
    return (uint64_t) ((const char *) t->data - (const char *) kvc_region_base(b->region)) + offset;
}

void buf_memset_tensor(ggml_backend_buffer_t buf, ggml_tensor * t, uint8_t value, size_t offset, size_t size) {
    kv_buffer * b = lookup(buf);
    GGML_ASSERT(b);
    const uint64_t off = tensor_offset(b, t, offset);
    kvc_status     st  = KVC_OK;
    if (value != 0) {
        st = kvc_region_map(b->region, off, size); // a hole would read 0, not value
    }
    if (st == KVC_OK) {
        st = kvc_region_memset(b->region, off, size, value);
    }
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: memset failed (%s: %s)", kvc_status_to_string(st), kvc_last_error());
    }
}

// device buffers (CUDA): data moves through the client library, which uses
// the driver (cuMemcpyHtoD/DtoH, cuMemsetD8) on the region's device pointers
void * dev_get_base(ggml_backend_buffer_t buf) {
    return ((kv_buffer *) buf->context)->dev_ptr;
}

void dev_set_tensor(ggml_backend_buffer_t buf, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    kv_buffer * b  = (kv_buffer *) buf->context;
    kvc_status  st = kvc_region_write(b->region, tensor_offset(b, t, offset), data, size);
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: set_tensor failed (%s: %s)", kvc_status_to_string(st), kvc_last_error());
    }
}

void dev_get_tensor(ggml_backend_buffer_t buf, const ggml_tensor * t, void * data, size_t offset, size_t size) {
    kv_buffer * b  = (kv_buffer *) buf->context;
    kvc_status  st = kvc_region_read(b->region, tensor_offset(b, t, offset), data, size);
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: get_tensor failed (%s: %s)", kvc_status_to_string(st), kvc_last_error());
    }
}

bool dev_cpy_tensor(ggml_backend_buffer_t, const ggml_tensor *, ggml_tensor *) {
    return false; // ggml falls back to get + set
}

// ---- layout ---------------------------------------------------------------

bool build_layout(ggml_context * ctx, ggml_backend_buffer_type_t buft, const llama_kvcached_cache_info & info,
                  uint64_t page, std::vector<ggml_tensor *> & ts, std::vector<uint64_t> & offs, uint64_t & total) {
    std::vector<uint64_t> sizes;
    const size_t align = ggml_backend_buft_get_alignment(buft);
    if (align == 0 || page % align != 0) {
        LLAMA_LOG_WARN("%s: kvcached: buffer alignment %zu does not divide the page size %llu\n", __func__, align,
                       (unsigned long long) page);
        return false;
    }
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (t->view_src || t->data) {
            continue;
        }
        if (t->ne[1] != (int64_t) info.kv_size || t->ne[2] != (int64_t) info.n_stream || t->ne[3] != 1) {
            LLAMA_LOG_WARN("%s: kvcached: tensor %s is not [n_embd, %u, %u]\n", __func__, t->name, info.kv_size,
                           info.n_stream);
            return false;
        }
        ts.push_back(t);
        sizes.push_back(ggml_backend_buft_get_alloc_size(buft, t));
    }
    offs.resize(ts.size());
    if (ts.empty() || kvc_layout_page_aligned(page, sizes.data(), sizes.size(), offs.data(), &total) != KVC_OK) {
        return false;
    }
    return true;
}

// Ranges of cells [from[s], to[s]) of every elastic tensor of b.
void cell_ranges(const kv_buffer * b, const std::vector<uint32_t> & from, const std::vector<uint32_t> & to,
                 std::vector<kvc_range> & out) {
    for (const auto & t : b->tensors) {
        if (t.whole) {
            continue;
        }
        for (size_t s = 0; s < from.size(); ++s) {
            if (to[s] > from[s]) {
                out.push_back({ t.offset + s * t.stride + from[s] * t.row, (uint64_t) (to[s] - from[s]) * t.row });
            }
        }
    }
}

// Map cells [0, need[s]) of every stream (need[s] <= mapped[s] skipped).
// Called with g_reg held.
bool map_locked(kv_cache * c, const std::vector<uint32_t> & need_in) {
    std::vector<uint32_t> need = need_in;
    bool                  any  = false;
    for (size_t s = 0; s < need.size(); ++s) {
        need[s] = std::min(need[s], c->info.kv_size);
        any     = any || need[s] > c->mapped[s];
    }
    for (kv_buffer * b : c->bufs) {
        any = any || !b->whole_mapped;
    }
    if (!any) {
        return true;
    }
    for (kv_buffer * b : c->bufs) {
        std::vector<kvc_range> ranges;
        std::vector<uint32_t>  from(need.size(), 0);
        // ranges from 0 (map_ranges skips what is mapped): robust against
        // pages given back by a reclaim the books did not see
        cell_ranges(b, from, need, ranges);
        if (!b->whole_mapped) {
            for (const auto & t : b->tensors) {
                if (t.whole) {
                    ranges.push_back({ t.offset, t.bytes });
                }
            }
        }
        if (ranges.empty()) {
            continue;
        }
        const uint64_t before = kvc_region_mapped_bytes(b->region);
        kvc_status     st     = kvc_region_map_ranges(b->region, ranges.data(), ranges.size());
        if (st != KVC_OK) {
            LLAMA_LOG_ERROR("%s: kvcached: cannot back %zu KV ranges (%s: %s)\n", __func__, ranges.size(),
                            kvc_status_to_string(st), kvc_last_error());
            return false;
        }
        b->whole_mapped = true;
        if (g_debug) {
            LLAMA_LOG_INFO("%s: kvcached: mapped %.2f -> %.2f MiB\n", __func__, before / MiB,
                           kvc_region_mapped_bytes(b->region) / MiB);
        }
    }
    for (size_t s = 0; s < need.size(); ++s) {
        c->mapped[s] = std::max(c->mapped[s], need[s]);
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

// Unmap what the cells do not use. Called with g_reg held, on the thread
// that owns the cache (or under the server lock).
void trim_locked(kv_cache * c) {
    std::vector<uint32_t> keep(c->info.n_stream), to(c->info.n_stream);
    bool                  any = false;
    for (uint32_t s = 0; s < c->info.n_stream; ++s) {
        keep[s] = keep_cells(c, c->info.used_cells ? c->info.used_cells(s) : c->info.kv_size);
        to[s]   = c->info.kv_size;
        any     = any || keep[s] < c->mapped[s];
    }
    if (!any) {
        return;
    }
    for (kv_buffer * b : c->bufs) {
        std::vector<kvc_range> ranges;
        cell_ranges(b, keep, to, ranges);
        const uint64_t before = kvc_region_mapped_bytes(b->region);
        kvc_status     st     = kvc_region_unmap_ranges(b->region, ranges.data(), ranges.size());
        if (st != KVC_OK) {
            LLAMA_LOG_WARN("%s: kvcached: cannot give KV pages back (%s: %s)\n", __func__, kvc_status_to_string(st),
                           kvc_last_error());
            return;
        }
        if (g_debug) {
            LLAMA_LOG_INFO("%s: kvcached: trimmed %.2f -> %.2f MiB\n", __func__, before / MiB,
                           kvc_region_mapped_bytes(b->region) / MiB);
        }
    }
    for (uint32_t s = 0; s < c->info.n_stream; ++s) {
        c->mapped[s] = std::min(c->mapped[s], keep[s]);
    }
}

void trim_all_locked() {
    for (auto & [_, c] : g_caches) {
        trim_locked(c);
    }
}

void on_reclaim(void * /*user*/, const kvc_reclaim * rq) {
    if (!g_idle_release) {
        // No server lock: the cells may be changing on another thread. The
        // next decode / seq_rm on the cache's own thread trims.
        g_trim_pending = true;
        LLAMA_LOG_INFO("%s: kvcached: daemon asks for %.2f MiB (%s); trimming at the next batch\n", __func__,
                       rq->bytes / MiB, rq->reason ? rq->reason : "");
        return;
    }
    std::lock_guard<std::recursive_mutex> server(g_server); // the server's main loop is parked
    uint64_t before;
    {
        std::lock_guard<std::mutex> lk(g_reg);
        before = held_locked();
        trim_all_locked();
        if (before - held_locked() >= rq->bytes) {
            return;
        }
    }
    uint64_t now;
    {
        std::lock_guard<std::mutex> lk(g_reg);
        now = held_locked();
    }
    // idle slots: the server clears them (seq_rm trims through the guard)
    g_idle_release(g_idle_user, rq->bytes - std::min(rq->bytes, before - now));
    {
        std::lock_guard<std::mutex> lk(g_reg);
        now = held_locked();
    }
    LLAMA_LOG_INFO("%s: kvcached: daemon asked for %.2f MiB (%s); gave back %.2f MiB\n", __func__, rq->bytes / MiB,
                   rq->reason ? rq->reason : "", (before - std::min(before, now)) / MiB);
}

kv_cache * cache_of(const void * owner) {
    auto it = g_caches.find(owner);
    return it == g_caches.end() ? nullptr : it->second;
}

} // namespace

ggml_backend_buffer_t llama_kvcached_alloc_kv(ggml_context * ctx, ggml_backend_buffer_type_t buft,
                                              const llama_kvcached_cache_info & info) {
    std::unique_lock<std::mutex> lk(g_reg);
    kvc_session * s = session_locked();
    if (!s) {
        lk.unlock();
        return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    }
    const bool host_buft = ggml_backend_buft_is_host(buft);
    const bool host_pages = strcmp(kvc_session_kind(s), "host") == 0;
    if (host_buft != host_pages) {
        LLAMA_LOG_WARN("%s: kvcached: %s buffer but the daemon lends %s pages; this KV buffer in ordinary memory\n",
                       __func__, ggml_backend_buft_name(buft), kvc_session_kind(s));
        lk.unlock();
        return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    }

    const uint64_t             page = kvc_session_page_size(s);
    std::vector<ggml_tensor *> ts;
    std::vector<uint64_t>      offs;
    uint64_t                   total = 0;
    if (!build_layout(ctx, buft, info, page, ts, offs, total)) {
        LLAMA_LOG_WARN("%s: kvcached: unexpected KV layout; this KV buffer in ordinary memory\n", __func__);
        lk.unlock();
        return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    }

    kvc_region * region = nullptr;
    kvc_status   st     = kvc_region_create(s, total, &region);
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("%s: kvcached: cannot reserve %.2f MiB (%s: %s); this KV buffer in ordinary memory\n", __func__,
                       total / MiB, kvc_status_to_string(st), kvc_last_error());
        lk.unlock();
        return ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    }
    char * base = (char *) kvc_region_base(region);

    auto * b    = new kv_buffer();
    b->region   = region;
    b->dev_ptr  = base;
    b->host     = host_buft;

    ggml_backend_buffer_t buf = nullptr;
    if (host_buft) {
        // CPU: wrap the reservation; keep the CPU buffer's own functions
        // (base, get/set/cpy are memcpy) and the caller's buffer type (so the
        // scheduler and the "CPU KV buffer" log line are unchanged); replace
        // what must not touch unmapped pages and what owns the region.
        buf = ggml_backend_cpu_buffer_from_ptr(base, total);
        buf->buft                = buft;
        buf->iface.free_buffer   = buf_free;
        buf->iface.clear         = buf_clear;
        buf->iface.memset_tensor = buf_memset_tensor;
    } else {
        // Device (CUDA): keep the device's buffer type (ggml-cuda recognises
        // its buffers by the type's functions) and replace only the buffer's
        // function table. Unverified on a GPU (docs/llama-cpp.md).
        const char * dn = ggml_backend_buft_name(buft);
        while (*dn && (*dn < '0' || *dn > '9')) {
            ++dn;
        }
        b->device = atoi(dn);
        ggml_backend_buffer_i iface = {};
        iface.free_buffer   = buf_free;
        iface.get_base      = dev_get_base;
        iface.init_tensor   = nullptr;
        iface.memset_tensor = buf_memset_tensor;
        iface.set_tensor    = dev_set_tensor;
        iface.get_tensor    = dev_get_tensor;
        iface.cpy_tensor    = dev_cpy_tensor;
        iface.clear         = buf_clear;
        iface.reset         = nullptr;
        buf = ggml_backend_buffer_init(buft, iface, b, total);
    }
    b->buf = buf;

    for (size_t i = 0; i < ts.size(); ++i) {
        ggml_tensor * t = ts[i];
        if (ggml_backend_tensor_alloc(buf, t, base + offs[i]) != GGML_STATUS_SUCCESS) {
            GGML_ABORT("kvcached: cannot place %s", t->name);
        }
        const bool whole = info.v_trans && info.is_v && info.is_v(t);
        b->tensors.push_back({ offs[i], (uint64_t) t->nb[1], (uint64_t) t->nb[2], ggml_nbytes(t), whole });
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
        c         = new kv_cache();
        c->info   = info;
        c->mapped.assign(info.n_stream, 0);
        g_caches[info.owner] = c;
    }
    b->cache = c;
    c->bufs.push_back(b);
    g_buffers[buf] = b;

    size_t n_whole = 0;
    for (const auto & t : b->tensors) {
        n_whole += t.whole;
    }
    LLAMA_LOG_INFO("%s: kvcached: %s KV buffer reserved %.2f MiB in daemon pages (%zu tensors page aligned, %u cells x %u "
                   "streams, %s)\n",
                   __func__, ggml_backend_buffer_name(buf), total / MiB, ts.size(), info.kv_size, info.n_stream,
                   n_whole ? "V transposed: V mapped whole, K elastic (use flash attention for elastic V)"
                           : "K and V elastic");
    return buf;
}

size_t llama_kvcached_buffer_size(ggml_backend_buffer_t buf) {
    if (kv_buffer * b = lookup(buf)) {
        return kvc_region_mapped_bytes(b->region);
    }
    return ggml_backend_buffer_get_size(buf);
}

bool llama_kvcached_active(const void * owner) {
    std::lock_guard<std::mutex> lk(g_reg);
    return cache_of(owner) != nullptr;
}

bool llama_kvcached_map(const void * owner, const uint32_t * n_cells, uint32_t n_stream) {
    std::lock_guard<std::mutex> lk(g_reg);
    kv_cache * c = cache_of(owner);
    if (!c) {
        return true;
    }
    if (g_trim_pending.exchange(false)) {
        trim_all_locked();
    }
    std::vector<uint32_t> need(c->info.n_stream, 0);
    for (uint32_t s = 0; s < n_stream && s < c->info.n_stream; ++s) {
        need[s] = n_cells[s];
    }
    return map_locked(c, need);
}

bool llama_kvcached_map_all(const void * owner) {
    std::lock_guard<std::mutex> lk(g_reg);
    kv_cache * c = cache_of(owner);
    if (!c) {
        return true;
    }
    return map_locked(c, std::vector<uint32_t>(c->info.n_stream, c->info.kv_size));
}

bool llama_kvcached_map_used(const void * owner) {
    std::lock_guard<std::mutex> lk(g_reg);
    kv_cache * c = cache_of(owner);
    if (!c) {
        return true;
    }
    std::vector<uint32_t> need(c->info.n_stream);
    for (uint32_t s = 0; s < c->info.n_stream; ++s) {
        need[s] = keep_cells(c, c->info.used_cells ? c->info.used_cells(s) : c->info.kv_size);
    }
    return map_locked(c, need);
}

void llama_kvcached_trim(const void * owner) {
    std::lock_guard<std::mutex> lk(g_reg);
    kv_cache * c = cache_of(owner);
    if (!c) {
        return;
    }
    if (g_trim_pending.exchange(false)) {
        trim_all_locked();
    } else {
        trim_locked(c);
    }
}

extern "C" {

void llama_kvcached_lock(void) {
    g_server.lock();
}

void llama_kvcached_unlock(void) {
    g_server.unlock();
}

void llama_kvcached_set_idle_release(void (*fn)(void *, uint64_t), void * user) {
    std::lock_guard<std::recursive_mutex> server(g_server);
    g_idle_release = fn;
    g_idle_user    = user;
}

uint64_t llama_kvcached_held_bytes(void) {
    std::lock_guard<std::mutex> lk(g_reg);
    return held_locked();
}

} // extern "C"
