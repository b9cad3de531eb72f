// kvcached_kv_link.cpp: the process's daemon session: opened on first use,
// watched for the daemon's loss, resumed or reconnected, and waited for
// (kvcached_kv_link.h).

#if !defined(OLLAMA_COMPAT_MTMD_BUILD) && defined(LLAMA_KVCACHED)

#include "kvcached_kv_hook.h"

#include "llama-impl.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <thread>

namespace llama_kvcached_impl {

void wake_thread(hook & h) {
    h.worker.cv.notify_all();
}

void stop_thread(hook & h) {
    worker_state &               w = h.worker;
    std::unique_lock<std::mutex> t(w.mu);
    w.stop = true;
    w.cv.notify_all();
    const bool done = w.cv.wait_for(t, std::chrono::seconds(2), [&] { return w.exited; });
    t.unlock();
    if (done && w.th.joinable()) {
        w.th.join();
    } else if (w.th.joinable()) {
        w.th.detach();
    }
}

namespace {  // this file's own

// Open a client and session with the options from the environment (fixed
// after the first call, so no lock is needed). On failure `err` says why.
kvc_status open_session(hook & h, kvc_client ** pc, kvc_session ** ps, std::string & err) {
    const client_api & a = h.api;
    const settings &   c = h.cfg;
    *pc                  = nullptr;
    *ps                  = nullptr;
    kvc_status st        = a.kvc_client_create(c.socket.c_str(), pc);
    if (st != KVC_OK) {
        err = last_err(h.api);
        return st;
    }
    std::vector<kvc_label> labels;
    for (auto & [k, v] : c.labels) {
        labels.push_back({ k.c_str(), v.c_str() });
    }
    kvc_session_options o;
    a.kvc_session_options_init(&o);
    o.name             = c.name.c_str();
    o.device           = c.device.empty() ? nullptr : c.device.c_str();
    o.guaranteed_bytes = c.guaranteed;
    o.max_bytes        = c.max;
    o.priority         = c.priority;
    o.labels           = labels.empty() ? nullptr : labels.data();
    o.num_labels       = labels.size();
    o.wait             = 1;
    o.wait_timeout_ms  = c.wait_ms;
    st                 = a.kvc_session_open(*pc, &o, ps);
    if (st != KVC_OK) {
        err = last_err(h.api);
        a.kvc_client_destroy(*pc);
        *pc = nullptr;
        *ps = nullptr;
        return st;
    }
    kvc_status cb = a.kvc_session_set_reclaim_callback(*ps, on_reclaim, &h);
    if (cb != KVC_OK) {
        LLAMA_LOG_WARN("kvcached: no reclaim callback (%s: %s): this process only gives pages back when its own cells "
                       "shrink\n",
                       status_name(h.api, cb), last_err(h.api));
    }
    return KVC_OK;
}

// Start the hook's thread, and stop it at exit (stop_thread).
void start_thread(hook & h) {
    {
        std::lock_guard<std::mutex> t(h.worker.mu);
        h.worker.th = std::thread(thread_main, std::ref(h));
    }
    if (h.entries.stop_thread_at_exit) {
        atexit(h.entries.stop_thread_at_exit);  // stop_thread()
    }
}

void log_session(hook & h, kvc_session * s) {
    const settings & c = h.cfg;
    std::string      lab;
    for (auto & [k, val] : c.labels) {
        lab += (lab.empty() ? "" : ",") + k + "=" + val;
    }
    LLAMA_LOG_INFO("kvcached: session %llu \"%s\" at %s (%s pages of %.2f MiB; guaranteed %llu%s, max %llu%s, "
                   "priority %d, labels {%s}; C client %s; an Allocate waits at most %u ms)\n",
                   (unsigned long long) h.api.kvc_session_id(s), c.name.c_str(), c.socket.c_str(), h.link.kind.c_str(),
                   h.link.page / MiB, (unsigned long long) c.guaranteed, c.guaranteed_auto ? " (per model)" : "",
                   (unsigned long long) c.max, c.max_auto ? " (per model)" : "", c.priority, lab.c_str(),
                   h.api.from.c_str(), c.wait_ms);
}

// The page size of the device the session will use (KVCACHED_DEVICE, else
// the daemon's first); 0 when the daemon cannot be asked (the open then
// fails and says why).
uint64_t device_page_size(hook & h) {
    const client_api & a = h.api;
    kvc_client *       c = nullptr;
    if (a.kvc_client_create(h.cfg.socket.c_str(), &c) != KVC_OK) {
        return 0;
    }
    uint64_t page = 0;
    for (size_t i = 0; i < a.kvc_client_device_count(c) && !page; ++i) {
        kvc_device_info d;
        if (a.kvc_client_device(c, i, &d) == KVC_OK && (h.cfg.device.empty() ? i == 0 : h.cfg.device == d.uuid)) {
            page = d.page_size;
        }
    }
    a.kvc_client_destroy(c);
    return page;
}

// The model's own limits (a llama-server router's children all inherit the
// router's KVCACHED_* variables: each gets its own model's figures): the
// maximum when KVCACHED_MAX_BYTES=auto, the guarantee when
// KVCACHED_GUARANTEED_BYTES=auto. Bytes an operator gave always win. `plan`
// gives the first KV buffer's figures for a page size. Fixed for the
// process: a reconnect opens its session with the same. reg held.
void per_model_limits(hook & h, const limits_plan & plan) {
    settings & c = h.cfg;
    if ((!c.max_auto && !c.guaranteed_auto) || !plan) {
        return;
    }
    const uint64_t page = device_page_size(h);
    if (!page) {
        return;
    }
    uint64_t g = 0, m = 0;
    plan(page, g, m);
    if (c.max_auto) {
        c.max = std::max(m, c.guaranteed);
    }
    if (c.guaranteed_auto) {
        c.guaranteed = c.max ? std::min(g, c.max) : g;
    }
}

// At load the daemon may be (re)starting: a supervised restart takes about
// a second, a start on a loaded host several. llama.cpp allocates the KV
// cache once, so a process that loads without the daemon keeps it in
// ordinary memory for life (docs/reliability.md, chaos finding 3). While the
// daemon does not answer (KVC_ERR_UNAVAILABLE: no socket, nobody
// listening), ask again every 100 ms for at most KVCACHED_LOAD_WAIT_MS
// (default: KVCACHED_WAIT_DAEMON_MS), saying once what is done. The ms
// waited (0: it answered at once, or failed otherwise: the open says why).
int64_t reach_daemon_at_load(hook & h) {
    const client_api & a     = h.api;
    const int64_t      start = now_ms();
    for (bool said = false;; said = true) {
        kvc_client * c  = nullptr;
        kvc_status   st = a.kvc_client_create(h.cfg.socket.c_str(), &c);
        if (st == KVC_OK) {
            a.kvc_client_destroy(c);
        }
        const int64_t waited = now_ms() - start;
        if ((st != KVC_ERR_UNAVAILABLE && st != KVC_ERR_DEADLINE_EXCEEDED) || waited >= (int64_t) h.cfg.load_wait_ms) {
            if (said && st == KVC_OK) {
                LLAMA_LOG_INFO("kvcached: the daemon at %s answered after %lld ms\n", h.cfg.socket.c_str(),
                               (long long) waited);
            }
            return said ? waited : 0;
        }
        if (!said) {
            LLAMA_LOG_WARN("kvcached: the daemon at %s does not answer (%s); waiting up to %u ms for it "
                           "(KVCACHED_LOAD_WAIT_MS) before the KV cache is allocated, then in ordinary memory if it "
                           "has not come\n",
                           h.cfg.socket.c_str(), last_err(a), h.cfg.load_wait_ms);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
}

// Open the process's first session (the model's own guarantee dropped if
// the daemon cannot give it); false (logged) when it cannot be opened.
// `waited`: the ms reach_daemon_at_load() waited. reg held.
bool open_first_session(hook & h, int64_t waited) {
    link_state & l = h.link;
    std::string  err;
    kvc_status   st = open_session(h, &l.client, &l.session, err);
    if (st == KVC_ERR_RESOURCE_EXHAUSTED && h.cfg.guaranteed_auto && h.cfg.guaranteed > 0) {
        // a guarantee of the model's own is best effort: better a session
        // without it than a KV cache outside every budget
        LLAMA_LOG_WARN("kvcached: the daemon at %s cannot guarantee this model %.2f MiB (%s); opening the session "
                       "without a guarantee\n",
                       h.cfg.socket.c_str(), h.cfg.guaranteed / MiB, err.c_str());
        h.cfg.guaranteed = 0;
        st               = open_session(h, &l.client, &l.session, err);
    }
    if (st != KVC_OK) {
        const std::string after =
            waited > 0 ? fmt(" after waiting %lld ms for it (KVCACHED_LOAD_WAIT_MS)", (long long) waited) : "";
        LLAMA_LOG_WARN("kvcached: cannot open a session with the daemon at %s (%s: %s)%s; KV cache in ordinary memory "
                       "for this process's life (llama.cpp allocates it once, at load)\n",
                       h.cfg.socket.c_str(), status_name(h.api, st), err.c_str(), after.c_str());
        return false;
    }
    return true;
}

}  // namespace

// The daemon session of this process, opened at the first KV buffer (when
// the model is known: see per_model_limits). nullptr when the variable is
// unset or the hook cannot work (then llama.cpp allocates as before). reg
// held.
kvc_session * session_locked(hook & h, const limits_plan & plan) {
    link_state & l = h.link;
    if (l.m != mode::untried) {
        return l.m == mode::on ? l.session : nullptr;
    }
    l.m            = mode::off;
    const char * v = getenv("OLLAMA_KVCACHED_SOCKET");
    if (!v || !*v) {
        v = getenv("KVCACHED_SOCKET");
    }
    if (!v || !*v) {
        return nullptr;  // not asked for: stay silent
    }
    h.cfg.socket = v;
    if (!read_env(h.cfg) || !load_api(h.api)) {
        return nullptr;
    }
    if (h.cfg.loss_local && !h.api.kvc_region_map_ranges_local) {
        LLAMA_LOG_WARN("kvcached: the C client (%s) has API %d, without local pages (1.5): while the daemon is away, "
                       "batches that need new KV memory fail (KVCACHED_ON_DAEMON_LOSS=local needs 1.5)\n",
                       h.api.from.c_str(), h.api.kvc_api_version());
    }
    const int64_t waited = reach_daemon_at_load(h);
    per_model_limits(h, plan);
    if (!open_first_session(h, waited)) {
        return nullptr;
    }
    l.page = h.api.kvc_session_page_size(l.session);
    l.kind = h.api.kvc_session_kind(l.session);
    l.m    = mode::on;
    log_session(h, l.session);
    if (h.cfg.premap) {
        LLAMA_LOG_INFO("kvcached: KVCACHED_PREMAP: every KV buffer mapped whole when it is made, no page given back "
                       "until it is freed (stock's footprint, in daemon pages)\n");
    }
    start_thread(h);
    return l.session;
}

// Notices a session that ended (daemon gone, not resumable) or is resuming.
// reg held.
void check_session_locked(hook & h) {
    link_state &       l = h.link;
    const client_api & a = h.api;
    if (l.m != mode::on || !l.session || l.lost) {
        return;
    }
    if (a.kvc_session_ended(l.session)) {
        l.lost              = true;
        l.next_reconnect    = now_ms();
        l.reconnect_backoff = 250;
        LLAMA_LOG_WARN("kvcached: lost the daemon at %s (session %llu ended); serving from the %.2f MiB already "
                       "mapped, new KV memory waits for the daemon; reconnecting\n",
                       h.cfg.socket.c_str(), (unsigned long long) a.kvc_session_id(l.session), held_locked(h) / MiB);
        wake_thread(h);
        return;
    }
    if (a.kvc_session_is_resuming(l.session)) {
        if (!l.resuming_said) {
            l.resuming_said = true;
            LLAMA_LOG_WARN("kvcached: the daemon at %s went away; session %llu resumes when it is back; serving from "
                           "the %.2f MiB already mapped\n",
                           h.cfg.socket.c_str(), (unsigned long long) a.kvc_session_id(l.session), held_locked(h) / MiB);
        }
        return;
    }
    const uint64_t r = a.kvc_session_resume_count(l.session);
    if (r != l.resumes_seen) {
        l.resumes_seen  = r;
        l.resuming_said = false;
        l.wait_spent    = false;
        LLAMA_LOG_INFO("kvcached: the daemon at %s is back: session %llu resumed with its pages\n", h.cfg.socket.c_str(),
                       (unsigned long long) a.kvc_session_id(l.session));
    }
}

namespace {  // this file's own

// Adopt the session a reconnect opened; false (logged, no more tries) when
// the daemon came back with other pages than this cache uses. reg held.
bool adopt_session_locked(hook & h, kvc_client * c, kvc_session * s) {
    link_state &       l = h.link;
    const client_api & a = h.api;
    if (a.kvc_session_page_size(s) != l.page || l.kind != a.kvc_session_kind(s)) {
        LLAMA_LOG_ERROR("kvcached: the daemon at %s is back with %s pages of %.2f MiB (this cache uses %s pages of %.2f "
                        "MiB): new KV memory cannot come from it; restart this server\n",
                        h.cfg.socket.c_str(), a.kvc_session_kind(s), a.kvc_session_page_size(s) / MiB, l.kind.c_str(),
                        l.page / MiB);
        a.kvc_session_close(s);
        a.kvc_client_destroy(c);
        l.next_reconnect = LLONG_MAX;
        return false;
    }
    rebind_buffers_locked(h, s);
    // the ended session and its client stay (never closed): a region call
    // on another thread may still be using the old session's mapper
    l.ended_sessions.push_back(l.session);
    l.old_clients.push_back(l.client);
    l.client        = c;
    l.session       = s;
    l.lost          = false;
    l.resuming_said = false;
    l.resumes_seen  = 0;
    l.wait_spent    = false;
    policy_reset_locked(h);
    return true;
}

}  // namespace

// Reconnect after the session ended (hook thread, reg NOT held).
void try_reconnect(hook & h) {
    link_state & l = h.link;
    {
        std::lock_guard<std::mutex> lk(h.locks.reg);
        if (!l.lost || now_ms() < l.next_reconnect) {
            return;
        }
    }
    kvc_client *                c = nullptr;
    kvc_session *               s = nullptr;
    std::string                 err;
    kvc_status                  st = open_session(h, &c, &s, err);
    std::lock_guard<std::mutex> lk(h.locks.reg);
    if (st != KVC_OK) {
        l.next_reconnect    = now_ms() + l.reconnect_backoff;
        l.reconnect_backoff = std::min<int64_t>(l.reconnect_backoff * 2, 2000);
        return;
    }
    if (adopt_session_locked(h, c, s)) {
        LLAMA_LOG_INFO("kvcached: reconnected to the daemon at %s: session %llu; new KV memory comes from it (the %.2f "
                       "MiB mapped before stay in use until their cells are freed)\n",
                       h.cfg.socket.c_str(), (unsigned long long) h.api.kvc_session_id(s), held_locked(h) / MiB);
    }
}

// The daemon is away: the session ended (reconnecting) or is resuming. reg held.
bool daemon_away_locked(hook & h) {
    check_session_locked(h);
    return h.link.lost || h.api.kvc_session_is_resuming(h.link.session);
}

// Wait for the daemon to be back, at most KVCACHED_WAIT_DAEMON_MS (a
// supervised restart takes about a second), releasing reg meanwhile so the
// hook's thread can reconnect. Once a wait ran out, no batch waits again
// until the daemon is back: in an outage longer than a restart, batches go
// to local memory or fail at once (KVCACHED_ON_DAEMON_LOSS; and
// llama-server's retries of a failed batch, halved each time, never wait).
// True when the daemon is back.
bool wait_daemon_locked(hook & h, std::unique_lock<std::mutex> & lk) {
    link_state &  l        = h.link;
    const int64_t start    = now_ms();
    const int64_t deadline = start + h.cfg.wait_daemon_ms;
    if (l.wait_spent) {
        return false;
    }
    wake_thread(h);
    while (now_ms() < deadline) {
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        lk.lock();
        if (!daemon_away_locked(h)) {
            LLAMA_LOG_INFO("kvcached: a batch that needed new KV memory waited %lld ms for the daemon at %s\n",
                           (long long) (now_ms() - start), h.cfg.socket.c_str());
            return true;
        }
    }
    l.wait_spent       = true;
    const bool local   = h.cfg.loss_local && h.api.kvc_region_map_ranges_local;
    LLAMA_LOG_WARN("kvcached: the daemon at %s did not come back within %u ms (KVCACHED_WAIT_DAEMON_MS); until it is "
                   "back, batches that need new KV memory %s\n",
                   h.cfg.socket.c_str(), h.cfg.wait_daemon_ms,
                   local ? "get local device memory outside its budget (KVCACHED_ON_DAEMON_LOSS=local)" :
                           "fail (KVCACHED_ON_DAEMON_LOSS=fail)");
    return false;
}

}  // namespace llama_kvcached_impl

#endif  // !OLLAMA_COMPAT_MTMD_BUILD && LLAMA_KVCACHED
