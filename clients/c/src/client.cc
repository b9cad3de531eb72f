// libkvcached: the C API over gRPC (control plane), the fd channel (pages)
// and the mapper (host mmap / CUDA VMM). Every extern "C" function catches
// everything at the boundary: no exception crosses the ABI.
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

namespace {

constexpr uint32_t kDefaultTimeoutMs = 5000;
constexpr const char *kDefaultSocket = "/tmp/kvcached.sock";
constexpr uint32_t kApiVersion = 1;
// Resuming after a daemon restart: reconnect backoff and how long to try.
constexpr uint32_t kResumeFirstDelayMs = 50;
constexpr uint32_t kResumeMaxDelayMs = 1000;
constexpr uint32_t kResumeTimeoutMs = 120000;

// Run `body` with every exception turned into a status.
template <typename F>
kvc_status guarded(F &&body) noexcept
{
    try {
        kvc_clear_error();
        return body();
    } catch (const std::bad_alloc &) {
        return kvc_fail(KVC_ERR_NO_MEMORY, "out of memory");
    } catch (const std::exception &e) {
        return kvc_fail(KVC_ERR_INTERNAL, "unexpected C++ exception: %s", e.what());
    } catch (...) {
        return kvc_fail(KVC_ERR_INTERNAL, "unexpected C++ exception");
    }
}

kvc_status from_grpc(const grpc::Status &st, const char *what)
{
    kvc_status k = kvc_status_from_grpc_code(static_cast<int>(st.error_code()));
    if (k == KVC_OK)
        return KVC_OK;
    return kvc_fail(k, "%s: %s", what, st.error_message().c_str());
}

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

}  // namespace

struct kvc_client {
    std::shared_ptr<Conn> conn;
    std::vector<kvc_device_info> devices;
};

enum SessionState { kLive = 0, kResuming = 1 };

struct kvc_session {
    std::shared_ptr<Conn> conn;
    pb::SessionRef ref;  // guarded by mu (a resume replaces it)
    uint64_t id = 0;
    std::atomic<bool> admin{false};
    std::string device, kind;
    uint64_t page_size = 0;
    uint32_t max_pages = 0;
    // Allocate's wait flag and timeout (kvc_session_set_wait may change them
    // while other threads allocate).
    std::atomic<bool> wait{false};
    std::atomic<uint32_t> wait_timeout_ms{0};
    kvc_mapper *mapper = nullptr;
    int fd = -1;  // the fd channel (chan->fd); replaced by a resume (under chan_rw and mu)
    std::shared_ptr<Chan> chan;  // owns fd (mu)
    // Channel allocations hold it shared from request to keeping their fds;
    // a resume holds it exclusively (its ADOPT lists every page held).
    std::shared_mutex chan_rw;

    std::mutex mu;        // the books below
    std::atomic<uint64_t> held_pages{0};
    std::atomic<uint64_t> limit{0};
    std::atomic<bool> ended{false};
    kvc_status end_status = KVC_ERR_FAILED_PRECONDITION;  // what calls fail with once ended (mu)
    std::string end_reason;                               // and the message (mu)
    size_t regions = 0;
    std::map<uintptr_t, kvc_region *> blocks;

    // Resume after a daemon restart (OpenSession gave a resume token).
    bool resumable = false;
    std::string resume_token;
    // page id -> dup of its fd and the entry's sequence number (mu): the
    // daemon may lend an id again after a Free, so a Free forgets only the
    // entry it saw.
    struct Kept {
        int fd;
        uint64_t seq;
    };
    std::map<uint64_t, Kept> keep;
    uint64_t keep_seq = 0;
    std::set<uint64_t> deferred;    // pages whose Free could not reach the daemon (mu)
    std::atomic<int> state{kLive};
    std::atomic<uint64_t> resumes{0};
    std::atomic<bool> closing{false};
    std::thread monitor;            // reads the fd channel while nobody waits; resumes
    int wake_fd = -1;               // eventfd: wakes the monitor at close

    // Watch stream
    std::mutex watch_mu;
    std::condition_variable watch_cv;
    std::thread watch;
    std::unique_ptr<grpc::ClientContext> watch_ctx;
    bool watch_started = false, watch_ready = false, watch_done = false, watch_stopping = false;
    grpc::Status watch_status;
    bool available_pending = false;
    std::mutex cb_mu;  // held while the callback runs
    kvc_reclaim_fn reclaim_fn = nullptr;
    void *reclaim_user = nullptr;

    // Wake everyone waiting on watch_cv after a change of ended/state/resumes.
    void notify()
    {
        { std::lock_guard<std::mutex> w(watch_mu); }
        watch_cv.notify_all();
    }

    // The session is over; calls that need the daemon fail with `code` and
    // `why` from now on (the first end wins).
    void mark_ended(kvc_status code, const std::string &why)
    {
        {
            std::lock_guard<std::mutex> g(mu);
            if (!ended.load()) {
                end_status = code;
                end_reason = why;
            }
            ended = true;
        }
        notify();
    }

    kvc_status ended_error()
    {
        std::lock_guard<std::mutex> g(mu);
        return kvc_fail(end_status, "%s", end_reason.c_str());
    }

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
        if (!ended.load() && state.exchange(kResuming) != kResuming)
            notify();
    }

    bool resuming() const { return resumable && state.load() == kResuming && !ended.load(); }

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
        if (ended.load())
            return ended_error();
        if (resuming())
            return resuming_error();
        return KVC_OK;
    }

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

    // A failed rpc of this session. On a resumable session an unreachable
    // daemon is said as such (and the session resumes when it is back).
    kvc_status rpc_error(const grpc::Status &st, const char *what)
    {
        if (resumable && !closing.load() && !ended.load() &&
            (st.error_code() == grpc::StatusCode::UNAVAILABLE || state.load() == kResuming))
            return kvc_fail(KVC_ERR_UNAVAILABLE,
                            "%s: the daemon is unreachable; session %llu resumes when it is "
                            "back and the pages you hold stay usable (%s)",
                            what, (unsigned long long)id, st.error_message().c_str());
        return from_grpc(st, what);
    }

    // Close the kept duplicates of these pages (mu held).
    void drop_kept_locked(const std::vector<uint64_t> &ids)
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
    std::vector<uint64_t> kept_seqs_locked(const std::vector<uint64_t> &ids) const
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

    void drop_all_kept()
    {
        std::lock_guard<std::mutex> g(mu);
        for (auto &kv : keep)
            close(kv.second.fd);
        keep.clear();
        deferred.clear();
    }
};

// Slot states of a region.
enum : uint8_t {
    kSlotFree = 0,
    kSlotMapped = 1,  // a page of r->session
    kSlotOrphan = 2,  // mapped, but its session ended before kvc_region_rebind: no daemon
                      // counts it; unmapping it is local only
};

struct kvc_region {
    kvc_session *session = nullptr;
    uintptr_t base = 0;
    uint64_t size = 0;       // reserved: requested rounded up to whole pages
    uint64_t requested = 0;  // max_bytes as asked; a range ending there ends at `size`
    uint64_t page = 0;
    std::mutex mu;
    std::vector<uint64_t> ids;    // page id per slot
    std::vector<uint8_t> mapped;  // slot state (nonzero: mapped)
    std::atomic<uint64_t> mapped_pages{0};
};

