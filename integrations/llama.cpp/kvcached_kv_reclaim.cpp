// kvcached_kv_reclaim.cpp: the daemon's reclaim requests and the hook's
// thread that serves them, logs deferred KV lines and reconnects
// (kvcached_kv_reclaim.h).

#if !defined(OLLAMA_COMPAT_MTMD_BUILD) && defined(LLAMA_KVCACHED)

#include "kvcached_kv_hook.h"

#include "llama-impl.h"

#include <algorithm>
#include <climits>

namespace llama_kvcached_impl {

namespace {  // this file's own

std::string reclaim_reason(hook & h) {
    std::lock_guard<std::mutex> t(h.worker.mu);
    return h.worker.reclaim_reason;
}

// The answer to a reclaim request: what went back at once and what is kept.
// Logged, and sent to the daemon (an ANSWER record through
// kvc_session_answer_reclaim, C API 1.3) so the request is settled at once:
// `kvcachedctl shrink` prints it and a waiting Allocate asks the next
// session instead of waiting for pages that will not come.
void answer_reclaim(hook & h, const std::string & reason, uint64_t id, uint64_t asked, uint64_t given, uint64_t kept,
                    const char * why) {
    const client_api & a = h.api;
    LLAMA_LOG_INFO("kvcached: reclaim (%s): asked %.2f MiB, gave back %.2f MiB at once, keeping %.2f MiB%s%s\n",
                   reason.c_str(), asked / MiB, given / MiB, kept / MiB, why && *why ? ": " : "", why ? why : "");
    if (!id || !a.kvc_session_answer_reclaim) {
        return;  // a client before API 1.3: the daemon sees the Frees only
    }
    kvc_session * s;
    {
        std::lock_guard<std::mutex> lk(h.locks.reg);
        s = h.link.lost ? nullptr : h.link.session;  // sessions are never freed while the process runs
    }
    if (!s) {
        return;
    }
    kvc_status st = a.kvc_session_answer_reclaim(s, id, given, kept, why ? why : "");
    if (st != KVC_OK) {
        LLAMA_LOG_WARN("kvcached: could not send the reclaim answer to the daemon (%s: %s)\n", status_name(h.api, st),
                       last_err(h.api));
    }
}

}  // namespace

// Answer the pending reclaim request. The server lock is held (the main loop
// is parked or is the caller), so cells and slots are stable. Standby pages
// go first (the daemon asks sessions that keep them first); then what the
// cells do not use, and idle slots, as before, keeping nothing as standby.
// The answer's given counts standby given; kept is what is held after.
void serve_reclaim_server_locked(hook & h) {
    reclaim_state & r = h.reclaim;
    if (!r.pending.exchange(false)) {
        return;
    }
    const uint64_t    asked  = r.bytes.exchange(0);
    const uint64_t    id     = r.id.exchange(0);
    const std::string reason = reclaim_reason(h);
    uint64_t          before, now, from_standby;
    {
        std::lock_guard<std::mutex> lk(h.locks.reg);
        before       = held_locked(h);
        from_standby        = release_standby_locked(h, asked ? asked : UINT64_MAX);
        h.policy.no_standby = true;  // then as before: what the cells do not use
        trim_all_locked(h);
        now = held_locked(h);
    }
    if (before - std::min(before, now) < asked && r.idle_release) {
        // idle slots: the server clears them (their seq_rm trims through the guard, keeping no standby)
        r.idle_release(r.idle_user, asked - (before - now));
    }
    {
        std::lock_guard<std::mutex> lk(h.locks.reg);
        h.policy.no_standby = false;
        now                 = held_locked(h);
    }
    const uint64_t given = before - std::min(before, now);
    if (from_standby > 0) {
        LLAMA_LOG_INFO("kvcached: reclaim (%s): %.2f MiB of standby KV pages given back first\n", reason.c_str(),
                       from_standby / MiB);
    }
    answer_reclaim(h, reason, id, asked, given, now,
                   given >= asked ? "" : "the rest is in use by busy slots (or is not elastic: V without flash attention)");
}

void on_reclaim(void * user, const kvc_reclaim * rq) {
    // The client's Watch thread: never block here. The hook's thread (or the
    // server's main loop, whichever comes first) answers.
    hook &          h = *static_cast<hook *>(user);
    reclaim_state & r = h.reclaim;
    {
        std::lock_guard<std::mutex> t(h.worker.mu);
        h.worker.reclaim_reason = rq->reason ? rq->reason : "";
    }
    if (h.api.kvc_session_answer_reclaim) {  // API 1.3: rq->id exists
        r.id = rq->id;
    }
    uint64_t cur = r.bytes.load();
    while (cur < rq->bytes && !r.bytes.compare_exchange_weak(cur, rq->bytes)) {
    }
    r.pending = true;
    wake_thread(h);
}

namespace {  // this file's own

// A reclaim request on the hook's thread: served under the server lock
// when the server can release idle slots (it waits for the main loop to
// park), else owed to the cache's own thread (the cells may be changing:
// the next batch or seq_rm trims).
void serve_reclaim_from_thread(hook & h) {
    reclaim_state &                        r = h.reclaim;
    std::unique_lock<std::recursive_mutex> server(h.locks.server);
    if (r.idle_release) {
        serve_reclaim_server_locked(h);
        return;
    }
    server.unlock();
    r.pending            = false;
    const uint64_t asked = r.bytes.exchange(0);
    const uint64_t id    = r.id.exchange(0);
    uint64_t       given = 0, now = 0;
    {
        // standby pages back no cell: given at once, from this thread
        std::lock_guard<std::mutex> lk(h.locks.reg);
        given = release_standby_locked(h, asked ? asked : UINT64_MAX);
        now   = held_locked(h);
    }
    if (given > 0 && given >= asked) {
        answer_reclaim(h, reclaim_reason(h), id, asked, given, now, "");
        return;
    }
    // not answered: the Frees at the next batch settle it
    h.policy.reclaim_trim = true;
    h.policy.trim_pending = true;
    LLAMA_LOG_INFO("kvcached: reclaim (%s): asked %.2f MiB; gave back %.2f MiB of standby pages at once; this program "
                   "trims at its next batch\n",
                   reclaim_reason(h).c_str(), asked / MiB, given / MiB);
}

// KVCACHED_STANDBY_IDLE_MS: once no batch has backed cells (and no seq_rm
// trimmed the cache) for that long, every buffer's standby pages go back
// (kvc_region_release_standby), so an idle process holds only what its
// cells use. Standby backs no cell: reg is enough, as for a reclaim's
// standby. Not while the daemon is away (its pages stay until it is back,
// as a trim's do); not with KVCACHED_PREMAP (no standby). On the hook's
// thread, at most 200 ms late.
void release_idle_standby(hook & h) {
    const settings & cfg = h.cfg;
    if (cfg.standby_idle_ms == 0 || cfg.standby == 0 || cfg.premap || !h.api.kvc_region_release_standby) {
        return;
    }
    std::lock_guard<std::mutex> lk(h.locks.reg);
    const int64_t               idle = now_ms() - h.policy.last_batch;
    if (h.link.m != mode::on || idle < (int64_t) cfg.standby_idle_ms) {
        return;
    }
    uint64_t standby = 0;
    for (auto & [_, b] : h.books.buffers) {
        standby += standby_of(h, b);
    }
    if (standby == 0 || daemon_away_locked(h)) {
        return;
    }
    const uint64_t given = release_standby_locked(h, UINT64_MAX);
    if (given > 0) {
        LLAMA_LOG_INFO("kvcached: idle for %lld ms: %.2f MiB of standby KV pages given back "
                       "(KVCACHED_STANDBY_IDLE_MS=%u)\n",
                       (long long) idle, given / MiB, (unsigned) cfg.standby_idle_ms);
        log_lines_locked(h);
    }
}

// Sleep until woken or 200 ms passed; false when the thread must stop.
bool worker_wait(hook & h) {
    worker_state &               w = h.worker;
    std::unique_lock<std::mutex> t(w.mu);
    w.cv.wait_for(t, std::chrono::milliseconds(200));
    if (w.stop) {
        w.exited = true;
        w.cv.notify_all();
        return false;
    }
    return true;
}

}  // namespace

// The hook's own thread: answers reclaim requests, gives standby pages back
// when idle, logs deferred KV lines, notices daemon loss and reconnects.
void thread_main(hook & h) {
    while (worker_wait(h)) {
        if (h.reclaim.pending.load()) {
            serve_reclaim_from_thread(h);
        }
        release_idle_standby(h);
        bool lost;
        {
            std::lock_guard<std::mutex> lk(h.locks.reg);
            check_session_locked(h);
            if (h.books.lines_pending) {
                log_lines_locked(h);
            }
            lost = h.link.lost;
        }
        if (lost) {
            try_reconnect(h);
        }
    }
}

}  // namespace llama_kvcached_impl

#endif  // !OLLAMA_COMPAT_MTMD_BUILD && LLAMA_KVCACHED
