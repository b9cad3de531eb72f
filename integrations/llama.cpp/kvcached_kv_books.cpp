// kvcached_kv_books.cpp: the KV buffers in daemon pages: their layout, the
// ggml buffer they are, the books of this process's caches, and the "KV
// buffer size" line Ollama reads (kvcached_kv_books.h).

#if !defined(OLLAMA_COMPAT_MTMD_BUILD) && defined(LLAMA_KVCACHED)

#include "kvcached_kv_hook.h"

#include "ggml-alloc.h"
#include "ggml-backend-impl.h"
#include "ggml.h"
#include "llama-impl.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace llama_kvcached_impl {

kv_cache * cache_of(hook & h, const void * owner) {
    auto it = h.books.caches.find(owner);
    return it == h.books.caches.end() ? nullptr : it->second;
}

// Standby bytes of one buffer (0 without API 1.7).
uint64_t standby_of(const hook & h, const kv_buffer * b) {
    return h.api.kvc_region_standby_bytes ? h.api.kvc_region_standby_bytes(b->region) : 0;
}

// What this process holds: in use and standby (the daemon's held). reg held.
uint64_t held_locked(hook & h) {
    uint64_t n = 0;
    for (auto & [_, b] : h.books.buffers) {
        n += h.api.kvc_region_mapped_bytes(b->region) + standby_of(h, b);
    }
    return n;
}

void rebind_buffers_locked(hook & h, kvc_session * s) {
    for (auto & [_, b] : h.books.buffers) {
        kvc_status rb = h.api.kvc_region_rebind(b->region, s);
        if (rb != KVC_OK) {
            LLAMA_LOG_ERROR("kvcached: cannot move a KV buffer to the new session (%s: %s)\n", status_name(h.api, rb),
                            last_err(h.api));
        }
    }
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

void log_lines_locked(hook & h) {
    books &                                              k = h.books;
    std::map<std::string, std::pair<uint64_t, uint64_t>> now;  // name -> (held, standby)
    for (auto & [_, b] : k.buffers) {
        const uint64_t sb = standby_of(h, b);
        now[b->name].first += h.api.kvc_region_mapped_bytes(b->region) + sb;
        now[b->name].second += sb;
    }
    for (auto & [name, l] : k.lines) {
        if (!now.count(name)) {
            now[name] = { 0, 0 };
        }
    }
    const int64_t t = now_ms();
    k.lines_pending = false;
    for (auto & [name, v] : now) {
        const auto [bytes, standby] = v;
        kv_line & l                 = k.lines[name];
        if (bytes == l.logged && standby == l.logged_standby) {
            continue;
        }
        if (t - l.logged_at < 1000) {
            k.lines_pending = true;
            continue;
        }
        if (bytes != l.logged) {
            LLAMA_LOG_INFO("llama_kv_cache: %10s KV buffer size = %8.2f MiB\n", name.c_str(), bytes / MiB);
        }
        if (standby != l.logged_standby) {
            // the KV line is what the process holds (the daemon's held); this says what of it is standby
            LLAMA_LOG_INFO("kvcached: %s KV buffer: %.2f MiB in use, %.2f MiB standby (kept mapped for the next "
                           "request; given back first when the daemon asks)\n",
                           name.c_str(), (bytes - standby) / MiB, standby / MiB);
        }
        l.logged         = bytes;
        l.logged_standby = standby;
        l.logged_at      = t;
    }
    if (k.lines_pending) {
        wake_thread(h);
    }
}

// ---- ggml buffer functions ---------------------------------------------------

kv_buffer * lookup(hook & h, ggml_backend_buffer_t buf) {
    std::lock_guard<std::mutex> lk(h.locks.reg);
    auto                        it = h.books.buffers.find(buf);
    return it == h.books.buffers.end() ? nullptr : it->second;
}

namespace {  // this file's own

kv_buffer * buffer_locked(hook & h, ggml_backend_buffer_t buf) {
    auto it = h.books.buffers.find(buf);
    GGML_ASSERT(it != h.books.buffers.end());
    return it->second;
}

uint64_t tensor_offset(const kv_buffer * b, const ggml_tensor * t, size_t offset) {
    return (uint64_t) ((const char *) t->data - (const char *) b->dev_ptr) + offset;
}

bool all_zero(const void * data, size_t size) {
    const unsigned char * p = (const unsigned char *) data;
    return size == 0 || (p[0] == 0 && std::memcmp(p, p + 1, size - 1) == 0);
}

}  // namespace

void buf_free(hook & h, ggml_backend_buffer_t buf) {
    hook_timer kvc_t(h.stats, HC_BUF_FREE);
    books &     k = h.books;
    kv_buffer * b = nullptr;
    {
        std::lock_guard<std::mutex> lk(h.locks.reg);
        auto                        it = k.buffers.find(buf);
        if (it == k.buffers.end()) {
            return;
        }
        b = it->second;
        k.buffers.erase(it);
        if (b->cache) {
            auto & v = b->cache->bufs;
            v.erase(std::remove(v.begin(), v.end(), b), v.end());
            if (v.empty()) {
                k.caches.erase(b->cache->info.owner);
                delete b->cache;
            }
        }
        h.api.kvc_region_destroy(b->region);  // unmap, one Free (standby pages too), release the reservation
        standby_limits_locked(h);
        log_lines_locked(h);
    }
    delete b;
}

void buf_clear(hook & h, ggml_backend_buffer_t buf, uint8_t value) {
    hook_timer kvc_t(h.stats, HC_BUF_CLEAR);
    std::lock_guard<std::mutex> lk(h.locks.reg);  // region calls run under reg (a reconnect rebinds regions)
    kv_buffer *                 b = buffer_locked(h, buf);
    // mapped pages only: unmapped ones come back zeroed from the daemon
    kvc_status st = h.api.kvc_region_clear(b->region, value);
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: clear failed (%s: %s)", status_name(h.api, st), last_err(h.api));
    }
}