namespace {

// ---- pages from the daemon -------------------------------------------

void close_fds(std::vector<int> &fds)
{
    for (int &fd : fds)
        if (fd >= 0) {
            close(fd);
            fd = -1;
        }
}

void drop_held(kvc_session *s, size_t n)
{
    s->held_pages -= std::min<uint64_t>(s->held_pages.load(), n);
}

// ---- requests on the fd channel ---------------------------------------

// Send a FREE for pages nobody will use (an allocation whose requester gave
// up waiting, or stray pages) without waiting for its REPLY (dropped: no
// one waits for its id).
void chan_free_nowait(Chan *ch, const std::vector<uint64_t> &ids)
{
    std::vector<uint8_t> buf;
    char err[256];
    for (size_t i = 0; i < ids.size(); i += KVC_FD_MAX_FREE_IDS) {
        uint32_t n = static_cast<uint32_t>(std::min<size_t>(KVC_FD_MAX_FREE_IDS, ids.size() - i));
        uint64_t req;
        {
            std::lock_guard<std::mutex> g(ch->mu);
            req = ch->next_req++;
        }
        buf.resize(KVC_FD_HEADER_SIZE + KVC_FD_FREE_FIXED + 8u * n);
        size_t len = kvc_fd_encode_free(buf.data(), buf.size(), req, &ids[i], n);
        if (!len || kvc_fd_send(ch->fd, buf.data(), len, nullptr, 0, err, sizeof err) != KVC_OK)
            return;  // the channel is gone: the session's pages go back anyway
    }
}

// Why a channel that ended this way ends its session: the status calls
// fail with and the message (ch->mu held; s->id only).
void chan_end_status_locked(kvc_session *s, Chan *ch, kvc_status *code, std::string *msg)
{
    const std::string sid = "session " + std::to_string(s->id);
    switch (ch->end) {
    case Chan::kError: {
        kvc_status k = kvc_status_from_grpc_code(static_cast<int>(ch->end_code));
        *code = k == KVC_OK ? KVC_ERR_INTERNAL : k;
        *msg = sid + " ended by the daemon: " + ch->end_message;
        break;
    }
    case Chan::kGoodbye:
        *code = KVC_ERR_FAILED_PRECONDITION;
        *msg = sid + " ended: the daemon closed it (GOODBYE)";
        break;
    case Chan::kProtocol:
        *code = KVC_ERR_INTERNAL;
        *msg = sid + ": fd channel protocol error: " + ch->end_message +
               "; the channel was closed and the session is over";
        break;
    default:
        *code = KVC_ERR_FAILED_PRECONDITION;
        *msg = s->hangup_message();
        break;
    }
}

// End the channel (ch->mu held; the first end wins): a resumable session
// whose daemon went away resumes (the monitor does it), any other end is
// the session's end. A protocol error closes our side (shutdown: the fd
// stays ours until the last user lets go), so the daemon ends the session.
void chan_end_locked(kvc_session *s, Chan *ch, Chan::End end)
{
    if (ch->end != Chan::kOpen)
        return;
    ch->end = end;
    if (end == Chan::kProtocol)
        shutdown(ch->fd, SHUT_RDWR);
    if (end == Chan::kGone && s->resumable) {
        s->note_gone();
    } else {
        kvc_status code;
        std::string msg;
        chan_end_status_locked(s, ch, &code, &msg);
        s->mark_ended(code, msg);
    }
    ch->cv.notify_all();
}

// A protocol error found by a caller (a REPLY OK before all its pages).
kvc_status chan_protocol_error(kvc_session *s, Chan *ch, const std::string &fault)
{
    {
        std::lock_guard<std::mutex> g(ch->mu);
        if (ch->end == Chan::kOpen)
            ch->end_message = fault;
        chan_end_locked(s, ch, Chan::kProtocol);
    }
    return kvc_fail(KVC_ERR_INTERNAL,
                    "session %llu: fd channel protocol error: %s; the channel was closed and "
                    "the session is over",
                    (unsigned long long)s->id, fault.c_str());
}

// Someone waits for this allocation's REPLY (ch->mu held).
bool chan_wanted_locked(Chan *ch, uint64_t allocation_id)
{
    return (allocation_id & KVC_FD_CHANNEL_ALLOC_BIT) &&
           ch->waiting.count(allocation_id & ~KVC_FD_CHANNEL_ALLOC_BIT);
}

// Take a complete allocation nobody waits for out of the stash: its fds
// closed, its ids appended to `unwanted` (to be given back with FREE).
// ch->mu held.
void chan_take_unwanted_locked(Chan *ch, uint64_t allocation_id, std::vector<uint64_t> &unwanted)
{
    auto it = ch->stash.find(allocation_id);
    if (it == ch->stash.end() || it->second.pages.size() != it->second.total ||
        chan_wanted_locked(ch, allocation_id))
        return;
    for (auto &p : it->second.pages) {
        unwanted.push_back(p.second.first);
        close(p.second.second);
    }
    ch->stash.erase(it);
}

// File one record taken off the channel (the caller is the reader; ch->mu
// not held). st/eof/err are what kvc_fd_recv said.
void chan_file(kvc_session *s, Chan *ch, kvc_status st, int eof, const char *err)
{
    kvc_fd_record *rec = ch->rec.get();
    if (st == KVC_ERR_DEADLINE_EXCEEDED)
        return;  // nothing yet
    std::vector<uint64_t> unwanted;  // pages to give back
    {
        std::lock_guard<std::mutex> g(ch->mu);
        if (ch->end != Chan::kOpen) {
            if (st == KVC_OK && !eof)
                kvc_fd_record_close_fds(rec);
            return;
        }
        if (st == KVC_ERR_PROTOCOL) {  // a malformed record (its fds closed)
            ch->end_message = err;
            chan_end_locked(s, ch, Chan::kProtocol);
            return;
        }
        if (st != KVC_OK || eof) {
            chan_end_locked(s, ch, Chan::kGone);
            return;
        }
        switch (rec->type) {
        case KVC_FD_REPLY:
            // A REPLY no request waits for (it gave up, or never existed) is dropped.
            if (ch->waiting.count(rec->req_id)) {
                Chan::Reply &r = ch->replies[rec->req_id];
                r.code = rec->error_code;
                r.value = rec->value;
                r.message = rec->message;
            }
            break;
        case KVC_FD_PAGES: {
            // Kept by allocation id until its request is answered; a complete
            // allocation nobody waits for is given back at once.
            Chan::Stash &a = ch->stash[rec->allocation_id];
            std::string fault;
            if (!a.pages.empty() && a.total != rec->total)
                fault = "allocation " + std::to_string(rec->allocation_id) + ": a PAGES record says " +
                        std::to_string(rec->total) + " pages in all, an earlier one " +
                        std::to_string(a.total);
            for (uint32_t i = 0; fault.empty() && i < rec->count; i++)
                if (a.pages.count(rec->first_index + i))
                    fault = "allocation " + std::to_string(rec->allocation_id) + ": page index " +
                            std::to_string(rec->first_index + i) + " sent twice";
            if (!fault.empty()) {
                kvc_fd_record_close_fds(rec);
                ch->end_message = fault;
                chan_end_locked(s, ch, Chan::kProtocol);
                return;
            }
            a.total = rec->total;
            for (uint32_t i = 0; i < rec->count; i++)
                a.pages.emplace(rec->first_index + i, std::make_pair(rec->page_ids[i], rec->fds[i]));
            rec->num_fds = 0;
            chan_take_unwanted_locked(ch, rec->allocation_id, unwanted);
            break;
        }
        case KVC_FD_GOODBYE:
            chan_end_locked(s, ch, Chan::kGoodbye);
            break;
        case KVC_FD_ERROR:
            ch->end_code = rec->error_code;
            ch->end_message = rec->message;
            chan_end_locked(s, ch, Chan::kError);
            break;
        default:  // HELLO again (kvc_fd_decode refuses records only clients send)
            kvc_fd_record_close_fds(rec);
            ch->end_message = "the daemon sent a record of type " + std::to_string(rec->type) +
                              " (a second HELLO)";
            chan_end_locked(s, ch, Chan::kProtocol);
            break;
        }
        ch->cv.notify_all();
    }
    if (!unwanted.empty())
        chan_free_nowait(ch, unwanted);
}

// Why the channel ended, as the status a request on it fails with.
kvc_status chan_end_error(kvc_session *s, Chan *ch)
{
    Chan::End end;
    kvc_status code;
    std::string msg;
    {
        std::lock_guard<std::mutex> g(ch->mu);
        end = ch->end;
        chan_end_status_locked(s, ch, &code, &msg);
    }
    if (end == Chan::kGone && s->resumable && !s->closing.load() && !s->ended.load())
        return s->resuming_error();
    if (s->ended.load())
        return s->ended_error();
    return kvc_fail(code, "%s", msg.c_str());
}

// Read and file every record already queued on the channel (never blocks
// for long: waits for the reader role, then reads what is there).
void chan_pump_pending(kvc_session *s, Chan *ch)
{
    std::unique_lock<std::mutex> g(ch->mu);
    ch->cv.wait(g, [ch] { return !ch->reading || ch->end != Chan::kOpen; });
    if (ch->end != Chan::kOpen)
        return;
    ch->reading = true;
    g.unlock();
    char err[512];
    for (;;) {
        int eof = 0;
        kvc_status st = kvc_fd_recv(ch->fd, 0, ch->rec.get(), &eof, err, sizeof err);
        if (st == KVC_ERR_DEADLINE_EXCEEDED)
            break;
        chan_file(s, ch, st, eof, err);
        std::lock_guard<std::mutex> l(ch->mu);
        if (ch->end != Chan::kOpen)
            break;
    }
    g.lock();
    ch->reading = false;
    ch->cv.notify_all();
}

uint64_t chan_next_req(Chan *ch)
{
    std::lock_guard<std::mutex> g(ch->mu);
    return ch->next_req++;
}

// Send one request record and wait up to timeout_ms (0 = forever) for its
// REPLY, reading the channel meanwhile if nobody else does. KVC_OK with
// *out filled (out->code is the daemon's gRPC status code, maybe an error);
// for an ALLOCATE, *pages gets its pages by index (the caller owns their
// fds). Else why it could not be asked or answered.
kvc_status chan_request(kvc_session *s, Chan *ch, uint64_t req, const uint8_t *buf, size_t len,
                        uint64_t timeout_ms, const char *what, Chan::Reply *out,
                        Chan::Stash *pages)
{
    bool ended;
    {
        std::lock_guard<std::mutex> g(ch->mu);
        ended = ch->end != Chan::kOpen;
        if (!ended)
            ch->waiting.insert(req);
    }
    if (ended)
        return chan_end_error(s, ch);  // takes ch->mu
    char err[512];
    bool sent = kvc_fd_send(ch->fd, buf, len, nullptr, 0, err, sizeof err) == KVC_OK;
    std::string send_err = sent ? "" : err;
    using clock = std::chrono::steady_clock;
    // Unsent (the daemon hung up?): only look for the records that say why.
    const bool forever = sent && timeout_ms == 0;
    const auto deadline = clock::now() + std::chrono::milliseconds(sent ? timeout_ms : 1000);
    const uint64_t alloc_id = req | KVC_FD_CHANNEL_ALLOC_BIT;
    std::unique_lock<std::mutex> g(ch->mu);
    std::vector<uint64_t> unwanted;
    auto give_up = [&] {
        ch->waiting.erase(req);
        ch->replies.erase(req);
        auto it = ch->stash.find(alloc_id);
        if (it != ch->stash.end() && !sent) {
            for (auto &p : it->second.pages)
                close(p.second.second);
            ch->stash.erase(it);
        }
        // Sent and unanswered: its pages go back as soon as they are all
        // there (now, or when the reader files the last of them).
        if (sent && ch->end == Chan::kOpen)
            chan_take_unwanted_locked(ch, alloc_id, unwanted);
    };
    for (;;) {
        auto it = ch->replies.find(req);
        if (it != ch->replies.end()) {
            *out = std::move(it->second);
            ch->replies.erase(it);
            ch->waiting.erase(req);
            auto a = ch->stash.find(alloc_id);
            if (a != ch->stash.end()) {
                if (pages)
                    *pages = std::move(a->second);
                else
                    for (auto &p : a->second.pages)
                        close(p.second.second);
                ch->stash.erase(a);
            }
            return KVC_OK;
        }
        if (ch->end != Chan::kOpen) {
            give_up();
            g.unlock();
            return chan_end_error(s, ch);
        }
        auto now = clock::now();
        if (!forever && now >= deadline) {
            give_up();
            g.unlock();
            if (!unwanted.empty())
                chan_free_nowait(ch, unwanted);
            if (!sent)
                return kvc_fail(KVC_ERR_UNAVAILABLE, "%s: fd channel: %s", what, send_err.c_str());
            return kvc_fail(KVC_ERR_DEADLINE_EXCEEDED,
                            "%s: no answer on the fd channel within %llu ms", what,
                            (unsigned long long)timeout_ms);
        }
        if (ch->reading) {
            if (forever)
                ch->cv.wait(g);
            else
                ch->cv.wait_until(g, deadline);
            continue;
        }
        // Read one record (at most a second at a time).
        ch->reading = true;
        g.unlock();
        int wait_ms = 1000;
        if (!forever) {
            auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
            wait_ms = static_cast<int>(std::max<long long>(0, std::min<long long>(left, 1000)));
        }
        int eof = 0;
        kvc_status st = kvc_fd_recv(ch->fd, wait_ms, ch->rec.get(), &eof, err, sizeof err);
        chan_file(s, ch, st, eof, err);
        g.lock();
        ch->reading = false;
        ch->cv.notify_all();
    }
}

// Free on the fd channel, in FREE records of at most 16384 ids. Returns
// how many of `ids` (from the front) the daemon freed in *done.
kvc_status chan_free(kvc_session *s, Chan *ch, const std::vector<uint64_t> &ids, size_t *done)
{
    *done = 0;
    std::vector<uint8_t> buf;
    uint32_t t = s->conn->timeout_ms.load();
    for (size_t i = 0; i < ids.size(); i += KVC_FD_MAX_FREE_IDS) {
        uint32_t n = static_cast<uint32_t>(std::min<size_t>(KVC_FD_MAX_FREE_IDS, ids.size() - i));
        uint64_t req = chan_next_req(ch);
        buf.resize(KVC_FD_HEADER_SIZE + KVC_FD_FREE_FIXED + 8u * n);
        size_t len = kvc_fd_encode_free(buf.data(), buf.size(), req, &ids[i], n);
        Chan::Reply rep;
        kvc_status st = chan_request(s, ch, req, buf.data(), len, t, "Free", &rep, nullptr);
        if (st != KVC_OK)
            return st;
        if (rep.code != 0) {
            kvc_status k = kvc_status_from_grpc_code(static_cast<int>(rep.code));
            return kvc_fail(k == KVC_OK ? KVC_ERR_PROTOCOL : k, "Free: %s", rep.message.c_str());
        }
        *done = i + n;
    }
    return KVC_OK;
}

// A Free the daemon cannot be asked now, checked as it would check it (all
// or nothing): an id named twice is INVALID_ARGUMENT, a page the session
// does not hold (not kept, or given back already) NOT_FOUND. s->mu held.
kvc_status check_free_locked(kvc_session *s, const std::vector<uint64_t> &ids)
{
    std::set<uint64_t> seen;
    for (uint64_t id : ids)
        if (!seen.insert(id).second)
            return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "Free: page %llu is named twice",
                            (unsigned long long)id);
    for (uint64_t id : ids)
        if (!s->keep.count(id) || s->deferred.count(id))
            return kvc_fail(KVC_ERR_NOT_FOUND, "Free: session %llu holds no page %llu",
                            (unsigned long long)s->id, (unsigned long long)id);
    return KVC_OK;
}

