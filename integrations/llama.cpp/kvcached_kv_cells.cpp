// kvcached_kv_cells.cpp: cells to pages: back the cells a batch needs
// (asking the daemon only for what the mapped pages do not cover), give back
// what the cells no longer use, and say why a batch could not be backed
// (kvcached_kv_cells.h).

#if !defined(OLLAMA_COMPAT_MTMD_BUILD) && defined(LLAMA_KVCACHED)

#include "kvcached_kv_hook.h"

#include "llama-impl.h"

#include <algorithm>
#include <climits>

namespace llama_kvcached_impl {

// A new session: its wait switch is unknown, no refusal from it yet.
void policy_reset_locked(hook & h) {
    decode_policy & p = h.policy;
    p.wait_set        = false;
    p.no_wait_until   = 0;
    p.last_error.clear();
}

namespace {  // this file's own

// ---- ranges ------------------------------------------------------------------

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

// The ranges that back cells [0, need[s]) of every stream of b (and its
// whole tensors once anything is needed) and are not all mapped yet.
std::vector<kvc_range> missing_ranges(hook & h, const kv_buffer * b, const std::vector<uint32_t> & need, bool anything) {
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
                                [&](const kvc_range & r) { return h.api.kvc_region_is_mapped(b->region, r.offset, r.size); }),
                 ranges.end());
    return ranges;
}

// ---- errors ------------------------------------------------------------------

// The message for a batch the daemon could not back. reg held.
std::string map_error_locked(hook & h, kvc_status st, const std::string & why, bool waited) {
    const link_state & l    = h.link;
    const uint64_t     held = held_locked(h);
    const char *       sock = h.cfg.socket.c_str();
    check_session_locked(h);
    if (l.lost || (st == KVC_ERR_FAILED_PRECONDITION && h.api.kvc_session_ended(l.session))) {
        return fmt("kvcached: the daemon at %s is gone: no new KV memory until it is back (this server keeps serving "
                   "from the %.2f MiB it has mapped; reconnecting)",
                   sock, held / MiB);
    }
    if (st == KVC_ERR_UNAVAILABLE || h.api.kvc_session_is_resuming(l.session)) {
        return fmt("kvcached: the daemon at %s is unreachable: no new KV memory until it is back (this server keeps "
                   "serving from the %.2f MiB it has mapped) (%s)",
                   sock, held / MiB, why.c_str());
    }
    if (st == KVC_ERR_RESOURCE_EXHAUSTED || st == KVC_ERR_DEADLINE_EXCEEDED) {
        const std::string how =
            waited ? fmt("within %u ms", h.cfg.wait_ms) : std::string("(no wait: it refused moments ago)");
        return fmt("kvcached: the daemon at %s could not lend more KV memory %s; this server holds %.2f MiB (%s)", sock,
                   how.c_str(), held / MiB, why.c_str());
    }
    return fmt("kvcached: backing the KV cache with daemon pages failed (%s: %s)", status_name(h.api, st), why.c_str());
}

// A batch the daemon could not back: say why (once per 5 s for the same
// message). reg held.
void map_failed_locked(hook & h, kvc_status st, const std::string & why, bool waited) {
    decode_policy & p = h.policy;
    if (st == KVC_ERR_RESOURCE_EXHAUSTED || st == KVC_ERR_DEADLINE_EXCEEDED) {
        p.no_wait_until = now_ms() + h.cfg.fail_fast_ms;
    }
    p.last_error    = map_error_locked(h, st, why, waited);
    const int64_t t = now_ms();
    if (p.last_error != p.logged_error || t - p.logged_error_at >= 5000) {
        LLAMA_LOG_WARN("%s\n", p.last_error.c_str());
        p.logged_error    = p.last_error;
        p.logged_error_at = t;
    }
}

// ---- mapping -----------------------------------------------------------------

// The decode path waits at most wait_ms, and not at all shortly after a
// refusal (llama-server then halves the batch and retries: those retries
// must not wait again). True when Allocates may wait now. reg held.
bool set_wait_locked(hook & h) {
    decode_policy & p    = h.policy;
    const bool      wait = now_ms() >= p.no_wait_until;
    if (!p.wait_set || p.wait_on != wait) {
        h.api.kvc_session_set_wait(h.link.session, wait ? 1 : 0, h.cfg.wait_ms);
        p.wait_set = true;
        p.wait_on  = wait;
    }
    return wait;
}

