/*
 * kvcached.h: C client of kvcached-serve, the per-host KV-cache memory daemon.
 *
 * The daemon lends physical memory pages (GPU pages through the CUDA driver's
 * VMM API, or host memfd pages) to client processes. This library talks to it
 * (gRPC on a Unix socket, behind this C ABI), receives the pages' file
 * descriptors on the fd channel, and maps them into this process:
 *
 *   kvc_client   a connection to one daemon (its control socket)
 *   kvc_session  one session of that daemon, bound to one device; the unit
 *                of accounting, limits and reclaim. Its pages return to the
 *                daemon when it closes or when this process exits.
 *   kvc_region   a reservation of address space (host or device virtual
 *                addresses) in which any page-aligned range can be mapped
 *                with daemon pages and unmapped again. What a llama.cpp KV
 *                buffer is built on.
 *
 * Conventions
 *   - Every function that can fail returns a kvc_status; KVC_OK is 0. On
 *     failure kvc_last_error() gives a message that says what was wrong (per
 *     calling thread). No C++ exception, abort or signal crosses this ABI.
 *   - Objects come in create/destroy pairs (kvc_client_create/_destroy,
 *     kvc_session_open/_close, kvc_region_create/_destroy). Destroy functions
 *     accept NULL.
 *   - Thread safety is stated per function: "thread-safe" means any thread
 *     may call it concurrently with any other thread-safe function on the
 *     same object; "not thread-safe" means the caller serialises it against
 *     every other call on that object.
 *   - Sizes and offsets are bytes (uint64_t). Device addresses (CUDA) are
 *     returned as void*; do not dereference them on the CPU.
 */
#ifndef KVCACHED_H
#define KVCACHED_H

#include <stddef.h>
#include <stdint.h>

/* API version: KVC_API_VERSION = major * 10000 + minor * 100 + patch.
 * kvc_api_version() returns the version of the library actually loaded. */
#define KVC_API_VERSION_MAJOR 1
#define KVC_API_VERSION_MINOR 7
#define KVC_API_VERSION_PATCH 0
#define KVC_API_VERSION \
    (KVC_API_VERSION_MAJOR * 10000 + KVC_API_VERSION_MINOR * 100 + KVC_API_VERSION_PATCH)

/* Export macros. Build the library with KVC_BUILDING (and KVC_SHARED for the
 * shared library); consumers define nothing. */
#if defined(_WIN32)
#  if defined(KVC_BUILDING) && defined(KVC_SHARED)
#    define KVC_API __declspec(dllexport)
#  else
#    define KVC_API
#  endif
#elif defined(__GNUC__) || defined(__clang__)
#  define KVC_API __attribute__((visibility("default")))
#else
#  define KVC_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Status codes                                                             */

/* The closed set of outcomes. The first block mirrors the daemon's gRPC
 * status codes (docs/protocol.md, "Status codes"); the second block is for
 * failures inside this process. The mapping from gRPC lives in one place
 * (src/status.cc). */
typedef enum kvc_status {
    KVC_OK = 0,
    KVC_ERR_INVALID_ARGUMENT = 1,    /* malformed request (here or at the daemon)          */
    KVC_ERR_NOT_FOUND = 2,           /* unknown session, device, page or pointer           */
    KVC_ERR_PERMISSION_DENIED = 3,   /* token mismatch, admin rpc without admin, uid       */
    KVC_ERR_RESOURCE_EXHAUSTED = 4,  /* budget, session maximum, or kvc_session_set_limit  */
    KVC_ERR_FAILED_PRECONDITION = 5, /* session ended / closed; object still in use        */
    KVC_ERR_UNAVAILABLE = 6,         /* daemon not reachable or shutting down              */
    KVC_ERR_DEADLINE_EXCEEDED = 7,   /* a timeout of the caller ran out                    */
    KVC_ERR_INTERNAL = 8,            /* the daemon's backend failed (message names it)     */
    KVC_ERR_UNKNOWN = 9,             /* a gRPC status with no meaning in this API          */
    KVC_ERR_PROTOCOL = 10,           /* the daemon broke docs/protocol.md (fd channel, version) */
    KVC_ERR_DRIVER = 11,             /* local CUDA driver missing or a driver call failed  */
    KVC_ERR_SYSTEM = 12,             /* a local system call failed (errno in the message)  */
    KVC_ERR_NO_MEMORY = 13           /* out of local memory or address space               */
} kvc_status;

