// libkvcached internals, shared by its units (not installed):
//   channel.cc  the fd channel: request records, the reader role, filing records, its end
//   session.cc  Allocate / Free on the channel, the page books, kept fds, GetStats
//   resume.cc   resume after a daemon restart; the monitor thread
//   watch.cc    the Watch stream (reclaim callback, MEMORY_AVAILABLE, SHUTDOWN)
//   region.cc   regions: map and unmap page-aligned ranges
//   api.cc      the extern "C" layer (kvcached.h)
// Errors map to kvc_status in one place: status.cc.
#ifndef KVC_INTERNAL_H
#define KVC_INTERNAL_H

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fdchannel.h"
#include "kvcached.h"
#include "kvcached/v1/kvcached.grpc.pb.h"
#include "mapper.h"
#include "pages.h"
#include "status.h"

namespace pb = kvcached::v1;

namespace kvc_impl {

constexpr uint32_t kDefaultTimeoutMs = 5000;
constexpr const char *kDefaultSocket = "/tmp/kvcached.sock";
constexpr uint32_t kApiVersion = 1;
// Resuming after a daemon restart: reconnect backoff and how long to try.
constexpr uint32_t kResumeFirstDelayMs = 50;
constexpr uint32_t kResumeMaxDelayMs = 1000;
constexpr uint32_t kResumeTimeoutMs = 120000;

// A gRPC status as this library's (status.cc maps the code).
kvc_status from_grpc(const grpc::Status &st, const char *what);

struct Conn {
    std::string socket_path;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<pb::KVCached::Stub> stub;
    std::atomic<uint32_t> timeout_ms{kDefaultTimeoutMs};
    pb::GetInfoResponse info;

    void prepare(grpc::ClientContext &ctx) const
    {
        uint32_t t = timeout_ms.load();
        if (t)
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(t));
    }
};

// The fd channel of a session (one connection; a resume makes a new one).
// Owns the socket: it is closed when the last user lets go.
//
// Requests on the channel (ALLOCATE, FREE, CLOSE; docs/protocol.md) are
// answered by REPLY records, with an allocation's PAGES before its REPLY.
// A thread waiting for a REPLY reads the socket (one at a time, the
// "reader"), filing every record it takes off (REPLY by request id, PAGES
// by allocation id), and hands the job to another waiter when its own
// answer is in; while nobody waits, the session's monitor thread reads. So
// records are consumed as they come (an allocation larger than the socket
// buffer does not stall, pages nobody waits for go back at once), and
// several threads may have requests in flight.
struct Chan {
    struct Reply {
        uint32_t code = 0;
        uint64_t value = 0;
        std::string message;
    };
    struct Stash {
        uint32_t total = 0;
        std::map<uint32_t, std::pair<uint64_t, int>> pages;  // index -> (page id, fd)
    };
    enum End { kOpen = 0, kGone, kGoodbye, kError, kProtocol };

    explicit Chan(int fd_) : fd(fd_), rec(new kvc_fd_record) {}
    ~Chan()
    {
        for (auto &a : stash)
            for (auto &p : a.second.pages)
                close(p.second.second);
        if (fd >= 0)
            close(fd);
    }
    Chan(const Chan &) = delete;
    Chan &operator=(const Chan &) = delete;

    const int fd;
    std::mutex mu;  // everything below
    std::condition_variable cv;
    bool reading = false;                    // a thread is reading the socket
    std::unique_ptr<kvc_fd_record> rec;      // the reader's record
    uint64_t next_req = 1;
    std::set<uint64_t> waiting;              // request ids someone waits for
    std::map<uint64_t, Reply> replies;       // request id -> its REPLY
    std::map<uint64_t, Stash> stash;         // allocation id -> its pages so far
    End end = kOpen;
    uint32_t end_code = 0;                   // ERROR's code
    std::string end_message;                 // ERROR's message; a protocol error's fault
};

}  // namespace kvc_impl

using kvc_impl::Chan;
using kvc_impl::Conn;
using kvc_impl::from_grpc;
using kvc_impl::kDefaultTimeoutMs;

struct kvc_client {
    std::shared_ptr<Conn> conn;
    std::vector<kvc_device_info> devices;
};

enum SessionState { kLive = 0, kResuming = 1 };