// Map the missing ranges of every buffer of c (one Allocate per buffer;
// `any`: some are missing); a buffer whose ranges are all mapped now has its
// whole tensors mapped too. reg held. On failure policy.last_error says why.
bool map_missing_locked(hook & h, kv_cache * c, const std::vector<std::vector<kvc_range>> & missing, bool anything, bool any) {
    const client_api & a       = h.api;
    const bool         wait    = any && set_wait_locked(h);
    bool               changed = false;
    bool               ok      = true;
    for (size_t i = 0; ok && i < c->bufs.size(); ++i) {
        kv_buffer * b = c->bufs[i];
        if (!missing[i].empty()) {
            const uint64_t before = a.kvc_region_mapped_bytes(b->region);
            kvc_status     st     = a.kvc_region_map_ranges(b->region, missing[i].data(), missing[i].size());
            if (st != KVC_OK) {
                map_failed_locked(h, st, last_err(h.api), wait);
                ok = false;
                break;
            }
            const uint64_t after = a.kvc_region_mapped_bytes(b->region);
            changed              = changed || after != before;
            if (h.cfg.debug) {
                LLAMA_LOG_INFO("kvcached: mapped %.2f -> %.2f MiB\n", before / MiB, after / MiB);
            }
        }
        b->whole_mapped = b->whole_mapped || anything;
    }
    if (changed) {
        log_lines_locked(h);
    }
    return ok;
}

// Local KV memory now, over every buffer (0 without API 1.5). reg held.
uint64_t local_held_locked(hook & h) {
    uint64_t n = 0;
    for (auto & [_, b] : h.books.buffers) {
        n += h.api.kvc_region_local_bytes ? h.api.kvc_region_local_bytes(b->region) : 0;
    }
    return n;
}

// The daemon stayed away past KVCACHED_WAIT_DAEMON_MS: back the missing
// ranges with this process's own memory (KVCACHED_ON_DAEMON_LOSS=local:
// ordinary device memory outside the daemon's budget, given back when the
// cells are freed), or fail the batch (fail). reg held. On failure
// policy.last_error says why.
bool map_local_locked(hook & h, kv_cache * c, const std::vector<std::vector<kvc_range>> & missing, bool anything) {
    const client_api & a = h.api;
    decode_policy &    p = h.policy;
    if (!h.cfg.loss_local || !a.kvc_region_map_ranges_local) {
        map_failed_locked(h, KVC_ERR_UNAVAILABLE, "", false);
        return false;
    }
    uint64_t added = 0;
    for (size_t i = 0; i < c->bufs.size(); ++i) {
        kv_buffer * b = c->bufs[i];
        if (!missing[i].empty()) {
            const uint64_t before = a.kvc_region_local_bytes(b->region);
            kvc_status     st     = a.kvc_region_map_ranges_local(b->region, missing[i].data(), missing[i].size());
            if (st != KVC_OK) {
                p.last_error = fmt("kvcached: the daemon at %s is away and new KV cells could not be backed with "
                                   "local memory either (%s: %s)",
                                   h.cfg.socket.c_str(), status_name(h.api, st), last_err(h.api));
                LLAMA_LOG_WARN("%s\n", p.last_error.c_str());
                return false;
            }
            added += a.kvc_region_local_bytes(b->region) - before;
        }
        b->whole_mapped = b->whole_mapped || anything;
    }
    if (added > 0) {
        p.local_total += added;
        const int64_t t = now_ms();
        if (t - p.local_logged >= 5000) {
            p.local_logged = t;
            LLAMA_LOG_WARN("kvcached: the daemon at %s is away: new KV cells backed with %.2f MiB of local memory "
                           "outside its budget (%.2f MiB local now, %.2f MiB since start; KVCACHED_ON_DAEMON_LOSS=local); "
                           "given back when the cells are freed\n",
                           h.cfg.socket.c_str(), added / MiB, local_held_locked(h) / MiB, p.local_total / MiB);
        }
        log_lines_locked(h);
    }
    return true;
}

}  // namespace

