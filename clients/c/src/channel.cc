// libkvcached: The fd channel of a session: request records and their REPLYs, the reader role, filing
// every record taken off the socket (PAGES by allocation id, REPLY by request id), the
// channel's end (hang-up, GOODBYE, ERROR, protocol error) and what it means for the session.
#include "internal.h"

namespace kvc_impl {

// ---- requests on the fd channel ---------------------------------------

// A FREE of n ids into buf: with keep when the session keeps the handle of
// any page it names (docs/protocol.md "Kept handles": a page is never
// freed without keep while its handle is kept). The length, 0 on failure.
size_t chan_encode_free(kvc_session *s, std::vector<uint8_t> &buf, uint64_t req, const uint64_t *ids,
                        uint32_t n)
{
    buf.resize(KVC_FD_HEADER_SIZE + KVC_FD_FREE_FIXED + 8u * n);
    uint32_t flags = kvc_mapper_kept(s->mapper, ids, n) ? KVC_FD_FREE_KEEP : 0;
    return kvc_fd_encode_free_flags(buf.data(), buf.size(), req, ids, n, flags);
}

// The answer to a DROP, at once, from the reader (docs/protocol.md "DROP is
// answered at once"): release the kept handles of the pages named, then
// send DROPPED naming every page of the DROP, without waiting for its
// REPLY (nobody waits for its id: the REPLY is dropped).
void chan_answer_drop(kvc_session *s, Chan *ch, const std::vector<uint64_t> &ids)
{
    kvc_mapper_drop(s->mapper, ids.data(), ids.size());
    std::vector<uint8_t> buf(KVC_FD_HEADER_SIZE + KVC_FD_FREE_FIXED + 8u * ids.size());
    size_t len = kvc_fd_encode_dropped(buf.data(), buf.size(), chan_next_req(ch), ids.data(),
                                       static_cast<uint32_t>(ids.size()));
    char err[256];
    if (len)
        kvc_fd_send(ch->fd, buf.data(), len, nullptr, 0, err, sizeof err);  // gone: the session ends anyway
}

// Send a FREE for pages nobody will use (an allocation whose requester gave
// up waiting, or stray pages) without waiting for its REPLY (dropped: no
// one waits for its id).
void chan_free_nowait(kvc_session *s, Chan *ch, const std::vector<uint64_t> &ids)
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
        size_t len = chan_encode_free(s, buf, req, &ids[i], n);
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

namespace {

// Whether a record read off the channel is to be filed (ch->mu held): not
// once the channel ended (its fds closed), nor a malformed record or a
// hang-up, which end the channel.
bool chan_file_open_locked(kvc_session *s, Chan *ch, kvc_status st, int eof, const char *err)
{
    if (ch->end != Chan::kOpen) {
        if (st == KVC_OK && !eof)
            kvc_fd_record_close_fds(ch->rec.get());
        return false;
    }
    if (st == KVC_ERR_PROTOCOL) {  // a malformed record (its fds closed)
        ch->end_message = err;
        chan_end_locked(s, ch, Chan::kProtocol);
        return false;
    }
    if (st != KVC_OK || eof) {
        chan_end_locked(s, ch, Chan::kGone);
        return false;
    }
    return true;
}

// What is wrong with a PAGES record given the ones of its allocation
// filed before (empty: nothing).
std::string chan_pages_fault(const Chan::Stash &a, const kvc_fd_record *rec)
{
    if (!a.pages.empty() && a.total != rec->total)
        return "allocation " + std::to_string(rec->allocation_id) + ": a PAGES record says " +
               std::to_string(rec->total) + " pages in all, an earlier one " +
               std::to_string(a.total);
    for (uint32_t i = 0; i < rec->count; i++)
        if (a.pages.count(rec->first_index + i))
            return "allocation " + std::to_string(rec->allocation_id) + ": page index " +
                   std::to_string(rec->first_index + i) + " sent twice";
    return "";
}

// A PAGES record: kept by allocation id until its request is answered; a
// complete allocation nobody waits for goes to *unwanted, to be given back
// at once. False if it contradicts an earlier record (the channel ended).
bool chan_file_pages_locked(kvc_session *s, Chan *ch, kvc_fd_record *rec,
                            std::vector<uint64_t> *unwanted)
{
    Chan::Stash &a = ch->stash[rec->allocation_id];
    std::string fault = chan_pages_fault(a, rec);
    if (!fault.empty()) {
        kvc_fd_record_close_fds(rec);
        ch->end_message = fault;
        chan_end_locked(s, ch, Chan::kProtocol);
        return false;
    }
    a.total = rec->total;
    for (uint32_t i = 0; i < rec->count; i++)
        a.pages.emplace(rec->first_index + i, std::make_pair(rec->page_ids[i], rec->fds[i]));
    rec->num_fds = 0;
    chan_take_unwanted_locked(ch, rec->allocation_id, *unwanted);
    return true;
}

// File one sound record (ch->mu held): a REPLY by request id, PAGES by
// allocation id, a DROP's ids into *dropped (answered without ch->mu); the
// others end the channel. False if the waiters are not to be woken.
bool chan_file_record_locked(kvc_session *s, Chan *ch, kvc_fd_record *rec,
                             std::vector<uint64_t> *unwanted, std::vector<uint64_t> *dropped)
{
    switch (rec->type) {
    case KVC_FD_REPLY:
        // A REPLY no request waits for (it gave up, or never existed) is dropped.
        if (ch->waiting.count(rec->req_id)) {
            Chan::Reply &r = ch->replies[rec->req_id];
            r.code = rec->error_code;
            r.value = rec->value;
            r.message = rec->message;
        }
        return true;
    case KVC_FD_PAGES:
        return chan_file_pages_locked(s, ch, rec, unwanted);
    case KVC_FD_DROP:
        dropped->resize(rec->count);
        for (uint32_t i = 0; i < rec->count; i++)
            (*dropped)[i] = kvc_fd_record_id(rec, i);
        return true;
    case KVC_FD_GOODBYE:
        chan_end_locked(s, ch, Chan::kGoodbye);
        return true;
    case KVC_FD_ERROR:
        ch->end_code = rec->error_code;
        ch->end_message = rec->message;
        chan_end_locked(s, ch, Chan::kError);
        return true;
    default:  // HELLO again (kvc_fd_decode refuses records only clients send)
        kvc_fd_record_close_fds(rec);
        ch->end_message = "the daemon sent a record of type " + std::to_string(rec->type) +
                          " (a second HELLO)";
        chan_end_locked(s, ch, Chan::kProtocol);
        return true;
    }
}

}  // namespace

// File one record taken off the channel (the caller is the reader; ch->mu
// not held). st/eof/err are what kvc_fd_recv said.
void chan_file(kvc_session *s, Chan *ch, kvc_status st, int eof, const char *err)
{
    if (st == KVC_ERR_DEADLINE_EXCEEDED)
        return;  // nothing yet
    std::vector<uint64_t> unwanted;  // pages to give back
    std::vector<uint64_t> dropped;   // a DROP's pages
    {
        std::lock_guard<std::mutex> g(ch->mu);
        if (!chan_file_open_locked(s, ch, st, eof, err) ||
            !chan_file_record_locked(s, ch, ch->rec.get(), &unwanted, &dropped))
            return;
        ch->cv.notify_all();
    }
    if (!dropped.empty())
        chan_answer_drop(s, ch, dropped);
    if (!unwanted.empty())
        chan_free_nowait(s, ch, unwanted);
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
    if (end == Chan::kGone && s->resumable && !s->life.closing.load() && !s->life.ended.load())
        return s->resuming_error();
    if (s->life.ended.load())
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

namespace {

// One request waiting for its REPLY on the channel.
struct Waiting {
    uint64_t req;
    uint64_t alloc_id;  // its PAGES' allocation id, if an ALLOCATE
    bool sent;          // false: unsent (the daemon hung up?), only looking for why
    bool forever;
    std::chrono::steady_clock::time_point deadline;
};

// The REPLY to w, if filed (ch->mu held): into *out, with an ALLOCATE's
// pages into *pages (or closed where the caller takes none).
bool chan_take_reply_locked(Chan *ch, const Waiting &w, Chan::Reply *out, Chan::Stash *pages)
{
    auto it = ch->replies.find(w.req);
    if (it == ch->replies.end())
        return false;
    *out = std::move(it->second);
    ch->replies.erase(it);
    ch->waiting.erase(w.req);
    auto a = ch->stash.find(w.alloc_id);
    if (a != ch->stash.end()) {
        if (pages)
            *pages = std::move(a->second);
        else
            for (auto &p : a->second.pages)
                close(p.second.second);
        ch->stash.erase(a);
    }
    return true;
}

// w waits no more (ch->mu held). Sent and unanswered: its pages go back as
// soon as they are all there (now, into *unwanted, or when the reader files
// the last of them).
void chan_give_up_locked(Chan *ch, const Waiting &w, std::vector<uint64_t> *unwanted)
{
    ch->waiting.erase(w.req);
    ch->replies.erase(w.req);
    auto it = ch->stash.find(w.alloc_id);
    if (it != ch->stash.end() && !w.sent) {
        for (auto &p : it->second.pages)
            close(p.second.second);
        ch->stash.erase(it);
    }
    if (w.sent && ch->end == Chan::kOpen)
        chan_take_unwanted_locked(ch, w.alloc_id, *unwanted);
}

// Be the reader for one record (at most a second at a time, and not past
// w's deadline); g holds ch->mu, released while reading.
void chan_read_one(kvc_session *s, Chan *ch, const Waiting &w, std::unique_lock<std::mutex> &g)
{
    ch->reading = true;
    g.unlock();
    int wait_ms = 1000;
    if (!w.forever) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                        w.deadline - std::chrono::steady_clock::now())
                        .count();
        wait_ms = static_cast<int>(std::max<long long>(0, std::min<long long>(left, 1000)));
    }
    char err[512];
    int eof = 0;
    kvc_status st = kvc_fd_recv(ch->fd, wait_ms, ch->rec.get(), &eof, err, sizeof err);
    chan_file(s, ch, st, eof, err);
    g.lock();
    ch->reading = false;
    ch->cv.notify_all();
}

}  // namespace

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
    // Unsent (the daemon hung up?): only look for the records that say why.
    const Waiting w{req, req | KVC_FD_CHANNEL_ALLOC_BIT, sent, sent && timeout_ms == 0,
                    std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(sent ? timeout_ms : 1000)};
    std::unique_lock<std::mutex> g(ch->mu);
    std::vector<uint64_t> unwanted;
    for (;;) {
        if (chan_take_reply_locked(ch, w, out, pages))
            return KVC_OK;
        if (ch->end != Chan::kOpen) {
            chan_give_up_locked(ch, w, &unwanted);
            g.unlock();
            return chan_end_error(s, ch);
        }
        if (!w.forever && std::chrono::steady_clock::now() >= w.deadline)
            break;
        if (!ch->reading)
            chan_read_one(s, ch, w, g);
        else if (w.forever)
            ch->cv.wait(g);
        else
            ch->cv.wait_until(g, w.deadline);
    }
    chan_give_up_locked(ch, w, &unwanted);
    g.unlock();
    if (!unwanted.empty())
        chan_free_nowait(s, ch, unwanted);
    if (!sent)
        return kvc_fail(KVC_ERR_UNAVAILABLE, "%s: fd channel: %s", what, send_err.c_str());
    return kvc_fail(KVC_ERR_DEADLINE_EXCEEDED, "%s: no answer on the fd channel within %llu ms",
                    what, (unsigned long long)timeout_ms);
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
        size_t len = chan_encode_free(s, buf, req, &ids[i], n);
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

}  // namespace kvc_impl
