// kvcached_kv_reclaim.h: the daemon's reclaim requests and the hook's
// thread that serves them, logs deferred KV lines and reconnects. Part of
// the hook (kvcached_kv_reclaim.cpp).
//
// Owns: hook::reclaim (a request pending, set on the client's Watch thread;
// the server's idle-slot release), read without locks.reg.
#pragma once

#include <kvcached.h>

#include <atomic>
#include <cstdint>

// the hook's own: not exported from libllama
#pragma GCC visibility push(hidden)

namespace llama_kvcached_impl {

struct hook;

struct reclaim_state {
    std::atomic<bool>     pending{ false };
    std::atomic<uint64_t> bytes{ 0 };
    std::atomic<uint64_t> id{ 0 };  // the latest request's id (API 1.3; answering one settles the device's)
    void (*idle_release)(void *, uint64_t) = nullptr;  // under locks.server
    void * idle_user                        = nullptr;
};

// Answer the pending reclaim request, with the server lock held.
void serve_reclaim_server_locked(hook & h);

// The C client's reclaim callback (`user`: the hook).
void on_reclaim(void * user, const kvc_reclaim * rq);

// The hook's own thread.
void thread_main(hook & h);

}  // namespace llama_kvcached_impl

#pragma GCC visibility pop
