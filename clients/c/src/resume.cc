// libkvcached: Resume after a daemon restart, and the session's monitor thread (it reads the fd
// channel while no call waits, and resumes a resumable session whose daemon went away).
#include "internal.h"

namespace kvc_impl {

// ---- resume after a daemon restart ---------------------------------------

// After the fd channel hung up: did the daemon end the session (GOODBYE or
// ERROR still queued) or did it go away? Records left unread are dropped
// (page fds of an allocation nobody waits for: not claimed, so forgotten).
bool channel_gone(kvc_session *s)
{
    // Requests may be waiting on it: read as one of them would.
    std::shared_ptr<Chan> ch = s->link.chan_copy();
    chan_pump_pending(s, ch.get());
    std::lock_guard<std::mutex> g(ch->mu);
    return ch->end == Chan::kGone && !s->life.ended.load();
}

// Sleep up to ms, or until the session closes. False if it is closing.
bool resume_sleep(kvc_session *s, uint32_t ms)
{
    std::unique_lock<std::mutex> g(s->life.mu);
    s->life.cv.wait_for(g, std::chrono::milliseconds(ms), [s] { return s->life.closing.load(); });
    return !s->life.closing.load();
}

// The session is dead: the daemon refused the claim or did not come back.
void resume_failed(kvc_session *s, const std::string &why)
{
    s->mark_ended(KVC_ERR_FAILED_PRECONDITION, why);
    s->kept.drop_all();
}

namespace {

// What one resume attempt came to: resumed; worth another try after a
// backoff (the daemon is not back yet); or over (the session ended, or it is
// closing).
enum class Attempt { kResumed, kRetry, kOver };

// GetInfo of the (restarted) daemon. False, with *last saying why, while it
// does not answer.
bool resume_get_info(kvc_session *s, pb::GetInfoResponse *info, std::string *last)
{
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1000));
    // Wait for the connection rather than fail fast: a call that fails
    // at once while the channel is reconnecting leaves nobody polling
    // the new connection, which then becomes ready only at gRPC's
    // backup poll (every 5 s): resumes took 5-13 s after the daemon
    // was back. Waiting, the call polls it and goes out as soon as
    // the daemon answers.
    ctx.set_wait_for_ready(true);
    grpc::Status gs = s->conn->stub->GetInfo(&ctx, pb::GetInfoRequest(), info);
    if (!gs.ok())
        *last = "GetInfo: " + gs.error_message();
    return gs.ok();
}

// A new fd channel to the daemon and its HELLO. False, with *last saying
// why and nothing left open, if either fails.
bool resume_connect(const pb::GetInfoResponse &info, uint32_t timeout_ms, int *nfd,
                    kvc_fd_record *hello, std::string *last)
{
    char err[512];
    kvc_status st = kvc_fd_connect(info.fd_socket().c_str(), nfd, err, sizeof err);
    if (st == KVC_OK) {
        int eof = 0;
        st = kvc_fd_recv(*nfd, static_cast<int>(timeout_ms), hello, &eof, err, sizeof err);
        if (st == KVC_OK && (eof || hello->type != KVC_FD_HELLO)) {
            if (!eof)
                kvc_fd_record_close_fds(hello);
            std::snprintf(err, sizeof err, "no HELLO on the new fd channel");
            st = KVC_ERR_UNAVAILABLE;
        }
    }
    if (st == KVC_OK)
        return true;
    if (*nfd >= 0)
        close(*nfd);
    *nfd = -1;
    *last = std::string("fd channel: ") + err;
    return false;
}

// ADOPT on the new channel every page still held, into *ids (the pages
// whose Free could not reach the daemon are not claimed: that gives them
// back). False, with *last saying why, if a record could not be sent.
bool resume_adopt(kvc_session *s, int nfd, std::vector<uint64_t> *ids, std::string *last)
{
    std::lock_guard<std::mutex> g(s->kept.mu);
    std::vector<uint64_t> gone(s->kept.deferred.begin(), s->kept.deferred.end());
    s->kept.drop_locked(gone);
    s->kept.deferred.clear();
    std::vector<int> fds;
    for (auto &kv : s->kept.keep) {
        ids->push_back(kv.first);
        fds.push_back(kv.second.fd);
    }
    std::vector<uint8_t> buf(KVC_FD_MAX_RECORD);
    char err[512] = "the record could not be encoded";
    for (size_t i = 0; i < ids->size(); i += KVC_FD_MAX_FDS) {
        uint32_t n = static_cast<uint32_t>(std::min<size_t>(KVC_FD_MAX_FDS, ids->size() - i));
        size_t len = kvc_fd_encode_adopt(buf.data(), buf.size(), s->id, static_cast<uint32_t>(i),
                                         static_cast<uint32_t>(ids->size()), &(*ids)[i], n);
        if (len == 0 || kvc_fd_send(nfd, buf.data(), len, &fds[i], n, err, sizeof err) != KVC_OK) {
            *last = std::string("ADOPT: ") + err;
            return false;
        }
    }
    return true;
}