namespace kvc_impl {

// A session (struct kvc_session) is its identity, fixed at open, and these
// parts, each with the state it owns and its own lock:
//   Lifecycle  live / resuming / ended and why        Lifecycle::mu (+ cv)
//   Link       the fd channel and SessionRef now      Link::mu, Link::rw
//   Books      pages held, limit, regions, blocks     Books::mu
//   Kept       kept page fds, deferred Frees          Kept::mu
//   Monitor    the thread that reads and resumes      (its own thread only)
//   Watch      the Watch thread, reclaim callback     Watch::mu (+ cv), Watch::cb_mu
// The fd channel (Chan, above: the request table and the reader role) has
// its own lock too. Where one lock is held while another is taken, the order
// is: Link::rw, then Link::mu or Kept::mu (a resume swaps the channel and
// reads the deferred Frees under both, Link::mu first), then Chan::mu, then
// Lifecycle::mu and Watch::mu (kvc_session::notify, also under Chan::mu).
// Books::mu is held alone. Watch::cb_mu is held while the reclaim callback
// runs, which may call into any of the above.

// Where the session stands: live, resuming after its daemon went away, or
// ended and why. The flags are read without the lock; kvc_session::notify()
// follows every change of ended, state or resumes.
struct Lifecycle {
    std::atomic<bool> ended{false};
    std::atomic<int> state{kLive};
    std::atomic<uint64_t> resumes{0};
    std::atomic<bool> closing{false};

    std::mutex mu;  // end_status, end_reason; with cv, waits for a change of the flags
    std::condition_variable cv;
    kvc_status end_status = KVC_ERR_FAILED_PRECONDITION;  // what calls fail with once ended
    std::string end_reason;                               // and the message

    // Ended with `code` and `why` (the first end wins); the caller notifies.
    void end(kvc_status code, const std::string &why)
    {
        std::lock_guard<std::mutex> g(mu);
        if (!ended.load()) {
            end_status = code;
            end_reason = why;
        }
        ended = true;
    }

    kvc_status ended_error()
    {
        std::lock_guard<std::mutex> g(mu);
        return kvc_fail(end_status, "%s", end_reason.c_str());
    }

    void wake()
    {
        { std::lock_guard<std::mutex> g(mu); }
        cv.notify_all();
    }
};

// The session's way to the daemon: its fd channel and SessionRef, both
// replaced by a resume.
struct Link {
    std::mutex mu;  // fd, chan, ref
    int fd = -1;    // the fd channel (chan->fd)
    std::shared_ptr<Chan> chan;  // owns fd
    pb::SessionRef ref;
    std::atomic<bool> admin{false};
    // Channel allocations and Frees hold it shared from request to keeping
    // (or forgetting) their fds; a resume holds it exclusively (its ADOPT
    // lists every page held).
    std::shared_mutex rw;

    std::shared_ptr<Chan> chan_copy()
    {
        std::lock_guard<std::mutex> g(mu);
        return chan;
    }

    pb::SessionRef ref_copy()
    {
        std::lock_guard<std::mutex> g(mu);
        return ref;
    }
};

// What the session holds: pages counted against its limit, its regions and
// its blocks (kvc_session_alloc).
struct Books {
    std::atomic<uint64_t> held_pages{0};
    std::atomic<uint64_t> limit{0};
    std::mutex mu;  // regions, blocks
    size_t regions = 0;
    std::map<uintptr_t, kvc_region *> blocks;

    void drop_held(size_t n) { held_pages -= std::min<uint64_t>(held_pages.load(), n); }
};

// What a resume claims (resumable sessions): a duplicate of every page fd
// held (ADOPT re-sends them) and the pages whose Free could not reach the
// daemon (left out of the claim, which gives them back).
struct Kept {
    // page id -> dup of its fd and the entry's sequence number: the daemon
    // may lend an id again after a Free, so a Free forgets only the entry
    // it saw.
    struct Entry {
        int fd;
        uint64_t seq;
    };
    std::mutex mu;  // everything below
    std::map<uint64_t, Entry> keep;
    uint64_t keep_seq = 0;
    std::set<uint64_t> deferred;
    // Held pages kept as standby (session_standby_ids adds; a USE or a
    // Free ends it): said again to a restarted daemon after a resume, since
    // it does not journal standby.
    std::set<uint64_t> standby;

    // Keep these duplicates (mu held); a kept entry of the same id is
    // replaced (it is the same id lent before, whose Free's REPLY is on its
    // way: that Free forgets only its own entry, by seq).
    void add_locked(const std::vector<uint64_t> &ids, const std::vector<int> &dups)
    {
        for (size_t i = 0; i < ids.size(); i++) {
            auto it = keep.find(ids[i]);
            if (it != keep.end())
                close(it->second.fd);
            keep[ids[i]] = Entry{dups[i], ++keep_seq};
        }
    }