#define KVC_STATUS_COUNT 14

/* Constant name of a status ("KVC_ERR_NOT_FOUND"); "KVC_STATUS_INVALID" for
 * values outside the enum. Thread-safe. */
KVC_API const char *kvc_status_to_string(kvc_status status);

/* The message of the last failed call made by this thread ("" if none).
 * Valid until this thread's next call into the library. Thread-safe. */
KVC_API const char *kvc_last_error(void);

/* KVC_API_VERSION of the loaded library. Thread-safe. */
KVC_API int kvc_api_version(void);

/* ------------------------------------------------------------------------ */
/* Client: one daemon                                                       */

typedef struct kvc_client kvc_client;
typedef struct kvc_session kvc_session;
typedef struct kvc_region kvc_region;

/* The daemon socket named by the environment: OLLAMA_KVCACHED_SOCKET, else
 * KVCACHED_SOCKET; NULL if neither is set (or set to ""). Thread-safe (as
 * getenv). */
KVC_API const char *kvc_socket_from_env(void);

/* Connect to the daemon at `socket_path` (a filesystem path of the control
 * socket). NULL means kvc_socket_from_env(), else "/tmp/kvcached.sock".
 * Calls GetInfo; fails with KVC_ERR_UNAVAILABLE when no daemon answers
 * within the client's timeout (default 5000 ms) and KVC_ERR_PROTOCOL when
 * the daemon speaks another api or fd protocol version. Thread-safe. */
KVC_API kvc_status kvc_client_create(const char *socket_path, kvc_client **out);

/* Drop the client. Open sessions keep the connection they need and stay
 * usable until kvc_session_close. Not thread-safe. NULL is a no-op. */
KVC_API void kvc_client_destroy(kvc_client *client);

/* Deadline for every rpc of this client and its sessions, in milliseconds
 * (0 = none; default 5000). Thread-safe. */
KVC_API void kvc_client_set_timeout(kvc_client *client, uint32_t timeout_ms);

typedef struct kvc_device_info {
    const char *uuid;     /* "GPU-xxxxxxxx-xxxx-..." or "HOST-0"     */
    const char *name;
    const char *kind;     /* "cuda" or "host": how pages are mapped  */
    uint64_t page_size;
    uint64_t granularity;
    uint64_t total_bytes;
    uint64_t budget_bytes;
} kvc_device_info;

/* Facts from GetInfo at connect time. Strings are owned by the client and
 * live until kvc_client_destroy. Thread-safe. */
KVC_API const char *kvc_client_daemon_version(const kvc_client *client);
KVC_API const char *kvc_client_backend(const kvc_client *client);
KVC_API size_t kvc_client_device_count(const kvc_client *client);
KVC_API kvc_status kvc_client_device(const kvc_client *client, size_t index, kvc_device_info *out);

/* ------------------------------------------------------------------------ */
/* Sessions                                                                 */

typedef struct kvc_label {
    const char *key;
    const char *value;
} kvc_label;

typedef struct kvc_session_options {
    size_t struct_size;         /* set by kvc_session_options_init          */
    const char *name;           /* 1-128 printable characters (required)    */
    const char *device;         /* device uuid; NULL = the daemon's first   */
    uint64_t guaranteed_bytes;  /* never reclaimed from this session        */
    uint64_t max_bytes;         /* 0 = the device budget                    */
    int32_t priority;           /* lower is asked to give back first        */
    const kvc_label *labels;    /* at most 16                               */
    size_t num_labels;
    /* When an allocation cannot be met at once, let the daemon reclaim from
     * other sessions and wait up to wait_timeout_ms (0 = daemon default). */
    int wait;
    uint32_t wait_timeout_ms;
} kvc_session_options;

/* Fill defaults (everything zero, struct_size set). Thread-safe. */
KVC_API void kvc_session_options_init(kvc_session_options *options);