// ResumeSession: claim the adopted pages with the new channel's secret.
grpc::Status resume_claim(kvc_session *s, const kvc_fd_record &hello,
                          const std::vector<uint64_t> &ids, uint32_t timeout_ms,
                          pb::ResumeSessionResponse *resp)
{
    pb::ResumeSessionRequest req;
    req.set_channel_secret(hello.secret, KVC_FD_SECRET_SIZE);
    req.set_session_id(s->id);
    req.set_resume_token(s->resume_token);
    for (uint64_t i : ids)
        req.add_page_ids(i);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    return s->conn->stub->ResumeSession(&ctx, req, resp);
}

// What the claim left to do once the session is live again.
struct AfterClaim {
    std::vector<uint64_t> late;       // Frees deferred while the claim was in flight
    std::vector<uint64_t> late_seqs;  // their kept entries
    std::vector<uint64_t> standby;    // adopted standby pages, to be said again
};

// Swap in the new channel and SessionRef (the caller holds link.rw).
AfterClaim resume_swap(kvc_session *s, int nfd, const pb::ResumeSessionResponse &resp,
                       const std::vector<uint64_t> &ids)
{
    AfterClaim a;
    {
        std::scoped_lock g(s->link.mu, s->kept.mu);
        s->link.chan = std::make_shared<Chan>(nfd);  // the old one closes with its last user
        s->link.fd = nfd;
        s->link.ref = resp.session();
        s->link.admin = resp.admin();
        for (uint64_t i : s->kept.deferred)
            if (s->kept.keep.count(i))
                a.late.push_back(i);
        for (uint64_t i : a.late)
            s->kept.deferred.erase(i);
        a.late_seqs = s->kept.seqs_locked(a.late);
        s->life.resumes++;
        s->life.state = kLive;
    }
    // Standby pages the restarted daemon adopted: it counts them in use
    // (it does not journal standby), so they are said again.
    std::lock_guard<std::mutex> g(s->kept.mu);
    std::set<uint64_t> gone(a.late.begin(), a.late.end());
    for (uint64_t i : ids)
        if (s->kept.standby.count(i) && !gone.count(i))
            a.standby.push_back(i);
    s->kept.standby = std::set<uint64_t>(a.standby.begin(), a.standby.end());  // the rest went with the old daemon
    return a;
}

// Claimed, but the caller gave them back meanwhile: Free them now
// (held_pages already counts them as gone).
void resume_free_late(kvc_session *s, const AfterClaim &a)
{
    if (a.late.empty())
        return;
    std::shared_ptr<Chan> ch = s->link.chan_copy();
    size_t done = 0;
    chan_free(s, ch.get(), a.late, &done);
    // Only the entries this Free saw: the daemon may lend a freed id
    // again before its REPLY is read here.
    std::lock_guard<std::mutex> g(s->kept.mu);
    s->kept.unkeep_seqs_locked(a.late, a.late_seqs, done);
    s->kept.deferred.insert(a.late.begin() + done, a.late.end());
}

// The adopted standby pages not taken back meanwhile (a USE ends it) are
// standby again. A failure leaves them in use in the books: right, only not
// asked for first by a reclaim.
void resume_standby_again(kvc_session *s, const AfterClaim &a)
{
    if (a.standby.empty() || !s->standby_ok.load())
        return;
    std::vector<uint64_t> again;
    {
        std::lock_guard<std::mutex> g(s->kept.mu);
        for (uint64_t i : a.standby)
            if (s->kept.standby.count(i))
                again.push_back(i);
    }
    size_t done = 0;
    if (!again.empty())
        (void)session_standby_ids(s, again, &done);
}