// Back cells [0, need[s]) of every stream. What the mapped pages cover is
// served without the daemon (also while it is away); pages are asked for
// only for the rest. reg held (by lk; released while waiting for a daemon
// that is away). On failure policy.last_error says why.
bool map_locked(hook & h, kv_cache * c, const std::vector<uint32_t> & need_in, std::unique_lock<std::mutex> & lk) {
    decode_policy &       p        = h.policy;
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
    beyond       = beyond || c->recheck;
    p.last_batch = now_ms();  // a batch (or K shift, state restore): not idle, standby stays for the next grow
    std::vector<std::vector<kvc_range>> missing(c->bufs.size());
    bool                                any = false;
    for (size_t i = 0; beyond && i < c->bufs.size(); ++i) {  // (the decode path's common case: no page to look at)
        missing[i] = missing_ranges(h, c->bufs[i], need, anything);
        any        = any || !missing[i].empty();
    }
    bool local = false;  // the daemon stayed away: local pages instead
    if (any && daemon_away_locked(h)) {
        local = !wait_daemon_locked(h, lk);
        for (size_t i = 0; i < c->bufs.size(); ++i) {  // reg was released: look again
            missing[i] = missing_ranges(h, c->bufs[i], need, anything);
        }
    }
    if (local && !map_local_locked(h, c, missing, anything)) {
        return false;
    }
    if (beyond && !local && !map_missing_locked(h, c, missing, anything, any)) {
        return false;
    }
    if (any) {
        p.no_wait_until = 0;
    }
    c->recheck = false;
    p.last_error.clear();
    for (size_t s = 0; s < need.size(); ++s) {
        c->mapped[s] = std::max(c->mapped[s], need[s]);
    }
    return true;
}

// ---- trimming ----------------------------------------------------------------

// Give standby pages back, up to `bytes` (UINT64_MAX: all), buffer by
// buffer; the bytes given. reg held.
uint64_t release_standby_locked(hook & h, uint64_t bytes) {
    const client_api & a     = h.api;
    uint64_t           given = 0;
    for (auto & [_, b] : h.books.buffers) {
        if (!a.kvc_region_release_standby || given >= bytes) {
            break;
        }
        uint64_t   got = 0;
        kvc_status st  = a.kvc_region_release_standby(b->region, bytes == UINT64_MAX ? UINT64_MAX : bytes - given, &got);
        if (st != KVC_OK) {
            LLAMA_LOG_WARN("kvcached: cannot give standby KV pages back (%s: %s)\n", status_name(h.api, st), last_err(h.api));
        }
        given += got;
    }
    return given;
}

// KVCACHED_STANDBY_BYTES split over the KV buffers in proportion to their
// size (whenever one is made or freed). reg held.
void standby_limits_locked(hook & h) {
    const client_api & a = h.api;
    if (!a.kvc_region_set_standby_limit) {
        return;
    }
    uint64_t total = 0;
    for (auto & [_, b] : h.books.buffers) {
        total += b->reserved;
    }
    for (auto & [_, b] : h.books.buffers) {
        const uint64_t lim = total ? (uint64_t) ((long double) h.cfg.standby * b->reserved / total) : 0;
        kvc_status     st  = a.kvc_region_set_standby_limit(b->region, h.cfg.premap ? 0 : lim);
        if (st != KVC_OK) {
            LLAMA_LOG_WARN("kvcached: cannot set the standby limit of a KV buffer (%s: %s)\n", status_name(h.api, st),
                           last_err(h.api));
        }
    }
}


uint32_t keep_cells(const kv_cache * c, uint32_t used) {
    if (used == 0) {
        return 0;
    }
    const uint32_t pad = std::max<uint32_t>(c->info.n_pad, 1);
    return std::min<uint32_t>(c->info.kv_size, ((used + pad - 1) / pad) * pad);
}