/* Open a session: GetInfo's fd channel is connected, the HELLO read, and
 * OpenSession called with its secret. For a "cuda" device the CUDA driver
 * is loaded (dlopen of $KVCACHED_LIBCUDA, default libcuda.so.1), the local
 * ordinal with the device's UUID found, and its primary context retained.
 * Page operations (Allocate, Free, Close) go on the fd channel only: a
 * daemon that does not take them there (GetInfo().fd_channel_requests
 * false, daemons before the feature) is KVC_ERR_FAILED_PRECONDITION, said
 * before any channel is connected (since 1.4; before, they went over gRPC).
 * Thread-safe. */
KVC_API kvc_status kvc_session_open(kvc_client *client, const kvc_session_options *options,
                                    kvc_session **out);

/* Close: CloseSession at the daemon, then the fd channel. Fails with
 * KVC_ERR_FAILED_PRECONDITION (and closes nothing) while regions or
 * kvc_session_alloc blocks of the session are alive, or when called from
 * the session's own reclaim callback. If the daemon is gone the session is
 * closed locally and KVC_OK returned. Not thread-safe. NULL is a no-op. */
KVC_API kvc_status kvc_session_close(kvc_session *session);

/* Session facts. Thread-safe. */
KVC_API uint64_t kvc_session_id(const kvc_session *session);
KVC_API uint64_t kvc_session_page_size(const kvc_session *session);
KVC_API const char *kvc_session_device(const kvc_session *session); /* uuid */
KVC_API const char *kvc_session_kind(const kvc_session *session);   /* "cuda" / "host" */
/* Bytes of daemon pages this session holds, by this library's books. */
KVC_API uint64_t kvc_session_held_bytes(const kvc_session *session);
/* Nonzero once the session is over: the daemon ended it (GOODBYE/ERROR on
 * the fd channel, SHUTDOWN on Watch, or the channel closed on a session
 * that cannot be resumed), the daemon broke the fd channel protocol, or a
 * resume failed (see below). Every call that needs the daemon then fails
 * with the end's status and kvc_last_error() says why:
 * KVC_ERR_FAILED_PRECONDITION ("session N ended: ..." for GOODBYE,
 * SHUTDOWN and a hang-up without resume token), an ERROR record's own code
 * and message, KVC_ERR_INTERNAL ("fd channel protocol error: ...").
 * Thread-safe. */
KVC_API int kvc_session_ended(const kvc_session *session);

/* Kept handles (since 1.6; docs/protocol.md "Kept handles"): on a CUDA
 * device of a daemon that offers it (GetInfo().fd_channel_keep_handles),
 * the session keeps the imported handle of each page it maps, up to
 * $KVCACHED_KEEP_HANDLES pages (default 8192; 0: never keep), and maps a
 * page that comes back to it from that handle, without an import. Its
 * Frees say so (FREE's keep flag); the daemon asks for a handle back (DROP)
 * before it releases the page, and the library answers at once from its
 * reader. Every kept handle is released when the session ends and before a
 * resume. This says how many page handles the session keeps now (0 on host
 * devices). Thread-safe. */
KVC_API uint64_t kvc_session_kept_handles(const kvc_session *session);

/* ---- resume after a daemon restart (since 1.1) -----------------------
 *
 * When the daemon keeps a journal (kvcached-serve --state-dir), OpenSession
 * gives the session a resume token and the session survives a daemon crash
 * or restart: the library keeps a duplicate fd of every page it holds, a
 * background thread notices the fd channel hang up, reconnects (backoff
 * 50 ms doubling to 1 s, for up to 120 s), re-sends the pages (ADOPT) and
 * calls ResumeSession; the session goes on with the same id and pages.
 *
 * While it is resuming, calls that need the daemon (map, alloc, stats,
 * request_shrink, the reclaim callback's registration) fail with
 * KVC_ERR_UNAVAILABLE and kvc_last_error() says that the daemon is
 * unreachable, that the session resumes when it is back and that the pages
 * held stay usable: mapped memory, kvc_region_read/write/memset/clear keep
 * working. Unmapping and freeing work too: the pages are unmapped here and
 * are not claimed at the resume, which gives them back (KVC_OK). A Watch
 * thread (reclaim callback) is reconnected after the resume. If the daemon
 * refuses the claim or does not come back in time, the session ends
 * (kvc_session_ended() == 1, KVC_ERR_FAILED_PRECONDITION "... could not be
 * resumed ..."); mapped memory stays readable until unmapped.
 *
 * A resumable session holds one extra fd per page (the library raises the
 * soft RLIMIT_NOFILE to the hard limit once if it runs out). */