// Give pages back (they must be unmapped already); *freed (may be NULL)
// gets how many are given back.
//
// On a resumable session whose daemon is away (the session is resuming, or
// the Free fails with UNAVAILABLE: the channel hung up before the REPLY),
// the Free is checked here as the daemon would (check_free_locked) and the
// pages are deferred: left out of the claim when the session resumes, which
// gives them back (the old daemon may or may not have processed the Free;
// the new one forgets what is not claimed, and a session that cannot be
// resumed gives back everything). That is a completed give-back from the
// caller's point of view: KVC_OK. Once the session ended, the daemon took
// everything back: the books here forget the pages and the call fails with
// the session's end (FAILED_PRECONDITION, or what ended it).
kvc_status session_free_ids(kvc_session *s, const std::vector<uint64_t> &ids, size_t *freed = nullptr)
{
    if (freed)
        *freed = 0;
    if (ids.empty())
        return KVC_OK;
    auto defer = [&](size_t from) -> kvc_status {
        std::vector<uint64_t> rest(ids.begin() + from, ids.end());
        std::lock_guard<std::mutex> g(s->mu);
        kvc_status st = check_free_locked(s, rest);
        if (st != KVC_OK)
            return st;
        s->deferred.insert(rest.begin(), rest.end());
        drop_held(s, rest.size());
        if (freed)
            *freed = ids.size();
        return KVC_OK;
    };
    auto ended = [&](size_t from) -> kvc_status {
        {
            std::lock_guard<std::mutex> g(s->mu);
            std::vector<uint64_t> rest(ids.begin() + from, ids.end());
            s->drop_kept_locked(rest);
            drop_held(s, rest.size());
        }
        return s->ended_error();
    };
    if (s->ended.load())
        return ended(0);
    if (s->resuming())
        return defer(0);
    // A resume waits for Frees in flight (it claims what they leave kept).
    std::shared_lock<std::shared_mutex> rw(s->chan_rw);
    if (s->ended.load())
        return ended(0);
    if (s->resuming())
        return defer(0);
    const uint64_t gen = s->resumes.load();
    std::shared_ptr<Chan> ch = s->chan_copy();
    std::vector<uint64_t> seqs;
    {
        std::lock_guard<std::mutex> g(s->mu);
        seqs = s->kept_seqs_locked(ids);
    }
    size_t done = 0;
    kvc_status st = chan_free(s, ch.get(), ids, &done);
    {
        std::lock_guard<std::mutex> g(s->mu);
        s->unkeep_seqs_locked(ids, seqs, done);
        drop_held(s, done);
    }
    if (freed)
        *freed = done;
    if (st == KVC_OK)
        return KVC_OK;
    if (s->ended.load()) {  // ended meanwhile: the daemon took everything back
        std::string msg = kvc_last_error();
        ended(done);
        return kvc_fail(st, "%s", msg.c_str());
    }
    if (s->resumable && !s->closing.load() &&
        (st == KVC_ERR_UNAVAILABLE || s->resuming() || s->resumes.load() != gen))
        return defer(done);
    return st;
}

// Keep a duplicate of each page fd (resumable sessions): ADOPT re-sends them.
kvc_status keep_fds(kvc_session *s, const std::vector<uint64_t> &ids, const std::vector<int> &fds)
{
    if (!s->resumable)
        return KVC_OK;
    std::vector<int> dups;
    for (int fd : fds) {
        int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (d < 0 && errno == EMFILE) {
            // One fd per page held: raise the soft limit to the hard one.
            struct rlimit rl;
            if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
                rl.rlim_cur = rl.rlim_max;
                setrlimit(RLIMIT_NOFILE, &rl);
            }
            d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        }
        if (d < 0) {
            int e = errno;
            close_fds(dups);
            return kvc_fail(KVC_ERR_SYSTEM,
                            "cannot keep a duplicate page fd for resuming (%s; a resumable "
                            "session holds one fd per page: raise RLIMIT_NOFILE)",
                            std::strerror(e));
        }
        dups.push_back(d);
    }
    std::lock_guard<std::mutex> g(s->mu);
    for (size_t i = 0; i < ids.size(); i++) {
        // An entry still there is the same id lent before, whose Free's
        // REPLY is on its way: that Free forgets only its own entry (seq).
        auto it = s->keep.find(ids[i]);
        if (it != s->keep.end())
            close(it->second.fd);
        s->keep[ids[i]] = kvc_session::Kept{dups[i], ++s->keep_seq};
    }
    return KVC_OK;
}

// One ALLOCATE of `chunk` pages on the fd channel: its pages (PAGES with
// allocation id req|1<<63, filed while we wait) and then its REPLY.
kvc_status chan_allocate_chunk(kvc_session *s, Chan *ch, uint32_t chunk, std::vector<uint64_t> &ids,
                               std::vector<int> &fds)
{
    uint64_t req = chan_next_req(ch);
    const bool wait = s->wait.load();
    const uint32_t wait_ms = s->wait_timeout_ms.load();
    uint32_t flags = wait ? KVC_FD_ALLOC_WAIT : 0;
    uint8_t buf[KVC_FD_HEADER_SIZE + KVC_FD_ALLOCATE_FIXED + 1024];
    size_t len = kvc_fd_encode_allocate(buf, sizeof buf, req, chunk, flags, wait_ms,
                                        s->device.c_str());
    if (!len)
        return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "device uuid \"%s\" is too long", s->device.c_str());
    uint64_t timeout = s->conn->timeout_ms.load();
    if (timeout)  // as the gRPC deadline: a waiting Allocate may take the daemon's wait too
        timeout += wait ? (wait_ms ? wait_ms : 30000) : 0;
    Chan::Reply rep;
    Chan::Stash got;
    kvc_status st = chan_request(s, ch, req, buf, len, timeout, "Allocate", &rep, &got);
    if (st != KVC_OK)
        return st;
    ids.clear();
    fds.clear();
    for (auto &p : got.pages) {
        ids.push_back(p.second.first);
        fds.push_back(p.second.second);
    }
    if (rep.code != 0) {
        close_fds(fds);
        kvc_status k = kvc_status_from_grpc_code(static_cast<int>(rep.code));
        return kvc_fail(k == KVC_OK ? KVC_ERR_PROTOCOL : k, "Allocate: %s", rep.message.c_str());
    }
    bool whole = got.total == chunk && got.pages.size() == chunk &&
                 got.pages.begin()->first == 0 && got.pages.rbegin()->first == chunk - 1;
    if (!whole) {
        // The daemon broke the protocol: the channel closes (the daemon
        // then ends the session and takes its pages back).
        close_fds(fds);
        return chan_protocol_error(
            s, ch,
            "a REPLY OK to an ALLOCATE of " + std::to_string(chunk) + " pages came after " +
                std::to_string(got.pages.size()) + " of them (PAGES total " +
                std::to_string(got.total) + ")");
    }
    return KVC_OK;
}

// Allocate n pages on the fd channel (split past max_pages_per_request).
// All or nothing. Allocations run concurrently (chan_rw shared).
kvc_status chan_session_allocate(kvc_session *s, uint64_t n, std::vector<uint64_t> &ids,
                                 std::vector<int> &fds)
{
    std::shared_lock<std::shared_mutex> rw(s->chan_rw);
    kvc_status live = s->check_live();  // a resume may have ended while we waited
    if (live != KVC_OK)
        return live;
    std::shared_ptr<Chan> ch = s->chan_copy();
    {
        std::lock_guard<std::mutex> w(s->watch_mu);
        s->available_pending = false;
    }
    uint64_t done = 0;
    while (done < n) {
        uint32_t chunk = static_cast<uint32_t>(std::min<uint64_t>(n - done, s->max_pages));
        std::vector<uint64_t> got_ids;
        std::vector<int> got_fds;
        kvc_status k = chan_allocate_chunk(s, ch.get(), chunk, got_ids, got_fds);
        if (k == KVC_OK) {
            s->held_pages += chunk;
            k = keep_fds(s, got_ids, got_fds);
            if (k != KVC_OK) {
                std::string msg = kvc_last_error();
                close_fds(got_fds);
                size_t freed = 0;
                chan_free(s, ch.get(), got_ids, &freed);
                drop_held(s, chunk);
                kvc_fail(k, "%s", msg.c_str());
            }
        }
        if (k != KVC_OK) {
            std::string msg = kvc_last_error();
            close_fds(fds);
            size_t freed = 0;
            if (!ids.empty() && chan_free(s, ch.get(), ids, &freed) != KVC_OK && s->resumable) {
                std::lock_guard<std::mutex> g(s->mu);
                s->deferred.insert(ids.begin() + freed, ids.end());
            }
            {
                std::lock_guard<std::mutex> g(s->mu);
                std::vector<uint64_t> mine(ids.begin(), ids.begin() + freed);
                s->drop_kept_locked(mine);
            }
            drop_held(s, ids.size());
            ids.clear();
            return kvc_fail(k, "%s", msg.c_str());
        }
        ids.insert(ids.end(), got_ids.begin(), got_ids.end());
        fds.insert(fds.end(), got_fds.begin(), got_fds.end());
        done += chunk;
    }
    return KVC_OK;
}