std::string resume_refused(const kvc_session *s, const std::string &why)
{
    return "session " + std::to_string(s->id) +
           " could not be resumed after the daemon restarted: " + why;
}

// One attempt: GetInfo, a new fd channel + HELLO, ADOPT every page still
// held, ResumeSession, swap in the new channel and SessionRef.
Attempt resume_attempt(kvc_session *s, std::string *last)
{
    uint32_t t = s->conn->timeout_ms.load();
    if (t == 0)
        t = kDefaultTimeoutMs;
    pb::GetInfoResponse info;
    if (!resume_get_info(s, &info, last))
        return Attempt::kRetry;
    if (!info.fd_channel_requests()) {
        resume_failed(s, resume_refused(s, "the restarted daemon (version " + info.version() +
                                               ") takes no page requests on the fd channel "
                                               "(GetInfo().fd_channel_requests is false)"));
        return Attempt::kOver;
    }
    int nfd = -1;
    auto hello = std::make_unique<kvc_fd_record>();
    if (!resume_connect(info, t, &nfd, hello.get(), last))
        return Attempt::kRetry;
    // No channel allocation between its answer and keeping its fds.
    std::unique_lock<std::shared_mutex> rw(s->link.rw);
    // Kept handles end before the claim: the restarted daemon never saw
    // the FREEs that made this session a keeper, and its page ids are no
    // promise about the old daemon's pages (docs/protocol.md "Kept
    // handles"). Kept again only where it offers it.
    kvc_mapper_keep_reset(s->mapper, info.fd_channel_keep_handles() ? s->keep_limit : 0);
    s->standby_ok = info.fd_channel_standby();
    std::vector<uint64_t> ids;
    pb::ResumeSessionResponse resp;
    bool adopted = resume_adopt(s, nfd, &ids, last);
    grpc::Status gs = adopted ? resume_claim(s, *hello, ids, t, &resp) : grpc::Status::OK;
    if (!adopted || !gs.ok()) {
        close(nfd);
        rw.unlock();
        if (gs.ok() || gs.error_code() == grpc::StatusCode::UNAVAILABLE ||
            gs.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
            if (!gs.ok())
                *last = "ResumeSession: " + gs.error_message();
            return Attempt::kRetry;
        }
        resume_failed(s, resume_refused(s, gs.error_message()));
        return Attempt::kOver;
    }
    AfterClaim a = resume_swap(s, nfd, resp, ids);
    rw.unlock();
    s->notify();
    resume_free_late(s, a);
    resume_standby_again(s, a);
    return Attempt::kResumed;
}

}  // namespace

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
    while (!s->life.closing.load() && std::chrono::steady_clock::now() < deadline) {
        Attempt a = resume_attempt(s, &last);
        if (a != Attempt::kRetry)
            return a == Attempt::kResumed;
        if (!resume_sleep(s, delay))
            return false;
        delay = std::min(delay * 2, kResumeMaxDelayMs);
    }
    if (s->life.closing.load())
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
    while (!s->life.closing.load()) {
        std::shared_ptr<Chan> ch = s->link.chan_copy();  // only this thread replaces it
        bool open, gone;
        {
            std::lock_guard<std::mutex> g(ch->mu);
            open = ch->end == Chan::kOpen;
            gone = ch->end == Chan::kGone;
        }
        if (gone && s->resumable && !s->life.ended.load()) {
            // The daemon went away (whoever read the end of the stream).
            // False: ended or closing (the loop then waits for close).
            session_resume(s);
            continue;
        }
        struct pollfd p[2];
        p[0].fd = s->monitor.wake_fd;
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
        if (s->life.closing.load())
            return;
        if (open && p[1].revents)
            chan_pump_pending(s, ch.get());
    }
}

void monitor_stop(kvc_session *s)
{
    s->life.closing = true;
    if (s->monitor.wake_fd >= 0) {
        uint64_t one = 1;
        ssize_t n = write(s->monitor.wake_fd, &one, sizeof one);
        (void)n;
    }
    s->notify();
    if (s->monitor.thread.joinable())
        s->monitor.thread.join();
    if (s->monitor.wake_fd >= 0)
        close(s->monitor.wake_fd);
    s->monitor.wake_fd = -1;
}

}  // namespace kvc_impl