/* Nonzero if the daemon gave this session a resume token. Thread-safe. */
KVC_API int kvc_session_is_resumable(const kvc_session *session);

/* Nonzero while the session is being resumed (the daemon went away and the
 * session has not been resumed or ended yet). Thread-safe. */
KVC_API int kvc_session_is_resuming(const kvc_session *session);

/* Number of successful resumes so far. Thread-safe. */
KVC_API uint64_t kvc_session_resume_count(const kvc_session *session);

/* Wait until the session is usable: KVC_OK at once when it is not
 * resuming, else when the resume is done; KVC_ERR_DEADLINE_EXCEEDED after
 * timeout_ms; KVC_ERR_FAILED_PRECONDITION if the session ended (e.g. the
 * resume was refused) or is not resumable. Thread-safe. */
KVC_API kvc_status kvc_session_wait_resumed(kvc_session *session, uint32_t timeout_ms);

typedef struct kvc_pool_stats {
    uint64_t budget_bytes;
    uint64_t pooled_bytes;  /* created pages held by no session            */
    uint64_t in_use_bytes;  /* pages held by sessions                      */
    uint64_t free_bytes;    /* budget not backed by any page               */
    uint64_t page_size;
    uint64_t pages_pooled;
    uint64_t pages_in_use;
} kvc_pool_stats;

typedef struct kvc_stats {
    size_t struct_size;     /* set by the caller: sizeof(kvc_stats)        */
    kvc_pool_stats total;   /* all devices                                 */
    kvc_pool_stats device;  /* the session's device                        */
    /* This session as the daemon sees it. */
    uint64_t held_bytes;
    uint64_t pages_held;
    uint64_t guaranteed_bytes;
    uint64_t max_bytes;
    int32_t priority;
    uint64_t reclaim_ignored;
    uint64_t allocations_total;
    uint64_t frees_total;
    uint32_t pid;           /* the session's peer pid as the daemon saw it */
    uint32_t sessions_open;
    double uptime_seconds;
    /* Since 1.7 (read them only when the returned struct_size covers them):
     * standby pages (kvc_region_unmap_ranges_standby) as the daemon counts
     * them, this session's (SessionStats.standby_bytes, part of held_bytes)
     * and its device's (PoolStats.standby_bytes, part of in_use_bytes). */
    uint64_t standby_bytes;
    uint64_t device_standby_bytes;
} kvc_stats;

/* GetStats for this session and its device. Thread-safe. */
KVC_API kvc_status kvc_session_get_stats(kvc_session *session, kvc_stats *out);

/* ---- reclaim -------------------------------------------------------- */

typedef struct kvc_reclaim {
    const char *device;     /* device uuid                                 */
    uint64_t pages;         /* pages the daemon asks for (at least)        */
    uint64_t bytes;         /* pages * page size                           */
    double deadline_unix;   /* Unix time by which they are needed          */
    const char *reason;     /* "allocate", "idle", "admin"                 */
    /* Since 1.3: the request's id (Reclaim.id, unique for the daemon's
     * life), for kvc_session_answer_reclaim. A callback built against 1.3
     * that may run with an older library checks kvc_api_version() >= 10300
     * before reading it. */
    uint64_t id;
} kvc_reclaim;

/* Called on the session's background Watch thread when the daemon asks the
 * session to give pages back. Answer by unmapping (kvc_region_unmap*,
 * kvc_session_free) from the callback or from another thread before the
 * deadline. The pointers in `request` are valid during the call only. The
 * callback may call any thread-safe function of this library except
 * kvc_session_close / kvc_client_destroy. */
typedef void (*kvc_reclaim_fn)(void *user_data, const kvc_reclaim *request);

/* Register (or with NULL, remove) the reclaim callback. The first call
 * starts the Watch thread (it runs until the session closes) and returns
 * once the stream is established (the daemon's READY event). Thread-safe. */