// Allocate n pages (split past max_pages_per_request), with their fds.
// All or nothing.
kvc_status session_allocate(kvc_session *s, uint64_t n, std::vector<uint64_t> &ids,
                            std::vector<int> &fds)
{
    ids.clear();
    fds.clear();
    kvc_status live = s->check_live();
    if (live != KVC_OK)
        return live;
    uint64_t limit = s->limit.load();
    if (limit && (s->held_pages.load() + n) * s->page_size > limit)
        return kvc_fail(KVC_ERR_RESOURCE_EXHAUSTED,
                        "session limit: %llu bytes held + %llu asked > limit %llu "
                        "(kvc_session_set_limit)",
                        (unsigned long long)(s->held_pages.load() * s->page_size),
                        (unsigned long long)(n * s->page_size), (unsigned long long)limit);
    return chan_session_allocate(s, n, ids, fds);
}

// ---- regions ----------------------------------------------------------

kvc_status region_new(kvc_session *s, uint64_t max_bytes, kvc_region **out)
{
    if (s->ended.load())
        return s->ended_error();
    uint64_t size = kvc_round_up(max_bytes, s->page_size);
    if (max_bytes == 0 || size == 0)
        return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "region size %llu: must be 1..2^64-page",
                        (unsigned long long)max_bytes);
    uint64_t npages = size / s->page_size;
    if (npages > (1ull << 32))
        return kvc_fail(KVC_ERR_NO_MEMORY, "region of %llu bytes is beyond any address space",
                        (unsigned long long)size);
    auto r = std::make_unique<kvc_region>();
    r->session = s;
    r->size = size;
    r->requested = max_bytes;
    r->page = s->page_size;
    kvc_status st = kvc_mapper_reserve(s->mapper, size, s->page_size, &r->base);
    if (st != KVC_OK)
        return st;
    try {
        r->ids.assign(npages, 0);
        r->mapped.assign(npages, 0);
    } catch (...) {
        kvc_mapper_release(s->mapper, r->base, r->size);
        return kvc_fail(KVC_ERR_NO_MEMORY, "no memory for the books of %llu pages",
                        (unsigned long long)npages);
    }
    {
        std::lock_guard<std::mutex> g(s->mu);
        s->regions++;
    }
    *out = r.release();
    return KVC_OK;
}

// Map a sorted, unique list of unmapped slots with one allocation.
kvc_status region_map_slots(kvc_region *r, const std::vector<uint64_t> &slots)
{
    if (slots.empty())
        return KVC_OK;
    kvc_session *s = r->session;
    std::vector<uint64_t> ids;
    std::vector<int> fds;
    kvc_status st = session_allocate(s, slots.size(), ids, fds);
    if (st != KVC_OK)
        return st;
    for (size_t i = 0; i < slots.size(); i++) {
        st = kvc_mapper_map(s->mapper, r->base + slots[i] * r->page, fds[i], r->page);
        fds[i] = -1;
        if (st != KVC_OK) {
            std::string msg = kvc_last_error();
            for (size_t j = i + 1; j < fds.size(); j++)
                close(fds[j]);
            for (size_t j = 0; j < i; j++)
                kvc_mapper_unmap(s->mapper, r->base + slots[j] * r->page, r->page);
            session_free_ids(s, ids);
            return kvc_fail(st, "%s", msg.c_str());
        }
    }
    for (size_t i = 0; i < slots.size(); i++) {
        r->ids[slots[i]] = ids[i];
        r->mapped[slots[i]] = kSlotMapped;
    }
    r->mapped_pages += slots.size();
    return KVC_OK;
}

kvc_status region_unmap_slots(kvc_region *r, const std::vector<uint64_t> &slots)
{
    kvc_session *s = r->session;
    std::vector<uint64_t> ids;
    kvc_status first = KVC_OK;
    std::string msg;
    for (uint64_t k : slots) {
        if (!r->mapped[k])
            continue;
        kvc_status st = kvc_mapper_unmap(s->mapper, r->base + k * r->page, r->page);
        if (st != KVC_OK) {
            if (first == KVC_OK) {
                first = st;
                msg = kvc_last_error();
            }
            continue;  // still mapped: keep it on the books
        }
        bool orphan = r->mapped[k] == kSlotOrphan;
        r->mapped[k] = kSlotFree;
        r->mapped_pages--;
        if (!orphan)
            ids.push_back(r->ids[k]);
    }
    kvc_status st = session_free_ids(s, ids);
    // After the session ended the daemon took its pages back: unmapping is
    // local only (regions of an ended session can still be unmapped and
    // destroyed).
    if (st != KVC_OK && s->ended.load())
        st = KVC_OK;
    if (first != KVC_OK)
        return kvc_fail(first, "%s", msg.c_str());
    return st;
}

kvc_status check_ranges(const kvc_region *r, const kvc_range *ranges, size_t n)
{
    if (n && !ranges)
        return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "ranges is NULL");
    for (size_t i = 0; i < n; i++) {
        uint64_t f = 0, e = 0;
        if (kvc_pages_covering(ranges[i].offset, ranges[i].size, r->size, r->page, &f, &e) != 0)
            return kvc_fail(KVC_ERR_INVALID_ARGUMENT,
                            "range %zu [%llu, +%llu) lies outside the region's %llu bytes", i,
                            (unsigned long long)ranges[i].offset,
                            (unsigned long long)ranges[i].size, (unsigned long long)r->size);
    }
    return KVC_OK;
}

kvc_status region_map_ranges(kvc_region *r, const kvc_range *ranges, size_t n)
{
    kvc_status st = check_ranges(r, ranges, n);
    if (st != KVC_OK)
        return st;
    std::lock_guard<std::mutex> g(r->mu);
    std::vector<uint64_t> slots;
    for (size_t i = 0; i < n; i++) {
        uint64_t f = 0, e = 0;
        kvc_pages_covering(ranges[i].offset, ranges[i].size, r->size, r->page, &f, &e);
        for (uint64_t k = f; k < e; k++)
            if (!r->mapped[k])
                slots.push_back(k);
    }
    std::sort(slots.begin(), slots.end());
    slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
    return region_map_slots(r, slots);
}

kvc_status region_unmap_ranges(kvc_region *r, const kvc_range *ranges, size_t n)
{
    kvc_status st = check_ranges(r, ranges, n);
    if (st != KVC_OK)
        return st;
    std::lock_guard<std::mutex> g(r->mu);
    std::vector<uint64_t> slots;
    for (size_t i = 0; i < n; i++) {
        uint64_t f = 0, e = 0;
        // A range that runs to the region's end (as requested, or as
        // reserved) releases its last page: the bytes past the requested
        // size are the region's own padding, not anyone's data.
        uint64_t size = ranges[i].size;
        if (size > 0 && ranges[i].offset + size >= r->requested)
            size = r->size - ranges[i].offset;
        kvc_pages_inside(ranges[i].offset, size, r->size, r->page, &f, &e);
        for (uint64_t k = f; k < e; k++)
            if (r->mapped[k])
                slots.push_back(k);
    }
    std::sort(slots.begin(), slots.end());
    slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
    return region_unmap_slots(r, slots);
}

void region_delete(kvc_region *r)
{
    kvc_session *s = r->session;
    {
        std::lock_guard<std::mutex> g(r->mu);
        std::vector<uint64_t> all;
        for (uint64_t k = 0; k < r->mapped.size(); k++)
            if (r->mapped[k])
                all.push_back(k);
        region_unmap_slots(r, all);
        kvc_mapper_release(s->mapper, r->base, r->size);
    }
    {
        std::lock_guard<std::mutex> g(s->mu);
        s->regions--;
    }
    delete r;
}

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
            if (!r->mapped[k])
                return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                                "byte %llu of the region is not mapped (page %llu)",
                                (unsigned long long)std::max(offset, k * r->page),
                                (unsigned long long)k);
    for (uint64_t k = f; k < e; k++) {
        if (!r->mapped[k])
            continue;
        uint64_t lo = std::max(offset, k * r->page);
        uint64_t hi = std::min(offset + size, (k + 1) * r->page);
        kvc_status st = op(lo, hi - lo);
        if (st != KVC_OK)
            return st;
    }
    return kvc_mapper_sync(r->session->mapper);
}

// ---- Watch ------------------------------------------------------------

// One Watch stream; returns its final status.
grpc::Status watch_stream(kvc_session *s, grpc::ClientContext *ctx)
{
    pb::WatchRequest req;
    *req.mutable_session() = s->ref_copy();
    auto reader = s->conn->stub->Watch(ctx, req);
    pb::WatchEvent ev;
    while (reader->Read(&ev)) {
        switch (ev.kind()) {
        case pb::WatchEvent::READY: {
            std::lock_guard<std::mutex> g(s->watch_mu);
            s->watch_ready = true;
            break;
        }
        case pb::WatchEvent::RECLAIM: {
            std::lock_guard<std::mutex> g(s->cb_mu);
            if (s->reclaim_fn) {
                kvc_reclaim rq;
                rq.device = ev.reclaim().device().c_str();
                rq.pages = ev.reclaim().pages();
                rq.bytes = rq.pages * s->page_size;
                rq.deadline_unix = ev.reclaim().deadline_unix();
                rq.reason = ev.reclaim().reason().c_str();
                rq.id = ev.reclaim().id();
                try {
                    s->reclaim_fn(s->reclaim_user, &rq);
                } catch (...) {
                    // A C callback cannot throw; a C++ one must not take the
                    // thread down.
                }
            }
            break;
        }
        case pb::WatchEvent::MEMORY_AVAILABLE: {
            std::lock_guard<std::mutex> g(s->watch_mu);
            s->available_pending = true;
            break;
        }
        case pb::WatchEvent::SHUTDOWN:
            s->mark_ended(KVC_ERR_FAILED_PRECONDITION, "session " + std::to_string(s->id) +
                                                           " ended: the daemon is shutting down: " +
                                                           ev.shutdown().reason());
            break;
        default:
            break;
        }
        s->watch_cv.notify_all();
    }
    return reader->Finish();
}