void buf_memset_tensor(hook & h, ggml_backend_buffer_t buf, ggml_tensor * t, uint8_t value, size_t offset, size_t size) {
    hook_timer kvc_t(h.stats, HC_BUF_MEMSET_TENSOR);
    std::lock_guard<std::mutex> lk(h.locks.reg);
    kv_buffer *                 b   = buffer_locked(h, buf);
    const uint64_t              off = tensor_offset(b, t, offset);
    kvc_status                  st  = KVC_OK;
    const client_api &          a   = h.api;
    if (value != 0) {
        st = a.kvc_region_map(b->region, off, size);  // a hole would read 0, not value
    }
    if (st == KVC_OK) {
        st = a.kvc_region_memset(b->region, off, size, value);
    }
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: memset failed (%s: %s)", status_name(h.api, st), last_err(h.api));
    }
}

// device buffers (CUDA): data moves through the client library, which uses
// the driver (cuMemcpyHtoD/DtoH, cuMemsetD8) on the region's device pointers
void * dev_get_base(hook & h, ggml_backend_buffer_t buf) {
    hook_timer kvc_t(h.stats, HC_BUF_GET_BASE);
    return ((kv_buffer *) buf->context)->dev_ptr;
}

// set_tensor, CPU and device buffers: every path that writes real data maps
// its cells first (a state restore maps the restored cells), but llama.cpp
// also clears the cells of a restore that failed by writing zeros
// (llama_clear_tensor_data), and a restore fails when its cells could not be
// mapped (the daemon away): zeros into cells that are not backed are no
// write at all (they read zeros once mapped), so only the mapped part is
// cleared. (The CPU buffer's own memcpy wrote into the unmapped reservation:
// SIGSEGV, found by the chaos run.) Other bytes into a hole map it first.
void buf_set_tensor(hook & h, ggml_backend_buffer_t buf, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    hook_timer kvc_t(h.stats, HC_BUF_SET_TENSOR);
    std::lock_guard<std::mutex> lk(h.locks.reg);  // region calls run under reg (a reconnect rebinds regions)
    kv_buffer *                 b   = buffer_locked(h, buf);
    const uint64_t              off = tensor_offset(b, t, offset);
    const client_api &          a   = h.api;
    kvc_status                  st  = KVC_OK;
    if (!a.kvc_region_is_mapped(b->region, off, size)) {
        if (all_zero(data, size)) {
            st = a.kvc_region_memset(b->region, off, size, 0);  // mapped pages only
            if (st != KVC_OK) {
                GGML_ABORT("kvcached: set_tensor (zeros) failed (%s: %s)", status_name(h.api, st), last_err(h.api));
            }
            return;
        }
        st = a.kvc_region_map(b->region, off, size);
    }
    if (st == KVC_OK) {
        st = a.kvc_region_write(b->region, off, data, size);
    }
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: set_tensor failed (%s: %s)", status_name(h.api, st), last_err(h.api));
    }
}

