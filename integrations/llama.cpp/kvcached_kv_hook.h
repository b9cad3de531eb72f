// kvcached_kv_hook.h: the hook's state, one object that every part is
// given (docs/llama-cpp.md, "The hook's parts"). Which object a call uses
// is decided by the entry points alone (kvcached_kv.cpp: one per process,
// made at the first entry and never destroyed); the parts keep no state of
// their own (tests/llama/test_hook_state.py checks it).
#pragma once

#include "kvcached_kv_books.h"
#include "kvcached_kv_cells.h"
#include "kvcached_kv_client.h"
#include "kvcached_kv_link.h"
#include "kvcached_kv_reclaim.h"

#include <cstdlib>

// the hook's own: not exported from libllama
#pragma GCC visibility push(hidden)

namespace llama_kvcached_impl {

// What ggml and atexit call back: the entry file's functions, which find
// the process's hook and call the parts with it.
struct hook_entries {
    buffer_entries buffer;
    void (*stop_thread_at_exit)() = nullptr;  // atexit, once the hook's thread runs
    void (*print_stats_at_exit)() = nullptr;  // atexit, with KVCACHED_HOOK_STATS
};

struct hook {
    const hook_entries entries;
    hook_stats         stats;    // kvcached_kv_client.h
    client_api         api;      // kvcached_kv_client.h
    settings           cfg;      // kvcached_kv_client.h
    struct locks       locks;    // kvcached_kv_link.h
    link_state         link;     // kvcached_kv_link.h
    worker_state       worker;   // kvcached_kv_link.h
    struct books       books;    // kvcached_kv_books.h
    decode_policy      policy;   // kvcached_kv_cells.h
    reclaim_state      reclaim;  // kvcached_kv_reclaim.h

    explicit hook(const hook_entries & e) : entries(e) {
        stats.on = stats_wanted();
        if (stats.on && entries.print_stats_at_exit) {
            atexit(entries.print_stats_at_exit);
        }
    }
    hook(const hook &)             = delete;
    hook & operator=(const hook &) = delete;
};

}  // namespace llama_kvcached_impl

#pragma GCC visibility pop