// The Watch thread. On a resumable session a stream cut by the daemon's
// death is opened again (with the new SessionRef) once the session resumed.
bool channel_gone(kvc_session *s);

void watch_loop(kvc_session *s)
{
    grpc::Status st;
    for (;;) {
        uint64_t gen = s->resumes.load();
        grpc::ClientContext *ctx;
        {
            std::lock_guard<std::mutex> g(s->watch_mu);
            if (s->watch_stopping)
                break;
            s->watch_ctx = std::make_unique<grpc::ClientContext>();
            ctx = s->watch_ctx.get();
        }
        st = watch_stream(s, ctx);
        if (!s->resumable && !st.ok() && !s->ended.load() && !s->closing.load()) {
            // A session that cannot be resumed is over when its daemon is
            // gone: say so now (its fd channel closed), not at the next call.
            bool stopping;
            {
                std::lock_guard<std::mutex> g(s->watch_mu);
                stopping = s->watch_stopping;
            }
            if (!stopping && channel_gone(s))
                s->mark_ended(KVC_ERR_FAILED_PRECONDITION, s->hangup_message());
        }
        if (!s->resumable || st.ok() || s->ended.load())
            break;
        std::unique_lock<std::mutex> g(s->watch_mu);
        if (s->watch_stopping)
            break;
        // A daemon that died cuts the stream about when its fd channel
        // hangs up; anything else ends the thread as before.
        s->watch_cv.wait_for(g, std::chrono::seconds(2), [&] {
            return s->watch_stopping || s->ended.load() || s->state.load() == kResuming ||
                   s->resumes.load() != gen;
        });
        if (s->state.load() != kResuming && s->resumes.load() == gen)
            break;
        s->watch_cv.wait(g, [&] {
            return s->watch_stopping || s->ended.load() ||
                   (s->state.load() == kLive && s->resumes.load() != gen);
        });
        if (s->watch_stopping || s->ended.load())
            break;
        s->watch_ready = false;
    }
    {
        std::lock_guard<std::mutex> g(s->watch_mu);
        s->watch_done = true;
        s->watch_status = st;
    }
    s->watch_cv.notify_all();
}

kvc_status watch_start(kvc_session *s)
{
    std::unique_lock<std::mutex> g(s->watch_mu);
    if (!s->watch_started) {
        if (s->ended.load()) {
            g.unlock();
            return s->ended_error();
        }
        if (s->resuming()) {
            g.unlock();
            return s->resuming_error();
        }
        s->watch_started = true;
        s->watch = std::thread(watch_loop, s);
    }
    uint32_t t = s->conn->timeout_ms.load();
    auto ready = [s] { return s->watch_ready || s->watch_done; };
    if (t)
        s->watch_cv.wait_for(g, std::chrono::milliseconds(t), ready);
    else
        s->watch_cv.wait(g, ready);
    if (s->watch_ready)
        return KVC_OK;
    if (s->watch_done)
        return s->rpc_error(s->watch_status, "Watch");
    if (s->resuming()) {
        g.unlock();
        return s->resuming_error();
    }
    return kvc_fail(KVC_ERR_DEADLINE_EXCEEDED, "Watch: no READY event within %u ms", t);
}

void watch_stop(kvc_session *s)
{
    std::thread t;
    {
        std::lock_guard<std::mutex> g(s->watch_mu);
        if (!s->watch_started)
            return;
        s->watch_stopping = true;
        if (s->watch_ctx)
            s->watch_ctx->TryCancel();
        t = std::move(s->watch);
    }
    s->watch_cv.notify_all();
    if (t.joinable())
        t.join();
}

// ---- resume after a daemon restart ---------------------------------------

// After the fd channel hung up: did the daemon end the session (GOODBYE or
// ERROR still queued) or did it go away? Records left unread are dropped
// (page fds of an allocation nobody waits for: not claimed, so forgotten).
bool channel_gone(kvc_session *s)
{
    // Requests may be waiting on it: read as one of them would.
    std::shared_ptr<Chan> ch = s->chan_copy();
    chan_pump_pending(s, ch.get());
    std::lock_guard<std::mutex> g(ch->mu);
    return ch->end == Chan::kGone && !s->ended.load();
}

// Sleep up to ms, or until the session closes. False if it is closing.
bool resume_sleep(kvc_session *s, uint32_t ms)
{
    std::unique_lock<std::mutex> g(s->watch_mu);
    s->watch_cv.wait_for(g, std::chrono::milliseconds(ms), [s] { return s->closing.load(); });
    return !s->closing.load();
}

// The session is dead: the daemon refused the claim or did not come back.
void resume_failed(kvc_session *s, const std::string &why)
{
    s->mark_ended(KVC_ERR_FAILED_PRECONDITION, why);
    s->drop_all_kept();
}

// Reconnect with backoff, new fd channel + HELLO, ADOPT every page still
// held (not the ones whose Free could not reach the daemon), ResumeSession,
// swap in the new channel and SessionRef. True once resumed.
bool session_resume(kvc_session *s)
{
    s->note_gone();
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(kResumeTimeoutMs);
    uint32_t delay = kResumeFirstDelayMs;
    std::string last = "no answer";
    auto backoff = [&] {
        bool go = resume_sleep(s, delay);
        delay = std::min(delay * 2, kResumeMaxDelayMs);
        return go;
    };
    char err[512];
    while (!s->closing.load() && std::chrono::steady_clock::now() < deadline) {
        uint32_t t = s->conn->timeout_ms.load();
        if (t == 0)
            t = kDefaultTimeoutMs;
        pb::GetInfoResponse info;
        {
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1000));
            grpc::Status gs = s->conn->stub->GetInfo(&ctx, pb::GetInfoRequest(), &info);
            if (!gs.ok()) {
                last = "GetInfo: " + gs.error_message();
                if (!backoff())
                    return false;
                continue;
            }
        }
        if (!info.fd_channel_requests()) {
            resume_failed(s, "session " + std::to_string(s->id) +
                                 " could not be resumed after the daemon restarted: the restarted "
                                 "daemon (version " + info.version() +
                              ") takes no page requests on the fd channel "
                              "(GetInfo().fd_channel_requests is false)");
            return false;
        }
        int nfd = -1;
        kvc_status st = kvc_fd_connect(info.fd_socket().c_str(), &nfd, err, sizeof err);
        auto hello = std::make_unique<kvc_fd_record>();
        if (st == KVC_OK) {
            int eof = 0;
            st = kvc_fd_recv(nfd, static_cast<int>(t), hello.get(), &eof, err, sizeof err);
            if (st == KVC_OK && (eof || hello->type != KVC_FD_HELLO)) {
                if (!eof)
                    kvc_fd_record_close_fds(hello.get());
                std::snprintf(err, sizeof err, "no HELLO on the new fd channel");
                st = KVC_ERR_UNAVAILABLE;
            }
        }
        if (st != KVC_OK) {
            if (nfd >= 0)
                close(nfd);
            last = std::string("fd channel: ") + err;
            if (!backoff())
                return false;
            continue;
        }

        // No channel allocation between its answer and keeping its fds.
        std::unique_lock<std::shared_mutex> rw(s->chan_rw);
        std::vector<uint64_t> ids;
        bool sent = true;
        {
            std::lock_guard<std::mutex> g(s->mu);
            // Not claiming a page whose Free failed gives it back.
            std::vector<uint64_t> gone(s->deferred.begin(), s->deferred.end());
            s->drop_kept_locked(gone);
            s->deferred.clear();
            std::vector<int> fds;
            for (auto &kv : s->keep) {
                ids.push_back(kv.first);
                fds.push_back(kv.second.fd);
            }
            std::vector<uint8_t> buf(KVC_FD_MAX_RECORD);
            for (size_t i = 0; sent && i < ids.size(); i += KVC_FD_MAX_FDS) {
                uint32_t n = static_cast<uint32_t>(std::min<size_t>(KVC_FD_MAX_FDS, ids.size() - i));
                size_t len = kvc_fd_encode_adopt(buf.data(), buf.size(), s->id,
                                                 static_cast<uint32_t>(i),
                                                 static_cast<uint32_t>(ids.size()), &ids[i], n);
                sent = len > 0 && kvc_fd_send(nfd, buf.data(), len, &fds[i], n, err,
                                              sizeof err) == KVC_OK;
            }
        }
        if (!sent) {
            close(nfd);
            rw.unlock();
            last = std::string("ADOPT: ") + err;
            if (!backoff())
                return false;
            continue;
        }
        pb::ResumeSessionRequest req;
        req.set_channel_secret(hello->secret, KVC_FD_SECRET_SIZE);
        req.set_session_id(s->id);
        req.set_resume_token(s->resume_token);
        for (uint64_t i : ids)
            req.add_page_ids(i);
        pb::ResumeSessionResponse resp;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(t));
        grpc::Status gs = s->conn->stub->ResumeSession(&ctx, req, &resp);
        if (!gs.ok()) {
            close(nfd);
            rw.unlock();
            if (gs.error_code() == grpc::StatusCode::UNAVAILABLE ||
                gs.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
                last = "ResumeSession: " + gs.error_message();
                if (!backoff())
                    return false;
                continue;
            }
            resume_failed(s, "session " + std::to_string(s->id) +
                                 " could not be resumed after the daemon restarted: " +
                                 gs.error_message());
            return false;
        }
        std::vector<uint64_t> late;  // Frees deferred while the claim was in flight
        {
            std::lock_guard<std::mutex> g(s->mu);
            s->chan = std::make_shared<Chan>(nfd);  // the old one closes with its last user
            s->fd = nfd;
            s->ref = resp.session();
            s->admin = resp.admin();
            for (uint64_t i : s->deferred)
                if (s->keep.count(i))
                    late.push_back(i);
            for (uint64_t i : late)
                s->deferred.erase(i);
            s->resumes++;
            s->state = kLive;
        }
        rw.unlock();
        s->notify();
        if (!late.empty()) {
            // Claimed, but the caller gave them back meanwhile: Free them now
            // (held_pages already counts them as gone).
            std::shared_ptr<Chan> ch = s->chan_copy();
            size_t done = 0;
            chan_free(s, ch.get(), late, &done);
            std::lock_guard<std::mutex> g(s->mu);
            std::vector<uint64_t> freed(late.begin(), late.begin() + done);
            s->drop_kept_locked(freed);
            s->deferred.insert(late.begin() + done, late.end());
        }
        return true;
    }
    if (s->closing.load())
        return false;
    resume_failed(s, "session " + std::to_string(s->id) +
                         " could not be resumed: the daemon did not come back within " +
                         std::to_string(kResumeTimeoutMs / 1000) + " s (last: " + last + ")");
    return false;
}