    // Close the kept duplicates of these pages (mu held).
    void drop_locked(const std::vector<uint64_t> &ids)
    {
        for (uint64_t i : ids) {
            auto it = keep.find(i);
            if (it != keep.end()) {
                close(it->second.fd);
                keep.erase(it);
            }
        }
    }

    // The kept entries' sequence numbers of these pages (mu held; 0: none).
    std::vector<uint64_t> seqs_locked(const std::vector<uint64_t> &ids) const
    {
        std::vector<uint64_t> seqs(ids.size(), 0);
        for (size_t i = 0; i < ids.size(); i++) {
            auto it = keep.find(ids[i]);
            if (it != keep.end())
                seqs[i] = it->second.seq;
        }
        return seqs;
    }

    // Forget the kept entries a Free saw (mu held): an entry with another
    // sequence number is the same id lent again meanwhile, and stays.
    void unkeep_seqs_locked(const std::vector<uint64_t> &ids, const std::vector<uint64_t> &seqs,
                            size_t n)
    {
        for (size_t i = 0; i < n; i++) {
            auto it = keep.find(ids[i]);
            if (it != keep.end() && it->second.seq == seqs[i]) {
                close(it->second.fd);
                keep.erase(it);
            }
        }
    }

    void drop_all()
    {
        std::lock_guard<std::mutex> g(mu);
        for (auto &kv : keep)
            close(kv.second.fd);
        keep.clear();
        deferred.clear();
    }
};

// The monitor thread: reads the fd channel while nobody waits, and resumes
// a resumable session whose daemon went away (resume.cc).
struct Monitor {
    std::thread thread;
    int wake_fd = -1;  // eventfd: wakes the thread at close
};

// The Watch stream (watch.cc): its thread, what it saw, and the reclaim
// callback.
struct Watch {
    std::mutex mu;  // everything below but the callback
    std::condition_variable cv;
    std::thread thread;
    std::unique_ptr<grpc::ClientContext> ctx;
    bool started = false, ready = false, done = false, stopping = false;
    grpc::Status status;
    bool available_pending = false;

    std::mutex cb_mu;  // fn, user; held while the callback runs
    kvc_reclaim_fn fn = nullptr;
    void *user = nullptr;

    void wake()
    {
        { std::lock_guard<std::mutex> g(mu); }
        cv.notify_all();
    }
};

}  // namespace kvc_impl

struct kvc_session {
    // Fixed at open.
    std::shared_ptr<Conn> conn;
    uint64_t id = 0;
    std::string device, kind;
    uint64_t page_size = 0;
    uint32_t max_pages = 0;
    kvc_mapper *mapper = nullptr;
    bool resumable = false;  // OpenSession gave a resume token
    std::string resume_token;
    // Kept handles (docs/protocol.md "Kept handles"): how many page handles
    // the mapper may keep ($KVCACHED_KEEP_HANDLES, default 8192; 0: never),
    // used where the daemon offers it (GetInfo().fd_channel_keep_handles;
    // the mapper keeps them: on CUDA only). The cache itself is the
    // mapper's, with its own (leaf) lock.
    size_t keep_limit = 0;
    // Standby pages (docs/protocol.md "Standby pages"): the daemon honours
    // FREE's standby flag and USE (GetInfo().fd_channel_standby; set at open
    // and at each resume).
    std::atomic<bool> standby_ok{false};
    // Allocate's wait flag and timeout (kvc_session_set_wait may change them
    // while other threads allocate).
    std::atomic<bool> wait{false};
    std::atomic<uint32_t> wait_timeout_ms{0};

    kvc_impl::Lifecycle life;
    kvc_impl::Link link;
    kvc_impl::Books books;
    kvc_impl::Kept kept;
    kvc_impl::Monitor monitor;
    kvc_impl::Watch watch;

    // Wake everyone waiting for a change of ended/state/resumes (on the
    // lifecycle's or the Watch's condition variable).
    void notify()
    {
        life.wake();
        watch.wake();
    }

    // The session is over; calls that need the daemon fail with `code` and
    // `why` from now on (the first end wins).
    void mark_ended(kvc_status code, const std::string &why)
    {
        life.end(code, why);
        // Where handles end: every kept handle with the session.
        if (mapper)
            kvc_mapper_keep_reset(mapper, 0);
        notify();
    }

    kvc_status ended_error() { return life.ended_error(); }

    // docs/protocol.md "Hang-up and resume": a session without a resume
    // token is over when its channel hangs up.
    std::string hangup_message() const
    {
        return "session " + std::to_string(id) +
               " ended: the daemon went away, and without a state dir (kvcached-serve "
               "--state-dir) a daemon that restarts cannot resume it; open a new session";
    }