void dev_get_tensor(hook & h, ggml_backend_buffer_t buf, const ggml_tensor * t, void * data, size_t offset, size_t size) {
    hook_timer kvc_t(h.stats, HC_BUF_GET_TENSOR);
    kv_buffer * b  = (kv_buffer *) buf->context;
    kvc_status  st = h.api.kvc_region_read(b->region, tensor_offset(b, t, offset), data, size);
    if (st != KVC_OK) {
        GGML_ABORT("kvcached: get_tensor failed (%s: %s)", status_name(h.api, st), last_err(h.api));
    }
}

bool dev_cpy_tensor(hook & h, ggml_backend_buffer_t, const ggml_tensor *, ggml_tensor *) {
    hook_timer kvc_t(h.stats, HC_BUF_CPY_TENSOR);
    return false;  // ggml falls back to get + set
}

namespace {  // this file's own

// ---- layout ------------------------------------------------------------------

struct kv_layout {
    std::vector<ggml_tensor *> ts;
    std::vector<uint64_t>      sizes, offs;
    uint64_t                   total = 0;
};

// The stock layout (ggml-alloc's): tensors back to back, each at the buffer
// type's alignment, so the reservation is the stock KV buffer and the pages
// held never exceed it rounded up to one page. Tensors smaller than a page
// share pages; a page is mapped while any byte of it backs a needed cell.
bool build_layout(ggml_context * ctx, ggml_backend_buffer_type_t buft, const llama_kvcached_cache_info & info,
                  kv_layout & out) {
    const uint64_t align = ggml_backend_buft_get_alignment(buft);
    if (align == 0 || (align & (align - 1)) != 0) {
        LLAMA_LOG_WARN("%s: kvcached: buffer alignment %llu is not a power of two\n", __func__,
                       (unsigned long long) align);
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
        out.total = (out.total + align - 1) & ~(align - 1);
        out.ts.push_back(t);
        out.sizes.push_back(ggml_backend_buft_get_alloc_size(buft, t));
        out.offs.push_back(out.total);
        out.total += out.sizes.back();
    }
    return !out.ts.empty();
}

// ---- per-model limits --------------------------------------------------------
//
// With KVCACHED_MAX_BYTES / KVCACHED_GUARANTEED_BYTES=auto (the default of a
// router child), the session gets the model's own (docs/llama-cpp.md,
// "Router mode"): the maximum is the
// stock KV buffer rounded up to pages (all the reservation can ever hold),
// the guarantee the pages that the first n_pad cells (256: one padded n_kv)
// of one stream touch in every K/V tensor (a transposed V whole): enough for
// a slot to serve a short request whatever other sessions hold. Computed
// from the first KV buffer, when the session opens.
void model_limits(const kv_layout & lay, const llama_kvcached_cache_info & info, uint64_t page, uint64_t & g,
                  uint64_t & m) {
    m               = (lay.total + page - 1) / page * page;
    uint64_t pages  = 0;
    uint64_t next   = 0;  // the first page not counted yet (tensors are in offset order)
    const uint64_t cells = std::min<uint64_t>(info.n_pad, info.kv_size);
    for (size_t i = 0; i < lay.ts.size(); ++i) {
        const bool     whole = info.v_trans && info.is_v && info.is_v(lay.ts[i]);
        const uint64_t end   = lay.offs[i] + (whole ? lay.sizes[i] : cells * (uint64_t) lay.ts[i]->nb[1]);
        const uint64_t p0    = std::max(lay.offs[i] / page, next);
        const uint64_t p1    = (end + page - 1) / page;
        if (p1 > p0) {
            pages += p1 - p0;
            next = p1;
        }
    }
    g = std::min(pages * page, m);
}

}  // namespace