namespace {  // this file's own

// Unmap b's free ranges (merged) and, when the cache is empty, its whole
// tensors (`only_local`: only the local pages among them). False (logged)
// when the client refused. reg held.
bool trim_buffer_locked(hook & h, kv_buffer * b, const std::vector<uint32_t> & keep, const std::vector<uint32_t> & to,
                        bool empty, bool only_local, bool & changed) {
    const client_api &     a = h.api;
    std::vector<kvc_range> ranges;
    cell_ranges(b, keep, to, ranges);
    const bool drop_whole = empty && b->whole_mapped;
    for (const auto & t : b->tensors) {
        if (drop_whole && t.whole) {
            ranges.push_back({ t.offset, t.extent });
        }
    }
    if (ranges.empty()) {
        return true;
    }
    merge_ranges(ranges);
    const uint64_t before = a.kvc_region_mapped_bytes(b->region);
    // what the last requests used stays mapped as standby (KVCACHED_STANDBY_BYTES, C API 1.7), up to the
    // buffer's share: a slot that grows again maps nothing new (the library frees what is beyond the share)
    const bool     standby = !only_local && !h.policy.no_standby && a.kvc_region_unmap_ranges_standby &&
                         h.cfg.standby > 0;
    kvc_status     st      = only_local ? a.kvc_region_unmap_ranges_local(b->region, ranges.data(), ranges.size()) :
                             standby    ? a.kvc_region_unmap_ranges_standby(b->region, ranges.data(), ranges.size()) :
                                          a.kvc_region_unmap_ranges(b->region, ranges.data(), ranges.size());
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("kvcached: cannot give KV pages back (%s: %s)\n", status_name(h.api, st), last_err(h.api));
        return false;
    }
    if (only_local) {
        changed = changed || a.kvc_region_mapped_bytes(b->region) != before;
        return true;  // the daemon's pages stay, and with them what the books say is mapped
    }
    if (drop_whole) {
        b->whole_mapped = false;
    }
    const uint64_t after = a.kvc_region_mapped_bytes(b->region);
    changed              = changed || after != before;
    if (h.cfg.debug) {
        LLAMA_LOG_INFO("kvcached: trimmed %.2f -> %.2f MiB in use (%.2f MiB standby)\n", before / MiB, after / MiB,
                       standby_of(h, b) / MiB);
    }
    return true;
}

}  // namespace

// Unmap what the cells do not use; with no cell in use, everything (also a
// transposed V that is otherwise mapped whole). reg held, on the thread
// that owns the cache (or under the server lock).
void trim_locked(hook & h, kv_cache * c) {
    if (h.cfg.premap) {
        return;  // KVCACHED_PREMAP: every page stays until the buffer is freed
    }
    const bool away = daemon_away_locked(h);
    if (away) {
        // no daemon page is unmapped while the daemon is away (it could not
        // take it back until it returns: trimmed at the first batch after
        // that); local pages are given back now
        h.policy.trim_pending = true;
        if (local_held_locked(h) == 0) {
            return;
        }
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
    bool changed = false;
    bool ok      = true;
    for (size_t i = 0; any && ok && i < c->bufs.size(); ++i) {
        ok = trim_buffer_locked(h, c->bufs[i], keep, to, empty, away, changed);
    }
    c->recheck = c->recheck || (any && away);
    for (uint32_t s = 0; any && ok && !away && s < c->info.n_stream; ++s) {
        c->mapped[s] = std::min(c->mapped[s], keep[s]);
    }
    if (changed) {
        log_lines_locked(h);
    }
}

void trim_all_locked(hook & h) {
    for (auto & [_, c] : h.books.caches) {
        trim_locked(h, c);
    }
}

// A trim owed is done before anything else; true when there was one (it
// trimmed every cache). reg held.
bool trim_owed_locked(hook & h) {
    decode_policy & p = h.policy;
    if (!p.trim_pending.exchange(false)) {
        return false;
    }
    const bool reclaim = p.reclaim_trim.exchange(false);
    if (reclaim) {  // owed to a reclaim: standby goes first, and the trim keeps none
        release_standby_locked(h, UINT64_MAX);
    }
    p.no_standby = reclaim;
    trim_all_locked(h);
    p.no_standby = false;
    return true;
}

}  // namespace llama_kvcached_impl

#endif  // !OLLAMA_COMPAT_MTMD_BUILD && LLAMA_KVCACHED