// The monitor thread of every session: reads the fd channel while no
// request waits (so a GOODBYE, an ERROR, a hang-up or a complete allocation
// nobody waits for is handled at once, not at the next call: the waiters
// read while they wait), and resumes a resumable session when its daemon
// went away. Runs until the session closes.
void monitor_loop(kvc_session *s)
{
    while (!s->closing.load()) {
        std::shared_ptr<Chan> ch = s->chan_copy();  // only this thread replaces it
        bool open, gone;
        {
            std::lock_guard<std::mutex> g(ch->mu);
            open = ch->end == Chan::kOpen;
            gone = ch->end == Chan::kGone;
        }
        if (gone && s->resumable && !s->ended.load()) {
            // The daemon went away (whoever read the end of the stream).
            // False: ended or closing (the loop then waits for close).
            session_resume(s);
            continue;
        }
        struct pollfd p[2];
        p[0].fd = s->wake_fd;
        p[0].events = POLLIN;
        p[0].revents = 0;
        p[1].fd = ch->fd;
        p[1].events = POLLIN | POLLRDHUP;
        p[1].revents = 0;
        // An ended channel is not polled (it stays readable at its end).
        int n = poll(p, open ? 2 : 1, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        if (s->closing.load())
            return;
        if (open && p[1].revents)
            chan_pump_pending(s, ch.get());
    }
}

void monitor_stop(kvc_session *s)
{
    s->closing = true;
    if (s->wake_fd >= 0) {
        uint64_t one = 1;
        ssize_t n = write(s->wake_fd, &one, sizeof one);
        (void)n;
    }
    s->notify();
    if (s->monitor.joinable())
        s->monitor.join();
    if (s->wake_fd >= 0)
        close(s->wake_fd);
    s->wake_fd = -1;
}

void fill_pool(kvc_pool_stats *o, const pb::PoolStats &p)
{
    o->budget_bytes = p.budget_bytes();
    o->pooled_bytes = p.pooled_bytes();
    o->in_use_bytes = p.in_use_bytes();
    o->free_bytes = p.free_bytes();
    o->page_size = p.page_size();
    o->pages_pooled = p.pages_pooled();
    o->pages_in_use = p.pages_in_use();
}

kvc_status session_stats(kvc_session *s, kvc_stats *out)
{
    kvc_status live = s->check_live();
    if (live != KVC_OK)
        return live;
    pb::GetStatsRequest req;
    *req.mutable_session() = s->ref_copy();
    pb::GetStatsResponse resp;
    grpc::ClientContext ctx;
    s->conn->prepare(ctx);
    grpc::Status st = s->conn->stub->GetStats(&ctx, req, &resp);
    if (!st.ok())
        return s->rpc_error(st, "GetStats");
    kvc_stats o;
    std::memset(&o, 0, sizeof o);
    o.struct_size = sizeof o;
    fill_pool(&o.total, resp.total());
    for (const auto &d : resp.devices())
        if (d.device().uuid() == s->device)
            fill_pool(&o.device, d.pool());
    for (const auto &ss : resp.sessions())
        if (ss.id() == s->id) {
            o.held_bytes = ss.held_bytes();
            o.pages_held = ss.pages_held();
            o.guaranteed_bytes = ss.guaranteed_bytes();
            o.max_bytes = ss.max_bytes();
            o.priority = ss.priority();
            o.reclaim_ignored = ss.reclaim_ignored();
            o.allocations_total = ss.allocations_total();
            o.frees_total = ss.frees_total();
            o.pid = ss.pid();
        }
    o.sessions_open = resp.sessions_open();
    o.uptime_seconds = resp.uptime_seconds();
    std::memcpy(out, &o, std::min(sizeof o, out->struct_size ? out->struct_size : sizeof o));
    out->struct_size = std::min(sizeof o, out->struct_size ? out->struct_size : sizeof o);
    return KVC_OK;
}

#define NEED(cond, what) \
    if (!(cond))         \
    return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "%s", what)

}  // namespace

// ======================================================================
// C API
// ======================================================================

extern "C" {

KVC_API const char *kvc_socket_from_env(void)
{
    const char *v = std::getenv("OLLAMA_KVCACHED_SOCKET");
    if (v && *v)
        return v;
    v = std::getenv("KVCACHED_SOCKET");
    if (v && *v)
        return v;
    return nullptr;
}

KVC_API kvc_status kvc_client_create(const char *socket_path, kvc_client **out)
{
    return guarded([&]() -> kvc_status {
        NEED(out, "out is NULL");
        *out = nullptr;
        const char *path = socket_path ? socket_path : kvc_socket_from_env();
        if (!path)
            path = kDefaultSocket;
        NEED(*path, "socket path is empty");
        auto conn = std::make_shared<Conn>();
        conn->socket_path = path;
        grpc::ChannelArguments args;
        args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
        // After a daemon restart the channel reconnects within a second.
        // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS stays at its default: gRPC also
        // uses it as the connect (handshake) timeout, and 100 ms makes
        // connecting fail on a loaded machine (or under valgrind).
        args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
        args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
        conn->channel = grpc::CreateCustomChannel(std::string("unix:") + path,
                                                  grpc::InsecureChannelCredentials(), args);
        conn->stub = pb::KVCached::NewStub(conn->channel);
        grpc::ClientContext ctx;
        conn->prepare(ctx);
        grpc::Status st = conn->stub->GetInfo(&ctx, pb::GetInfoRequest(), &conn->info);
        if (!st.ok()) {
            kvc_status k = from_grpc(st, (std::string("GetInfo at ") + path).c_str());
            return k;
        }
        if (conn->info.api_version() != kApiVersion ||
            conn->info.fd_protocol_version() != KVC_FD_VERSION)
            return kvc_fail(KVC_ERR_PROTOCOL,
                            "daemon at %s speaks api %u / fd protocol %u; this library "
                            "speaks %u / %u",
                            path, conn->info.api_version(), conn->info.fd_protocol_version(),
                            kApiVersion, KVC_FD_VERSION);
        if (conn->info.devices_size() == 0)
            return kvc_fail(KVC_ERR_PROTOCOL, "daemon at %s serves no device", path);
        auto c = std::make_unique<kvc_client>();
        c->conn = conn;
        for (const auto &d : conn->info.devices()) {
            kvc_device_info di;
            di.uuid = d.uuid().c_str();
            di.name = d.name().c_str();
            di.kind = d.kind().c_str();
            di.page_size = d.page_size();
            di.granularity = d.granularity();
            di.total_bytes = d.total_bytes();
            di.budget_bytes = d.budget_bytes();
            c->devices.push_back(di);
        }
        *out = c.release();
        return KVC_OK;
    });
}

KVC_API void kvc_client_destroy(kvc_client *client)
{
    try {
        delete client;
    } catch (...) {
    }
}

KVC_API void kvc_client_set_timeout(kvc_client *client, uint32_t timeout_ms)
{
    if (client)
        client->conn->timeout_ms = timeout_ms;
}

KVC_API const char *kvc_client_daemon_version(const kvc_client *client)
{
    return client ? client->conn->info.version().c_str() : "";
}

KVC_API const char *kvc_client_backend(const kvc_client *client)
{
    return client ? client->conn->info.backend().c_str() : "";
}

KVC_API size_t kvc_client_device_count(const kvc_client *client)
{
    return client ? client->devices.size() : 0;
}

KVC_API kvc_status kvc_client_device(const kvc_client *client, size_t index, kvc_device_info *out)
{
    return guarded([&]() -> kvc_status {
        NEED(client && out, "client or out is NULL");
        if (index >= client->devices.size())
            return kvc_fail(KVC_ERR_NOT_FOUND, "device index %zu: the daemon serves %zu", index,
                            client->devices.size());
        *out = client->devices[index];
        return KVC_OK;
    });
}

KVC_API void kvc_session_options_init(kvc_session_options *o)
{
    if (!o)
        return;
    std::memset(o, 0, sizeof *o);
    o->struct_size = sizeof *o;
}

KVC_API kvc_status kvc_session_open(kvc_client *client, const kvc_session_options *o,
                                    kvc_session **out)
{
    return guarded([&]() -> kvc_status {
        NEED(client && o && out, "client, options or out is NULL");
        *out = nullptr;
        NEED(o->struct_size == sizeof(kvc_session_options),
             "options.struct_size is not sizeof(kvc_session_options): call "
             "kvc_session_options_init");
        NEED(o->name, "options.name is NULL");
        NEED(o->num_labels == 0 || o->labels, "options.labels is NULL");
        const pb::GetInfoResponse &info = client->conn->info;
        const pb::DeviceInfo *dev = nullptr;
        for (const auto &d : info.devices())
            if (!o->device || !*o->device || d.uuid() == o->device) {
                dev = &d;
                break;
            }
        if (!dev)
            return kvc_fail(KVC_ERR_NOT_FOUND, "the daemon serves no device %s (first: %s)",
                            o->device, info.devices(0).uuid().c_str());
        // Page operations go on the fd channel only (docs/protocol.md).
        if (!info.fd_channel_requests())
            return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                            "the daemon (version \"%s\") takes no page requests on the fd channel "
                            "(GetInfo().fd_channel_requests is false); this library sends "
                            "Allocate, Free and Close only there: upgrade kvcached-serve",
                            info.version().c_str());

        auto s = std::make_unique<kvc_session>();
        s->conn = client->conn;
        s->device = dev->uuid();
        s->kind = dev->kind();
        s->page_size = dev->page_size();
        s->max_pages = info.max_pages_per_request() ? info.max_pages_per_request() : 1;
        s->wait = o->wait != 0;
        s->wait_timeout_ms = o->wait_timeout_ms;
        if (s->page_size == 0)
            return kvc_fail(KVC_ERR_PROTOCOL, "device %s has page size 0", s->device.c_str());

        kvc_status st;
        auto cleanup = [&] {
            if (s->chan)
                s->chan.reset();  // owns the fd
            else if (s->fd >= 0)
                close(s->fd);
            s->fd = -1;
            kvc_mapper_destroy(s->mapper);
            s->mapper = nullptr;
        };

        char err[512];
        st = kvc_fd_connect(info.fd_socket().c_str(), &s->fd, err, sizeof err);
        if (st != KVC_OK) {
            cleanup();
            return kvc_fail(st, "%s", err);
        }
        auto rec = std::make_unique<kvc_fd_record>();
        int eof = 0;
        uint32_t t = client->conn->timeout_ms.load();
        st = kvc_fd_recv(s->fd, t ? static_cast<int>(t) : -1, rec.get(), &eof, err, sizeof err);
        if (st == KVC_OK && eof)
            st = kvc_fail(KVC_ERR_UNAVAILABLE, "the daemon closed the fd channel before HELLO");
        else if (st == KVC_OK && rec->type == KVC_FD_ERROR) {
            kvc_status k = kvc_status_from_grpc_code(static_cast<int>(rec->error_code));
            st = kvc_fail(k == KVC_OK ? KVC_ERR_PROTOCOL : k, "fd channel refused: %s",
                          rec->message);
        } else if (st == KVC_OK && rec->type != KVC_FD_HELLO) {
            kvc_fd_record_close_fds(rec.get());
            st = kvc_fail(KVC_ERR_PROTOCOL, "first record on the fd channel is type %u, not HELLO",
                          rec->type);
        } else if (st != KVC_OK)
            st = kvc_fail(st, "waiting for HELLO: %s", err);
        if (st != KVC_OK) {
            cleanup();
            return st;
        }

        // The driver is loaded only once the daemon has accepted us.
        if (s->kind == "host")
            st = kvc_mapper_create_host(&s->mapper);
        else if (s->kind == "cuda")
            st = kvc_mapper_create_cuda(s->device.c_str(), &s->mapper);
        else
            st = kvc_fail(KVC_ERR_PROTOCOL, "device %s has unknown kind \"%s\"",
                          s->device.c_str(), s->kind.c_str());
        if (st != KVC_OK) {
            cleanup();
            return st;
        }


        pb::OpenSessionRequest req;
        req.set_channel_secret(rec->secret, KVC_FD_SECRET_SIZE);
        req.set_name(o->name);
        req.set_guaranteed_bytes(o->guaranteed_bytes);
        req.set_max_bytes(o->max_bytes);
        req.set_priority(o->priority);
        for (size_t i = 0; i < o->num_labels; i++) {
            if (!o->labels[i].key || !o->labels[i].value) {
                cleanup();
                return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "label %zu has a NULL key or value", i);
            }
            (*req.mutable_labels())[o->labels[i].key] = o->labels[i].value;
        }
        pb::OpenSessionResponse resp;
        grpc::ClientContext ctx;
        client->conn->prepare(ctx);
        grpc::Status gs = client->conn->stub->OpenSession(&ctx, req, &resp);
        if (!gs.ok()) {
            cleanup();
            return from_grpc(gs, "OpenSession");
        }
        s->chan = std::make_shared<Chan>(s->fd);
        s->ref = resp.session();
        s->id = resp.session().id();
        s->admin = resp.admin();
        s->resume_token = resp.resume_token();
        s->resumable = !s->resume_token.empty();
        s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (s->wake_fd < 0) {
            int e = errno;
            cleanup();
            return kvc_fail(KVC_ERR_SYSTEM, "eventfd: %s", std::strerror(e));
        }
        s->monitor = std::thread(monitor_loop, s.get());
        *out = s.release();
        return KVC_OK;
    });
}