KVC_API kvc_status kvc_session_set_reclaim_callback(kvc_session *session, kvc_reclaim_fn fn,
                                                    void *user_data);

/* Answer the reclaim request `reclaim_id` (kvc_reclaim.id) at once: the
 * bytes this session gave back for it (already unmapped and freed), the
 * bytes it keeps on the request's device, and why (`reason`: UTF-8, at most
 * 1024 bytes, may be NULL or ""), e.g. "the rest is in use by busy slots".
 * Sent as an ANSWER record on the session's fd channel (docs/protocol.md
 * "The reclaim answer"); returns when the daemon's REPLY arrives. The
 * request is then settled: the daemon waits no longer for the rest, does not
 * count it as ignored nor ask this session again before the request's
 * deadline, and a `RequestShrink` with wait (`kvcachedctl shrink`) returns
 * the answer. Answering any id of a device's open request settles it.
 * May be called from the reclaim callback. Errors: KVC_ERR_NOT_FOUND for
 * an id this session was never sent (or settled more than 10 minutes ago);
 * KVC_ERR_INVALID_ARGUMENT for a reason over 1024 bytes; KVC_ERR_UNAVAILABLE
 * while the session is being resumed; KVC_ERR_FAILED_PRECONDITION when the
 * session ended. Since 1.3. Thread-safe. */
KVC_API kvc_status kvc_session_answer_reclaim(kvc_session *session, uint64_t reclaim_id,
                                              uint64_t bytes_given, uint64_t bytes_kept,
                                              const char *reason);

/* Wait until the daemon reports memory available on the session's device
 * (a MEMORY_AVAILABLE event) or timeout_ms passes (KVC_ERR_DEADLINE_EXCEEDED).
 * Starts the Watch thread if needed. Thread-safe. */
KVC_API kvc_status kvc_session_wait_available(kvc_session *session, uint32_t timeout_ms);

/* ---- admin (sessions whose peer uid the daemon lists as admin) ------- */

/* Ask session `target_id` to shrink to `target_bytes` (delivered as a
 * reclaim request with reason "admin"); *pages_requested (may be NULL)
 * gets how many pages were asked for. KVC_ERR_PERMISSION_DENIED when this
 * session is not an admin session. Thread-safe. */
KVC_API kvc_status kvc_session_request_shrink(kvc_session *session, uint64_t target_id,
                                              uint64_t target_bytes, uint32_t timeout_ms,
                                              uint64_t *pages_requested);

/* Nonzero if the daemon granted this session admin rights. Thread-safe. */
KVC_API int kvc_session_is_admin(const kvc_session *session);

/* ---- malloc-style blocks (the seed note's kvcached_alloc/free/available/
 *      set_limit) --------------------------------------------------------- */

/* Allocate `size` bytes (rounded up to whole pages), mapped and zeroed, at a
 * page-aligned address: a host pointer for "host" sessions, a device pointer
 * for "cuda" sessions. One Allocate (an ALLOCATE request on the fd
 * channel). Thread-safe. */
KVC_API kvc_status kvc_session_alloc(kvc_session *session, size_t size, void **ptr);

/* Give a block from kvc_session_alloc back (unmapped, then Free). NULL is a
 * no-op; an unknown pointer is KVC_ERR_NOT_FOUND. Thread-safe. */
KVC_API kvc_status kvc_session_free(kvc_session *session, void *ptr);

/* Bytes this session could map now without anyone giving pages back:
 * budget not in use on its device, capped by the session's maximum and by
 * kvc_session_set_limit, minus what it holds. One GetStats rpc. Thread-safe. */
KVC_API kvc_status kvc_session_available(kvc_session *session, uint64_t *bytes);

/* A cap, in this process, on the bytes the session holds (all regions and
 * blocks); 0 removes it. Mapping past it fails with
 * KVC_ERR_RESOURCE_EXHAUSTED before asking the daemon. Lowering it below
 * what is held unmaps nothing. Thread-safe. */
KVC_API kvc_status kvc_session_set_limit(kvc_session *session, uint64_t limit_bytes);
KVC_API uint64_t kvc_session_limit(const kvc_session *session);