    // The fd channel is gone (daemon crash or restart): a resumable session
    // goes into resuming (the monitor thread does the work).
    void note_gone()
    {
        if (!life.ended.load() && life.state.exchange(kResuming) != kResuming)
            notify();
    }

    bool resuming() const
    {
        return resumable && life.state.load() == kResuming && !life.ended.load();
    }

    kvc_status resuming_error()
    {
        return kvc_fail(KVC_ERR_UNAVAILABLE,
                        "the daemon went away; session %llu is being resumed: the pages you "
                        "hold stay usable, try again shortly",
                        (unsigned long long)id);
    }

    // Ended or resuming: the daemon cannot be asked now.
    kvc_status check_live()
    {
        if (life.ended.load())
            return ended_error();
        if (resuming())
            return resuming_error();
        return KVC_OK;
    }

    // A failed rpc of this session. On a resumable session an unreachable
    // daemon is said as such (and the session resumes when it is back).
    kvc_status rpc_error(const grpc::Status &st, const char *what)
    {
        if (resumable && !life.closing.load() && !life.ended.load() &&
            (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
             life.state.load() == kResuming))
            return kvc_fail(KVC_ERR_UNAVAILABLE,
                            "%s: the daemon is unreachable; session %llu resumes when it is "
                            "back and the pages you hold stay usable (%s)",
                            what, (unsigned long long)id, st.error_message().c_str());
        return from_grpc(st, what);
    }
};

// Slot states of a region.
enum : uint8_t {
    kSlotFree = 0,
    kSlotMapped = 1,  // a page of r->session
    kSlotOrphan = 2,  // mapped, but its session ended before kvc_region_rebind: no daemon
                      // counts it; unmapping it is local only
    kSlotLocal = 3,   // this process's own memory (kvc_region_map_ranges_local): no daemon
                      // lent it; unmapping frees it
    kSlotStandby = 4, // a page of r->session kept mapped as standby (FREE with the standby
                      // flag): unmapped from the caller's view, taken back by a map
};

// Mapped and in use, from the caller's view (a standby slot is not).
inline bool slot_in_use(uint8_t state) { return state != kSlotFree && state != kSlotStandby; }

struct kvc_region {
    kvc_session *session = nullptr;
    uintptr_t base = 0;
    uint64_t size = 0;       // reserved: requested rounded up to whole pages
    uint64_t requested = 0;  // max_bytes as asked; a range ending there ends at `size`
    uint64_t page = 0;
    std::mutex mu;
    std::vector<uint64_t> ids;    // page id per slot
    std::vector<uint8_t> mapped;  // slot state (nonzero: mapped)
    std::atomic<uint64_t> mapped_pages{0};  // every mapped slot, local and standby ones included
    std::atomic<uint64_t> local_pages{0};
    std::atomic<uint64_t> standby_pages{0};  // slots kept mapped as standby
    std::atomic<uint64_t> standby_limit{0};  // bytes of standby pages at most (0: no standby)
};