KVC_API kvc_status kvc_session_close(kvc_session *s)
{
    if (!s)
        return KVC_OK;
    return guarded([&]() -> kvc_status {
        {
            std::lock_guard<std::mutex> g(s->watch_mu);
            if (s->watch_started && std::this_thread::get_id() == s->watch.get_id())
                return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                                "kvc_session_close called from the session's reclaim callback");
        }
        {
            std::lock_guard<std::mutex> g(s->mu);
            if (s->regions)
                return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                                "session %llu still has %zu regions or blocks: destroy them first",
                                (unsigned long long)s->id, s->regions);
        }
        // First the resume monitor (a CloseSession hangs up the channel; a
        // resume in progress is abandoned).
        monitor_stop(s);
        if (!s->ended.load() && s->state.load() == kLive) {
            // CLOSE on the channel; the daemon then closes it.
            std::shared_ptr<Chan> ch = s->chan_copy();
            uint64_t req = chan_next_req(ch.get());
            uint8_t buf[KVC_FD_HEADER_SIZE + 8];
            size_t len = kvc_fd_encode_close(buf, sizeof buf, req);
            Chan::Reply rep;
            chan_request(s, ch.get(), req, buf, len, s->conn->timeout_ms.load(), "CloseSession",
                         &rep, nullptr);  // closing the channel ends it anyway
        }
        watch_stop(s);
        s->chan.reset();  // closes the fd channel
        s->fd = -1;
        s->drop_all_kept();
        kvc_mapper_destroy(s->mapper);
        delete s;
        return KVC_OK;
    });
}

KVC_API uint64_t kvc_session_id(const kvc_session *s) { return s ? s->id : 0; }
KVC_API uint64_t kvc_session_page_size(const kvc_session *s) { return s ? s->page_size : 0; }
KVC_API const char *kvc_session_device(const kvc_session *s) { return s ? s->device.c_str() : ""; }
KVC_API const char *kvc_session_kind(const kvc_session *s) { return s ? s->kind.c_str() : ""; }
KVC_API uint64_t kvc_session_held_bytes(const kvc_session *s)
{
    return s ? s->held_pages.load() * s->page_size : 0;
}
KVC_API int kvc_session_ended(const kvc_session *s) { return s && s->ended.load() ? 1 : 0; }
KVC_API int kvc_session_is_admin(const kvc_session *s) { return s && s->admin.load() ? 1 : 0; }
KVC_API int kvc_session_is_resumable(const kvc_session *s) { return s && s->resumable ? 1 : 0; }
KVC_API int kvc_session_is_resuming(const kvc_session *s)
{
    return s && s->resuming() ? 1 : 0;
}
KVC_API uint64_t kvc_session_resume_count(const kvc_session *s)
{
    return s ? s->resumes.load() : 0;
}

KVC_API kvc_status kvc_session_wait_resumed(kvc_session *s, uint32_t timeout_ms)
{
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        if (s->ended.load())
            return s->ended_error();
        if (!s->resumable)
            return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                            "session %llu is not resumable: the daemon keeps no state (start "
                            "kvcached-serve with --state-dir)",
                            (unsigned long long)s->id);
        std::unique_lock<std::mutex> g(s->watch_mu);
        s->watch_cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [s] {
            return s->ended.load() || s->state.load() == kLive;
        });
        g.unlock();
        if (s->ended.load())
            return s->ended_error();
        if (s->state.load() == kLive)
            return KVC_OK;
        return kvc_fail(KVC_ERR_DEADLINE_EXCEEDED,
                        "session %llu is still being resumed after %u ms (the daemon is not "
                        "back yet)",
                        (unsigned long long)s->id, timeout_ms);
    });
}

KVC_API kvc_status kvc_session_get_stats(kvc_session *s, kvc_stats *out)
{
    return guarded([&]() -> kvc_status {
        NEED(s && out, "session or out is NULL");
        return session_stats(s, out);
    });
}

KVC_API kvc_status kvc_session_set_reclaim_callback(kvc_session *s, kvc_reclaim_fn fn,
                                                    void *user_data)
{
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        {
            std::lock_guard<std::mutex> g(s->cb_mu);
            s->reclaim_fn = fn;
            s->reclaim_user = user_data;
        }
        return watch_start(s);
    });
}

KVC_API kvc_status kvc_session_answer_reclaim(kvc_session *s, uint64_t reclaim_id,
                                              uint64_t bytes_given, uint64_t bytes_kept,
                                              const char *reason)
{
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        const size_t rlen = reason ? std::strlen(reason) : 0;
        if (rlen > KVC_FD_MAX_REASON)
            return kvc_fail(KVC_ERR_INVALID_ARGUMENT,
                            "reclaim answer: reason is %zu bytes, at most %u allowed", rlen,
                            KVC_FD_MAX_REASON);
        kvc_status live = s->check_live();
        if (live != KVC_OK)
            return live;
        std::shared_ptr<Chan> ch = s->chan_copy();
        uint8_t buf[KVC_FD_HEADER_SIZE + KVC_FD_ANSWER_FIXED + KVC_FD_MAX_REASON];
        uint64_t req = chan_next_req(ch.get());
        size_t len = kvc_fd_encode_answer(buf, sizeof buf, req, reclaim_id, bytes_given,
                                          bytes_kept, reason);
        if (!len)
            return kvc_fail(KVC_ERR_INTERNAL, "reclaim answer: cannot encode the ANSWER record");
        Chan::Reply rep;
        kvc_status st = chan_request(s, ch.get(), req, buf, len, s->conn->timeout_ms.load(),
                                     "reclaim answer", &rep, nullptr);
        if (st != KVC_OK)
            return st;
        if (rep.code != 0) {
            kvc_status k = kvc_status_from_grpc_code(static_cast<int>(rep.code));
            return kvc_fail(k == KVC_OK ? KVC_ERR_PROTOCOL : k, "reclaim answer (id %llu): %s",
                            (unsigned long long)reclaim_id, rep.message.c_str());
        }
        return KVC_OK;
    });
}

KVC_API kvc_status kvc_session_wait_available(kvc_session *s, uint32_t timeout_ms)
{
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        kvc_status st = watch_start(s);
        if (st != KVC_OK)
            return st;
        std::unique_lock<std::mutex> g(s->watch_mu);
        bool got = s->watch_cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [s] {
            return s->available_pending || s->watch_done || s->ended.load();
        });
        if (s->available_pending) {
            s->available_pending = false;
            return KVC_OK;
        }
        if (s->ended.load()) {
            g.unlock();
            return s->ended_error();
        }
        if (s->watch_done)
            return s->rpc_error(s->watch_status, "Watch ended");
        (void)got;
        return kvc_fail(KVC_ERR_DEADLINE_EXCEEDED,
                        "no MEMORY_AVAILABLE event for device %s within %u ms",
                        s->device.c_str(), timeout_ms);
    });
}

KVC_API kvc_status kvc_session_request_shrink(kvc_session *s, uint64_t target_id,
                                              uint64_t target_bytes, uint32_t timeout_ms,
                                              uint64_t *pages_requested)
{
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        kvc_status live = s->check_live();
        if (live != KVC_OK)
            return live;
        pb::RequestShrinkRequest req;
        *req.mutable_admin() = s->ref_copy();
        req.set_session_id(target_id);
        req.set_target_bytes(target_bytes);
        req.set_timeout_ms(timeout_ms);
        pb::RequestShrinkResponse resp;
        grpc::ClientContext ctx;
        s->conn->prepare(ctx);
        grpc::Status st = s->conn->stub->RequestShrink(&ctx, req, &resp);
        if (!st.ok())
            return s->rpc_error(st, "RequestShrink");
        if (pages_requested)
            *pages_requested = resp.pages_requested();
        return KVC_OK;
    });
}