/* Change how this session's later Allocates wait when the pages are not
 * available at once (kvc_session_options.wait / wait_timeout_ms): with
 * wait nonzero the daemon may ask other sessions to give pages back and
 * waits up to wait_timeout_ms (0 = the daemon's default) before failing with
 * KVC_ERR_RESOURCE_EXHAUSTED; with wait 0 it fails at once. An Allocate
 * already in flight keeps its setting. For a caller on a latency-sensitive
 * path (a llama.cpp decode) that must fail fast after a refusal. Since 1.2.
 * Thread-safe. */
KVC_API kvc_status kvc_session_set_wait(kvc_session *session, int wait, uint32_t wait_timeout_ms);

/* ---- pages as descriptors (since 1.4) ----------------------------------
 *
 * The daemon's pages themselves, unmapped: for a program that maps them its
 * own way or hands a page to another process (the descriptor is a memfd on
 * "host", a CUDA POSIX handle on "cuda"; docs/protocol.md "PAGES"). Regions
 * and blocks are built on the same two operations. */

/* Borrow `num_pages` pages (1..2^32-1) in one Allocate (split only past the
 * daemon's max_pages_per_request); all or nothing. page_ids[i] and fds[i]
 * (arrays of num_pages, filled in the daemon's order) are the i-th page and
 * its descriptor: the caller owns the descriptors (close them; the pages
 * stay the session's until kvc_session_free_pages). On a resumable session
 * the library keeps a duplicate of each for a resume. Errors as
 * kvc_region_map. Thread-safe. */
KVC_API kvc_status kvc_session_alloc_pages(kvc_session *session, uint32_t num_pages,
                                           uint64_t *page_ids, int *fds);

/* Give pages back by id (all or nothing; unmap them first), in FREE records
 * of at most 16384 ids each. *pages_freed (may be NULL) gets how many were
 * freed. KVC_ERR_NOT_FOUND for a page this session does not hold,
 * KVC_ERR_INVALID_ARGUMENT for none or an id named twice,
 * KVC_ERR_FAILED_PRECONDITION (or the status it ended with) once the
 * session ended. While a resumable session is being resumed, or when the
 * daemon goes away before it answers, the Free succeeds at once, checked as
 * the daemon would: the pages are not claimed at the resume, which gives
 * them back. Thread-safe. */
KVC_API kvc_status kvc_session_free_pages(kvc_session *session, const uint64_t *page_ids,
                                          size_t num_pages, uint64_t *pages_freed);

/* ------------------------------------------------------------------------ */
/* Regions                                                                  */

/* Reserve `max_bytes` of address space (rounded up to the session's page
 * size; device virtual addresses on "cuda"), with nothing mapped. The
 * region belongs to the session, which must outlive it. Thread-safe. */
KVC_API kvc_status kvc_region_create(kvc_session *session, uint64_t max_bytes, kvc_region **out);

/* Unmap every page, give the pages back in one Free, release the
 * reservation. Not thread-safe (no other call on the region may run).
 * NULL is a no-op. */
KVC_API void kvc_region_destroy(kvc_region *region);

/* Facts. Thread-safe. */
KVC_API void *kvc_region_base(const kvc_region *region);
KVC_API uint64_t kvc_region_size(const kvc_region *region);
KVC_API uint64_t kvc_region_page_size(const kvc_region *region);
/* Physical bytes mapped now (pages mapped * page size); standby pages
 * (since 1.7) are not counted: kvc_region_standby_bytes. */
KVC_API uint64_t kvc_region_mapped_bytes(const kvc_region *region);

typedef struct kvc_range {
    uint64_t offset; /* from the region's base */
    uint64_t size;
} kvc_range;

/* Make sure every byte of [offset, offset+size) is mapped: the range is
 * widened to whole pages, pages already mapped stay as they are, and all
 * missing pages come from ONE Allocate (split only past the daemon's
 * max_pages_per_request). All or nothing: on failure nothing new stays
 * mapped. New pages read as zeros. A range past the region's end is
 * KVC_ERR_INVALID_ARGUMENT. Thread-safe (calls on one region serialise). */
KVC_API kvc_status kvc_region_map(kvc_region *region, uint64_t offset, uint64_t size);