// The plan session_locked() asks for: this buffer's layout, for a page size.
void plan_limits(ggml_context * ctx, ggml_backend_buffer_type_t buft, const llama_kvcached_cache_info & info,
                 uint64_t page, uint64_t & g, uint64_t & m) {
    kv_layout lay;
    if (build_layout(ctx, buft, info, lay)) {
        model_limits(lay, info, page, g, m);
    }
}

namespace {  // this file's own

// A later KV buffer (a second cache: iSWA, a draft model; a second buffer
// type) that the per-model maximum, computed from the first, does not
// cover: said once (the session's maximum cannot change).
void check_per_model_max_locked(hook & h) {
    const uint64_t page     = h.link.page;
    uint64_t       reserved = 0;  // every KV buffer's reservation (its last tensor's end), in pages
    for (auto & [_, b] : h.books.buffers) {
        reserved += (b->tensors.back().offset + b->tensors.back().extent + page - 1) / page * page;
    }
    if (h.cfg.max_auto && h.cfg.max && reserved > h.cfg.max && !h.books.per_model_max_said) {
        h.books.per_model_max_said = true;
        LLAMA_LOG_WARN("kvcached: this process reserves %.2f MiB of KV buffers, more than the per-model maximum of "
                       "%.2f MiB computed from its first (KVCACHED_MAX_BYTES=auto): set bytes, their sum, for this model\n",
                       reserved / MiB, h.cfg.max / MiB);
    }
}

// ---- the buffer --------------------------------------------------------------

// The ggml buffer over b's reservation. CPU: wrap the reservation; keep the
// CPU buffer's own functions (base, get/cpy are memcpy) and the caller's
// buffer type (so the scheduler and the "CPU KV buffer" log line are
// unchanged); replace what must not touch unmapped pages and what owns the
// region. Device (CUDA): keep the device's buffer type (ggml-cuda recognises
// its buffers by the type's functions) and replace only the buffer's
// function table. Tested against the test driver only (docs/llama-cpp.md).
ggml_backend_buffer_t wrap_region(hook & h, ggml_backend_buffer_type_t buft, kv_buffer * b, uint64_t total) {
    const buffer_entries & fns = h.entries.buffer;  // kvcached_kv.cpp's: they find this hook
    if (b->host) {
        ggml_backend_buffer_t buf = ggml_backend_cpu_buffer_from_ptr(b->dev_ptr, total);
        buf->buft                 = buft;
        buf->iface.free_buffer    = fns.free_buffer;
        buf->iface.clear          = fns.clear;
        buf->iface.memset_tensor  = fns.memset_tensor;
        buf->iface.set_tensor     = fns.set_tensor;
        return buf;
    }
    const char * dn = ggml_backend_buft_name(buft);
    while (*dn && (*dn < '0' || *dn > '9')) {
        ++dn;
    }
    b->device                   = atoi(dn);
    ggml_backend_buffer_i iface = {};
    iface.free_buffer           = fns.free_buffer;
    iface.get_base              = fns.get_base;
    iface.init_tensor           = nullptr;
    iface.memset_tensor         = fns.memset_tensor;
    iface.set_tensor            = fns.set_tensor;
    iface.get_tensor            = fns.get_tensor;
    iface.cpy_tensor            = fns.cpy_tensor;
    iface.clear                 = fns.clear;
    iface.reset                 = nullptr;
    return ggml_backend_buffer_init(buft, iface, b, total);
}

// Put the tensors at their offsets and init the context's views.
void place_tensors(ggml_context * ctx, const llama_kvcached_cache_info & info, const kv_layout & lay, kv_buffer * b) {
    char * base = (char *) b->dev_ptr;
    for (size_t i = 0; i < lay.ts.size(); ++i) {
        ggml_tensor * t = lay.ts[i];
        if (ggml_backend_tensor_alloc(b->buf, t, base + lay.offs[i]) != GGML_STATUS_SUCCESS) {
            GGML_ABORT("kvcached: cannot place %s", t->name);
        }
        const bool     whole  = info.v_trans && info.is_v && info.is_v(t);
        const uint64_t extent = (i + 1 < lay.ts.size() ? lay.offs[i + 1] : lay.total) - lay.offs[i];
        b->tensors.push_back({ lay.offs[i], (uint64_t) t->nb[1], (uint64_t) t->nb[2], ggml_nbytes(t), extent, whole });
    }
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (t->view_src && !t->data) {
            if (ggml_backend_view_init(t) != GGML_STATUS_SUCCESS) {
                GGML_ABORT("kvcached: cannot init view %s", t->name);
            }
        }
    }
}