namespace kvc_impl {

// ---- channel.cc
void chan_free_nowait(kvc_session *s, Chan *ch, const std::vector<uint64_t> &ids);
size_t chan_encode_free(kvc_session *s, std::vector<uint8_t> &buf, uint64_t req, const uint64_t *ids,
                        uint32_t n);
void chan_answer_drop(kvc_session *s, Chan *ch, const std::vector<uint64_t> &ids);
size_t keep_limit_from_env();
void chan_end_status_locked(kvc_session *s, Chan *ch, kvc_status *code, std::string *msg);
void chan_end_locked(kvc_session *s, Chan *ch, Chan::End end);
kvc_status chan_protocol_error(kvc_session *s, Chan *ch, const std::string &fault);
bool chan_wanted_locked(Chan *ch, uint64_t allocation_id);
void chan_take_unwanted_locked(Chan *ch, uint64_t allocation_id, std::vector<uint64_t> &unwanted);
void chan_file(kvc_session *s, Chan *ch, kvc_status st, int eof, const char *err);
kvc_status chan_end_error(kvc_session *s, Chan *ch);
void chan_pump_pending(kvc_session *s, Chan *ch);
uint64_t chan_next_req(Chan *ch);
kvc_status chan_request(kvc_session *s, Chan *ch, uint64_t req, const uint8_t *buf, size_t len,
                        uint64_t timeout_ms, const char *what, Chan::Reply *out,
                        Chan::Stash *pages);
kvc_status chan_free(kvc_session *s, Chan *ch, const std::vector<uint64_t> &ids, size_t *done);

// ---- session.cc
void close_fds(std::vector<int> &fds);
kvc_status from_grpc(const grpc::Status &st, const char *what);
kvc_status check_free_locked(kvc_session *s, const std::vector<uint64_t> &ids);
kvc_status session_free_ids(kvc_session *s, const std::vector<uint64_t> &ids, size_t *freed = nullptr);
kvc_status session_standby_ids(kvc_session *s, const std::vector<uint64_t> &ids, size_t *done);
void session_use_nowait(kvc_session *s, const std::vector<uint64_t> &ids);
kvc_status keep_fds(kvc_session *s, const std::vector<uint64_t> &ids, const std::vector<int> &fds);
kvc_status chan_allocate_chunk(kvc_session *s, Chan *ch, uint32_t chunk, std::vector<uint64_t> &ids,
                               std::vector<int> &fds);
kvc_status chan_session_allocate(kvc_session *s, uint64_t n, std::vector<uint64_t> &ids,
                                 std::vector<int> &fds);
kvc_status session_allocate(kvc_session *s, uint64_t n, std::vector<uint64_t> &ids,
                            std::vector<int> &fds);
void fill_pool(kvc_pool_stats *o, const pb::PoolStats &p);
kvc_status session_stats(kvc_session *s, kvc_stats *out);

// ---- region.cc
kvc_status region_new(kvc_session *s, uint64_t max_bytes, kvc_region **out);
kvc_status region_map_slots(kvc_region *r, const std::vector<uint64_t> &slots);
kvc_status region_unmap_slots(kvc_region *r, const std::vector<uint64_t> &slots);
kvc_status check_ranges(const kvc_region *r, const kvc_range *ranges, size_t n);
kvc_status region_map_ranges(kvc_region *r, const kvc_range *ranges, size_t n);
kvc_status region_map_ranges_local(kvc_region *r, const kvc_range *ranges, size_t n);
kvc_status region_unmap_ranges(kvc_region *r, const kvc_range *ranges, size_t n, bool only_local);
kvc_status region_unmap_ranges_standby(kvc_region *r, const kvc_range *ranges, size_t n);
kvc_status region_release_standby(kvc_region *r, uint64_t bytes, uint64_t *released);
kvc_status region_set_standby_limit(kvc_region *r, uint64_t bytes);
void region_orphan_standby_locked(kvc_region *r);
void region_delete(kvc_region *r);

// ---- watch.cc
grpc::Status watch_stream(kvc_session *s, grpc::ClientContext *ctx);
void watch_loop(kvc_session *s);
kvc_status watch_start(kvc_session *s);
void watch_stop(kvc_session *s);

// ---- resume.cc
bool channel_gone(kvc_session *s);
bool resume_sleep(kvc_session *s, uint32_t ms);
void resume_failed(kvc_session *s, const std::string &why);
bool session_resume(kvc_session *s);
void monitor_loop(kvc_session *s);
void monitor_stop(kvc_session *s);

// Apply `op(addr, len)` to each mapped piece (at most one page) of
// [offset, offset+size). With require_mapped, any hole fails first.
template <typename Op>
kvc_status region_each_piece(kvc_region *r, uint64_t offset, uint64_t size, bool require_mapped,
                             Op op)
{
    uint64_t f = 0, e = 0;
    if (kvc_pages_covering(offset, size, r->size, r->page, &f, &e) != 0)
        return kvc_fail(KVC_ERR_INVALID_ARGUMENT,
                        "range [%llu, +%llu) lies outside the region's %llu bytes",
                        (unsigned long long)offset, (unsigned long long)size,
                        (unsigned long long)r->size);
    std::lock_guard<std::mutex> g(r->mu);
    if (require_mapped)
        for (uint64_t k = f; k < e; k++)
            if (!slot_in_use(r->mapped[k]))
                return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                                "byte %llu of the region is not mapped (page %llu)",
                                (unsigned long long)std::max(offset, k * r->page),
                                (unsigned long long)k);
    for (uint64_t k = f; k < e; k++) {
        if (!slot_in_use(r->mapped[k]))
            continue;
        uint64_t lo = std::max(offset, k * r->page);
        uint64_t hi = std::min(offset + size, (k + 1) * r->page);
        kvc_status st = op(lo, hi - lo);
        if (st != KVC_OK)
            return st;
    }
    return kvc_mapper_sync(r->session->mapper);
}

}  // namespace kvc_impl

#endif