/* The same for several ranges at once (for a KV buffer: the prefix of every
 * layer's K and V tensor), still one Allocate for all missing pages. */
KVC_API kvc_status kvc_region_map_ranges(kvc_region *region, const kvc_range *ranges,
                                         size_t num_ranges);

/* Unmap the pages lying wholly inside [offset, offset+size) (the range is
 * narrowed to whole pages, so no byte outside it is ever unmapped) and give
 * them back to the daemon in one Free. A range that runs to the region's end
 * (offset + size >= the max_bytes it was created with) runs to the end of
 * its last page: the bytes past max_bytes are the region's own padding, so
 * every page can be given back (since 1.2). Unmapped pages in the range are
 * skipped. Each run of adjacent pages is unmapped with one call (on CUDA one
 * cuMemUnmap over the run), a run the driver refuses page by page; a page
 * that cannot be unmapped stays mapped and is not given back, and the first
 * error is returned. Thread-safe (calls on one region serialise). */
KVC_API kvc_status kvc_region_unmap(kvc_region *region, uint64_t offset, uint64_t size);
KVC_API kvc_status kvc_region_unmap_ranges(kvc_region *region, const kvc_range *ranges,
                                           size_t num_ranges);

/* Move a region to another session after its own session ended (the
 * daemon went away without a state directory, or ended the session): pages
 * mapped now stay mapped and readable, but no daemon counts them any more
 * (the one that lent them is gone); unmapping them is local only. New
 * pages come from `session`, which must lend the same kind of pages of the
 * same size on the same device (KVC_ERR_INVALID_ARGUMENT otherwise).
 * KVC_ERR_FAILED_PRECONDITION while the region's session is still live. The
 * old session may be closed afterwards. For a long-lived user of a region
 * (a llama.cpp KV cache) that reconnects to a restarted daemon. Since 1.2.
 * Not thread-safe (no other call on the region may run). */
KVC_API kvc_status kvc_region_rebind(kvc_region *region, kvc_session *session);

/* Map the unmapped pages covering the ranges with memory of this process's
 * own, not the daemon's: an anonymous mapping on "host", cuMemCreate on
 * "cuda" (ordinary device memory outside every budget; the daemon sees it
 * only as memory in use on the device). No daemon is asked, so it works while
 * the daemon is away or the session ended. Pages already mapped stay as they
 * are. All or nothing: on failure nothing new stays mapped
 * (KVC_ERR_NO_MEMORY when the device or host has no memory for them). Local
 * pages count in kvc_region_mapped_bytes and kvc_region_local_bytes; unmapping
 * them (kvc_region_unmap*, kvc_region_destroy) frees them with no Free to the
 * daemon; kvc_region_rebind keeps them. New local pages read as zeros. For a KV
 * cache that must keep serving while the daemon is away (the llama.cpp
 * hook's KVCACHED_ON_DAEMON_LOSS=local). Since 1.5. Thread-safe (calls on one
 * region serialise). */
KVC_API kvc_status kvc_region_map_ranges_local(kvc_region *region, const kvc_range *ranges,
                                               size_t num_ranges);

/* kvc_region_unmap_ranges for local pages only: the local pages lying wholly
 * inside the ranges are unmapped and freed, every other page stays (no Free
 * is sent; works while the daemon is away). Since 1.5. Thread-safe. */
KVC_API kvc_status kvc_region_unmap_ranges_local(kvc_region *region, const kvc_range *ranges,
                                                 size_t num_ranges);

/* Bytes of the region mapped with local pages now (kvc_region_map_ranges_local).
 * Since 1.5. Thread-safe. */
KVC_API uint64_t kvc_region_local_bytes(const kvc_region *region);