// Enter b in the books, under its cache (made on its first buffer).
void register_buffer_locked(hook & h, const llama_kvcached_cache_info & info, kv_buffer * b) {
    books &    k = h.books;
    kv_cache * c = cache_of(h, info.owner);
    if (!c) {
        c       = new kv_cache();
        c->info = info;
        c->mapped.assign(info.n_stream, 0);
        k.caches[info.owner] = c;
    }
    b->cache = c;
    c->bufs.push_back(b);
    k.buffers[b->buf] = b;
    k.lines[b->name];  // the constructor's own line says 0.00 for it
}

void log_reserved(const char * fn, const kv_buffer * b, const llama_kvcached_cache_info & info, uint64_t total) {
    size_t n_whole = 0;
    for (const auto & t : b->tensors) {
        n_whole += t.whole;
    }
    LLAMA_LOG_INFO("%s: kvcached: %s KV buffer reserved %.2f MiB in daemon pages (%zu tensors packed as stock, %u cells "
                   "x %u streams, %s)\n",
                   fn, b->name.c_str(), total / MiB, b->tensors.size(), info.kv_size,
                   info.n_stream,
                   n_whole ? "V transposed: V mapped whole while any cell is used, K elastic (use flash attention "
                             "for elastic V)"
                           : "K and V elastic");
}

}  // namespace

// The KV buffer of ctx's tensors in one region of session s, nothing mapped
// yet; nullptr (logged) when this buffer must stay in ordinary memory.
// reg held.
ggml_backend_buffer_t alloc_kv_locked(hook & h, kvc_session * s, ggml_context * ctx, ggml_backend_buffer_type_t buft,
                                      const llama_kvcached_cache_info & info) {
    const char * fn        = "llama_kvcached_alloc_kv";
    const bool   host_buft = ggml_backend_buft_is_host(buft);
    if (host_buft != (h.link.kind == "host")) {
        LLAMA_LOG_WARN("%s: kvcached: %s buffer but the daemon lends %s pages; this KV buffer in ordinary memory\n", fn,
                       ggml_backend_buft_name(buft), h.link.kind.c_str());
        return nullptr;
    }
    kv_layout lay;
    if (!build_layout(ctx, buft, info, lay)) {
        LLAMA_LOG_WARN("%s: kvcached: unexpected KV layout; this KV buffer in ordinary memory\n", fn);
        return nullptr;
    }
    kvc_region * region = nullptr;
    kvc_status   st     = h.api.kvc_region_create(s, lay.total, &region);
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("%s: kvcached: cannot reserve %.2f MiB (%s: %s); this KV buffer in ordinary memory\n", fn,
                       lay.total / MiB, status_name(h.api, st), last_err(h.api));
        return nullptr;
    }
    auto * b    = new kv_buffer();
    b->region   = region;
    b->dev_ptr  = h.api.kvc_region_base(region);
    b->host     = host_buft;
    b->reserved = lay.total;
    b->buf      = wrap_region(h, buft, b, lay.total);
    b->name     = ggml_backend_buffer_name(b->buf);
    place_tensors(ctx, info, lay, b);
    register_buffer_locked(h, info, b);
    standby_limits_locked(h);
    log_reserved(fn, b, info, lay.total);
    check_per_model_max_locked(h);
    return b->buf;
}

}  // namespace llama_kvcached_impl

#endif  // !OLLAMA_COMPAT_MTMD_BUILD && LLAMA_KVCACHED