KVC_API kvc_status kvc_session_alloc(kvc_session *s, size_t size, void **ptr)
{
    return guarded([&]() -> kvc_status {
        NEED(s && ptr, "session or ptr is NULL");
        *ptr = nullptr;
        NEED(size > 0, "size is 0");
        kvc_region *r = nullptr;
        kvc_status st = region_new(s, size, &r);
        if (st != KVC_OK)
            return st;
        kvc_range all = {0, r->size};
        st = region_map_ranges(r, &all, 1);
        if (st != KVC_OK) {
            std::string msg = kvc_last_error();
            region_delete(r);
            return kvc_fail(st, "%s", msg.c_str());
        }
        std::lock_guard<std::mutex> g(s->mu);
        s->blocks[r->base] = r;
        *ptr = reinterpret_cast<void *>(r->base);
        return KVC_OK;
    });
}

KVC_API kvc_status kvc_session_free(kvc_session *s, void *ptr)
{
    if (!ptr)
        return KVC_OK;
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        kvc_region *r = nullptr;
        {
            std::lock_guard<std::mutex> g(s->mu);
            auto it = s->blocks.find(reinterpret_cast<uintptr_t>(ptr));
            if (it == s->blocks.end())
                return kvc_fail(KVC_ERR_NOT_FOUND,
                                "%p is not a block of session %llu (kvc_session_alloc)", ptr,
                                (unsigned long long)s->id);
            r = it->second;
            s->blocks.erase(it);
        }
        region_delete(r);
        return KVC_OK;
    });
}

KVC_API kvc_status kvc_session_alloc_pages(kvc_session *s, uint32_t num_pages, uint64_t *page_ids,
                                           int *fds)
{
    return guarded([&]() -> kvc_status {
        NEED(s && page_ids && fds, "session, page_ids or fds is NULL");
        NEED(num_pages > 0, "num_pages is 0");
        std::vector<uint64_t> ids;
        std::vector<int> got;
        kvc_status st = session_allocate(s, num_pages, ids, got);
        if (st != KVC_OK)
            return st;
        std::copy(ids.begin(), ids.end(), page_ids);
        std::copy(got.begin(), got.end(), fds);
        return KVC_OK;
    });
}

KVC_API kvc_status kvc_session_free_pages(kvc_session *s, const uint64_t *page_ids,
                                          size_t num_pages, uint64_t *pages_freed)
{
    return guarded([&]() -> kvc_status {
        if (pages_freed)
            *pages_freed = 0;
        NEED(s, "session is NULL");
        NEED(num_pages > 0, "Free: page_ids is empty: name the pages to free");
        NEED(page_ids, "page_ids is NULL");
        std::vector<uint64_t> ids(page_ids, page_ids + num_pages);
        kvc_status st = session_free_ids(s, ids);
        if (st == KVC_OK && pages_freed)
            *pages_freed = num_pages;
        return st;
    });
}

KVC_API kvc_status kvc_session_available(kvc_session *s, uint64_t *bytes)
{
    return guarded([&]() -> kvc_status {
        NEED(s && bytes, "session or bytes is NULL");
        kvc_stats st;
        std::memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        kvc_status k = session_stats(s, &st);
        if (k != KVC_OK)
            return k;
        uint64_t avail = st.device.free_bytes + st.device.pooled_bytes;
        uint64_t held = st.held_bytes;
        uint64_t max = st.max_bytes ? st.max_bytes : st.device.budget_bytes;
        avail = std::min(avail, max > held ? max - held : 0);
        uint64_t limit = s->limit.load();
        uint64_t mine = s->held_pages.load() * s->page_size;
        if (limit)
            avail = std::min(avail, limit > mine ? limit - mine : 0);
        *bytes = avail - avail % s->page_size;
        return KVC_OK;
    });
}

KVC_API kvc_status kvc_session_set_limit(kvc_session *s, uint64_t limit_bytes)
{
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        s->limit = limit_bytes;
        return KVC_OK;
    });
}

KVC_API uint64_t kvc_session_limit(const kvc_session *s) { return s ? s->limit.load() : 0; }

KVC_API kvc_status kvc_session_set_wait(kvc_session *s, int wait, uint32_t wait_timeout_ms)
{
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        s->wait_timeout_ms = wait_timeout_ms;
        s->wait = wait != 0;
        return KVC_OK;
    });
}

KVC_API kvc_status kvc_region_create(kvc_session *s, uint64_t max_bytes, kvc_region **out)
{
    return guarded([&]() -> kvc_status {
        NEED(s && out, "session or out is NULL");
        *out = nullptr;
        return region_new(s, max_bytes, out);
    });
}

KVC_API void kvc_region_destroy(kvc_region *r)
{
    if (!r)
        return;
    guarded([&]() -> kvc_status {
        region_delete(r);
        return KVC_OK;
    });
}

KVC_API void *kvc_region_base(const kvc_region *r)
{
    return r ? reinterpret_cast<void *>(r->base) : nullptr;
}
KVC_API uint64_t kvc_region_size(const kvc_region *r) { return r ? r->size : 0; }
KVC_API uint64_t kvc_region_page_size(const kvc_region *r) { return r ? r->page : 0; }
KVC_API uint64_t kvc_region_mapped_bytes(const kvc_region *r)
{
    return r ? r->mapped_pages.load() * r->page : 0;
}

KVC_API kvc_status kvc_region_map(kvc_region *r, uint64_t offset, uint64_t size)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        kvc_range one = {offset, size};
        return region_map_ranges(r, &one, 1);
    });
}

KVC_API kvc_status kvc_region_map_ranges(kvc_region *r, const kvc_range *ranges, size_t n)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        return region_map_ranges(r, ranges, n);
    });
}

KVC_API kvc_status kvc_region_unmap(kvc_region *r, uint64_t offset, uint64_t size)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        kvc_range one = {offset, size};
        return region_unmap_ranges(r, &one, 1);
    });
}

KVC_API kvc_status kvc_region_unmap_ranges(kvc_region *r, const kvc_range *ranges, size_t n)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        return region_unmap_ranges(r, ranges, n);
    });
}

KVC_API kvc_status kvc_region_rebind(kvc_region *r, kvc_session *to)
{
    return guarded([&]() -> kvc_status {
        NEED(r && to, "region or session is NULL");
        kvc_session *from = r->session;
        if (from == to)
            return KVC_OK;
        if (!from->ended.load())
            return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                            "the region's session %llu is still live: rebinding would orphan the "
                            "pages it lent; close the region or wait until that session ended",
                            (unsigned long long)from->id);
        if (to->ended.load())
            return to->ended_error();
        if (to->page_size != r->page || to->kind != from->kind || to->device != from->device)
            return kvc_fail(KVC_ERR_INVALID_ARGUMENT,
                            "session %llu lends %s pages of %llu bytes on %s; the region holds %s "
                            "pages of %llu bytes on %s",
                            (unsigned long long)to->id, to->kind.c_str(),
                            (unsigned long long)to->page_size, to->device.c_str(),
                            from->kind.c_str(), (unsigned long long)r->page,
                            from->device.c_str());
        std::lock_guard<std::mutex> g(r->mu);
        uint64_t owned = 0;
        for (uint64_t k = 0; k < r->mapped.size(); k++)
            if (r->mapped[k] == kSlotMapped) {
                r->mapped[k] = kSlotOrphan;
                r->ids[k] = 0;
                owned++;
            }
        {
            std::lock_guard<std::mutex> f(from->mu);
            from->regions--;
        }
        drop_held(from, owned);
        {
            std::lock_guard<std::mutex> t(to->mu);
            to->regions++;
        }
        // Same device and kind: the new session's mapper unmaps and maps in
        // this reservation as the old one did.
        r->session = to;
        return KVC_OK;
    });
}

KVC_API int kvc_region_is_mapped(kvc_region *r, uint64_t offset, uint64_t size)
{
    if (!r)
        return 0;
    uint64_t f = 0, e = 0;
    if (kvc_pages_covering(offset, size, r->size, r->page, &f, &e) != 0)
        return 0;
    std::lock_guard<std::mutex> g(r->mu);
    for (uint64_t k = f; k < e; k++)
        if (!r->mapped[k])
            return 0;
    return 1;
}

KVC_API kvc_status kvc_region_memset(kvc_region *r, uint64_t offset, uint64_t size, uint8_t value)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        kvc_mapper *m = r->session->mapper;
        return region_each_piece(r, offset, size, false, [&](uint64_t off, uint64_t len) {
            return kvc_mapper_memset(m, r->base + off, value, len);
        });
    });
}

KVC_API kvc_status kvc_region_clear(kvc_region *r, uint8_t value)
{
    return kvc_region_memset(r, 0, r ? r->size : 0, value);
}

KVC_API kvc_status kvc_region_write(kvc_region *r, uint64_t offset, const void *src, uint64_t size)
{
    return guarded([&]() -> kvc_status {
        NEED(r && (src || !size), "region or src is NULL");
        kvc_mapper *m = r->session->mapper;
        const uint8_t *p = static_cast<const uint8_t *>(src);
        return region_each_piece(r, offset, size, true, [&](uint64_t off, uint64_t len) {
            return kvc_mapper_write(m, r->base + off, p + (off - offset), len);
        });
    });
}

KVC_API kvc_status kvc_region_read(kvc_region *r, uint64_t offset, void *dst, uint64_t size)
{
    return guarded([&]() -> kvc_status {
        NEED(r && (dst || !size), "region or dst is NULL");
        kvc_mapper *m = r->session->mapper;
        uint8_t *p = static_cast<uint8_t *>(dst);
        return region_each_piece(r, offset, size, true, [&](uint64_t off, uint64_t len) {
            return kvc_mapper_read(m, r->base + off, p + (off - offset), len);
        });
    });
}

KVC_API kvc_status kvc_layout_page_aligned(uint64_t page_size, const uint64_t *sizes, size_t count,
                                           uint64_t *offsets, uint64_t *total_bytes)
{
    return guarded([&]() -> kvc_status {
        NEED(page_size > 0, "page_size is 0");
        NEED((sizes && offsets) || count == 0, "sizes or offsets is NULL");
        NEED(total_bytes, "total_bytes is NULL");
        uint64_t at = 0;
        for (size_t i = 0; i < count; i++) {
            offsets[i] = at;
            uint64_t len = kvc_round_up(sizes[i], page_size);
            if ((sizes[i] && len == 0) || at > UINT64_MAX - len)
                return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "layout overflows 64 bits at tensor %zu",
                                i);
            at += len;
        }
        *total_bytes = at;
        return KVC_OK;
    });
}

}  // extern "C"
