// kvcached_kv_cells.h: cells to pages: back the cells a batch needs (asking
// the daemon only for what the mapped pages do not cover), give back what
// the cells no longer use, and say why a batch could not be backed. Part of
// the hook (kvcached_kv_cells.cpp).
//
// Owns: the decode path's policy (hook::policy), under locks.reg.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

// the hook's own: not exported from libllama
#pragma GCC visibility push(hidden)

namespace llama_kvcached_impl {

struct hook;
struct kv_cache;

struct decode_policy {
    int64_t     no_wait_until = 0;      // after a refusal, Allocates do not wait until then
    bool        wait_set      = false;  // the session's wait switch is known
    bool        wait_on       = false;
    std::string last_error;             // why the last batch could not be backed ("" = it could)
    std::string logged_error;           // the last one logged, and when: the retries of one
    int64_t     logged_error_at = 0;    // request (llama-server halves the batch) log it once
    std::atomic<bool> trim_pending{ false };  // a trim is owed (asked without the server lock, or while the
                                              // daemon was away): done at the next batch
    std::atomic<bool> reclaim_trim{ false };  // that owed trim answers a reclaim: it keeps nothing as standby
    bool              no_standby   = false;   // trims give every page back (while a reclaim is served)
    uint64_t          local_total  = 0;       // bytes ever backed with local pages (KVCACHED_ON_DAEMON_LOSS=local)
    int64_t           local_logged = 0;       // when that was last logged
    int64_t           last_batch   = 0;       // now_ms() at the last batch or cache trim (KVCACHED_STANDBY_IDLE_MS)
};

// A new session: its wait switch is unknown, no refusal from it yet. reg held.
void policy_reset_locked(hook & h);

// Back cells [0, need[s]) of every stream. reg held (by lk; released while
// waiting for a daemon that is away). On failure policy.last_error says why.
bool map_locked(hook & h, kv_cache * c, const std::vector<uint32_t> & need, std::unique_lock<std::mutex> & lk);

// The cells kept mapped for `used` cells: rounded up to n_pad.
uint32_t keep_cells(const kv_cache * c, uint32_t used);

// Unmap what the cells of c do not use. reg held.
void trim_locked(hook & h, kv_cache * c);
void trim_all_locked(hook & h);

// A trim owed is done before anything else; true when there was one. reg held.
bool trim_owed_locked(hook & h);

// Give standby pages back, up to `bytes` (UINT64_MAX: all); the bytes given. reg held.
uint64_t release_standby_locked(hook & h, uint64_t bytes);

// KVCACHED_STANDBY_BYTES split over the KV buffers by size. reg held.
void standby_limits_locked(hook & h);

}  // namespace llama_kvcached_impl

#pragma GCC visibility pop