/* ---- standby pages (since 1.7; docs/protocol.md "Standby pages") -------
 *
 * A KV cache's slot grows, is trimmed when its request ends, and grows again
 * with the next request. Instead of giving the trimmed pages back and
 * allocating them again (a round trip, and on CUDA an unmap and a map per
 * page), a region may keep them mapped as standby: still the session's
 * pages, counted by the daemon as held (SessionStats.standby_bytes), but
 * unmapped from the caller's view: kvc_region_mapped_bytes and
 * kvc_region_is_mapped leave them out, kvc_region_read/write refuse them
 * (KVC_ERR_FAILED_PRECONDITION), kvc_region_memset/clear skip them. A later
 * kvc_region_map* of their range takes them back with no Allocate and no
 * driver call (one USE record, not waited for) and allocates only what is
 * missing; their bytes are what they were (standby pages are not zeroed).
 * A plain kvc_region_unmap* of their range unmaps and frees them, and so do
 * kvc_region_destroy and kvc_region_release_standby. A daemon's reclaim asks
 * sessions with standby pages first: give them first
 * (kvc_region_release_standby). Standby needs a daemon that offers it
 * (GetInfo().fd_channel_standby); without it, with a limit of 0 (the
 * default), or while the session is being resumed or ended,
 * kvc_region_unmap_ranges_standby acts exactly as kvc_region_unmap_ranges.
 * After a resume the session says again which adopted pages it keeps as
 * standby (the restarted daemon does not journal it; a page taken back
 * meanwhile is left in use). All thread-safe (calls on one region
 * serialise). */

/* The most bytes of standby pages the region keeps (0, the default: none).
 * Lowering it below what is kept frees the excess (the highest pages). */
KVC_API kvc_status kvc_region_set_standby_limit(kvc_region *region, uint64_t bytes);
KVC_API uint64_t kvc_region_standby_limit(const kvc_region *region);

/* kvc_region_unmap_ranges, but the daemon pages lying wholly inside the
 * ranges stay mapped as standby, within the region's standby limit: taken
 * from the front of every range in turn (the pages a range that grows again
 * maps first), sent as one FREE with the standby flag (up to 16384 pages per
 * record; all or nothing). Pages beyond the limit, and local pages, are
 * unmapped and freed as kvc_region_unmap_ranges does; standby pages in the
 * ranges stay standby. */
KVC_API kvc_status kvc_region_unmap_ranges_standby(kvc_region *region, const kvc_range *ranges,
                                                   size_t num_ranges);

/* Bytes of the region's pages kept as standby now. */
KVC_API uint64_t kvc_region_standby_bytes(const kvc_region *region);

/* Unmap and give back standby pages covering `bytes` (rounded up to whole
 * pages, the highest pages first; UINT64_MAX: all), in one Free. *released
 * (may be NULL) gets the bytes given back. For answering a reclaim from
 * standby first. */
KVC_API kvc_status kvc_region_release_standby(kvc_region *region, uint64_t bytes,
                                              uint64_t *released);

/* Nonzero if every byte of [offset, offset+size) is mapped. Thread-safe. */
KVC_API int kvc_region_is_mapped(kvc_region *region, uint64_t offset, uint64_t size);

/* Set the mapped bytes of [offset, offset+size) to `value`, touching only
 * mapped pages (holes stay unmapped and read as zeros when mapped later).
 * kvc_region_clear does the whole region. cuMemsetD8 on "cuda". Thread-safe. */
KVC_API kvc_status kvc_region_memset(kvc_region *region, uint64_t offset, uint64_t size,
                                     uint8_t value);
KVC_API kvc_status kvc_region_clear(kvc_region *region, uint8_t value);

/* Copy in and out of the region (cuMemcpyHtoD/DtoH on "cuda", memcpy on
 * "host"). Every byte must be mapped, else KVC_ERR_FAILED_PRECONDITION.
 * For tests and tools; a KV cache writes through its own kernels. */
KVC_API kvc_status kvc_region_write(kvc_region *region, uint64_t offset, const void *src,
                                    uint64_t size);
KVC_API kvc_status kvc_region_read(kvc_region *region, uint64_t offset, void *dst,
                                   uint64_t size);

/* ------------------------------------------------------------------------ */
/* Layout helper                                                            */

/* Place `count` tensors of the given byte sizes one after another, each at
 * a multiple of `page_size`: offsets[i] gets each start, *total_bytes the
 * reservation they need. Thread-safe. */
KVC_API kvc_status kvc_layout_page_aligned(uint64_t page_size, const uint64_t *sizes,
                                           size_t count, uint64_t *offsets,
                                           uint64_t *total_bytes);

#ifdef __cplusplus
}
#endif

#endif /* KVCACHED_H */
