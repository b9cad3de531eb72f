// kvcached_kv_link.h: the process's daemon session: opened on first use,
// watched for the daemon's loss, resumed or reconnected, and waited for.
// Part of the hook (kvcached_kv_link.cpp).
//
// Owns: the locks (hook::locks), the session and its liveness (hook::link),
// and the hook's thread (hook::worker).
//
// Lock order: locks.server (the server's main loop; recursive) before
// locks.reg. locks.reg guards the link, the books (kvcached_kv_books.h) and
// the decode policy (kvcached_kv_cells.h): a batch maps pages of a buffer
// through the session, so the three change together. worker.mu guards only
// the thread's own fields and the reclaim reason; it is never held while
// taking another lock.
#pragma once

#include <kvcached.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// the hook's own: not exported from libllama
#pragma GCC visibility push(hidden)

namespace llama_kvcached_impl {

struct hook;

struct locks {
    std::mutex           reg;
    std::recursive_mutex server;  // llama_kvcached_lock: the server's main loop holds it
};

enum class mode { untried, off, on };

struct link_state {
    mode                       m       = mode::untried;
    kvc_client *               client  = nullptr;
    kvc_session *              session = nullptr;
    std::vector<kvc_session *> ended_sessions;  // kept: regions may have been rebound away from them
    std::vector<kvc_client *>  old_clients;
    uint64_t                   page = 0;
    std::string                kind;

    bool     lost              = false;  // the session ended: reconnecting
    bool     resuming_said     = false;
    uint64_t resumes_seen      = 0;
    int64_t  next_reconnect    = 0;
    int64_t  reconnect_backoff = 250;
    bool     wait_spent        = false;  // a wait for the daemon ran out: no more waiting until it is back
};

struct worker_state {
    std::mutex              mu;
    std::condition_variable cv;
    std::string             reclaim_reason;  // the latest reclaim request's
    bool                    stop   = false;
    bool                    exited = false;
    std::thread             th;
};

// (page size, guarantee out, maximum out): the model's own limits
using limits_plan = std::function<void(uint64_t, uint64_t &, uint64_t &)>;

void wake_thread(hook & h);

// Stop the hook's thread (at exit): if it is stuck (a reconnect in
// progress, or exit() called with the server lock held) leave it rather
// than hang.
void stop_thread(hook & h);

// The daemon session of this process, opened at the first KV buffer.
// nullptr when the variable is unset or the hook cannot work. reg held.
kvc_session * session_locked(hook & h, const limits_plan & plan);

// Notices a session that ended (daemon gone, not resumable) or is resuming.
// reg held.
void check_session_locked(hook & h);

// Reconnect after the session ended (hook thread, reg NOT held).
void try_reconnect(hook & h);

// The daemon is away: the session ended (reconnecting) or is resuming. reg held.
bool daemon_away_locked(hook & h);

// Wait for the daemon to be back, at most KVCACHED_WAIT_DAEMON_MS, releasing
// reg (held by lk) meanwhile. True when the daemon is back.
bool wait_daemon_locked(hook & h, std::unique_lock<std::mutex> & lk);

}  // namespace llama_kvcached_impl

#pragma GCC visibility pop
