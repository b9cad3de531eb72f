// libkvcached: Sessions' page books: Allocate and Free on the fd channel (all or nothing, split past
// the daemon's limits), the duplicates kept for a resume, Frees while the daemon is away,
// and GetStats.
#include "internal.h"

namespace kvc_impl {

// ---- pages from the daemon -------------------------------------------

// $KVCACHED_KEEP_HANDLES: how many page handles a session keeps (docs/protocol.md
// "Kept handles"); default 8192 (16 GiB of 2 MiB pages), 0: never keep. A
// value that is not a number is the default.
size_t keep_limit_from_env()
{
    const size_t def = 8192;
    const char *v = std::getenv("KVCACHED_KEEP_HANDLES");
    if (!v || !*v)
        return def;
    char *end = nullptr;
    errno = 0;
    unsigned long long n = std::strtoull(v, &end, 10);
    if (errno || !end || *end || *v == '-')
        return def;
    return static_cast<size_t>(n);
}

void close_fds(std::vector<int> &fds)
{
    for (int &fd : fds)
        if (fd >= 0) {
            close(fd);
            fd = -1;
        }
}

kvc_status from_grpc(const grpc::Status &st, const char *what)
{
    kvc_status k = kvc_status_from_grpc_code(static_cast<int>(st.error_code()));
    if (k == KVC_OK)
        return KVC_OK;
    return kvc_fail(k, "%s: %s", what, st.error_message().c_str());
}

// A Free the daemon cannot be asked now, checked as it would check it (all
// or nothing): an id named twice is INVALID_ARGUMENT, a page the session
// does not hold (not kept, or given back already) NOT_FOUND. s->kept.mu held.
kvc_status check_free_locked(kvc_session *s, const std::vector<uint64_t> &ids)
{
    std::set<uint64_t> seen;
    for (uint64_t id : ids)
        if (!seen.insert(id).second)
            return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "Free: page %llu is named twice",
                            (unsigned long long)id);
    for (uint64_t id : ids)
        if (!s->kept.keep.count(id) || s->kept.deferred.count(id))
            return kvc_fail(KVC_ERR_NOT_FOUND, "Free: session %llu holds no page %llu",
                            (unsigned long long)s->id, (unsigned long long)id);
    return KVC_OK;
}

// Pages no longer kept as standby (taken back, or freed).
static void standby_end(kvc_session *s, const std::vector<uint64_t> &ids)
{
    std::lock_guard<std::mutex> g(s->kept.mu);
    if (s->kept.standby.empty())
        return;
    for (uint64_t i : ids)
        s->kept.standby.erase(i);
}

// session_free_ids's deferral: defer ids[from..] (counted as given back:
// *freed, may be NULL). With `seen` (the kept entries' sequence numbers
// this Free saw when it was sent), an id whose entry was replaced since
// is not deferred: the daemon lent that id again, so it had processed
// this Free (only its REPLY was lost), and the id is now another
// mapping's page.
//
// With `gen` (the resume count read before this Free saw the session
// resuming), a resume that completed since is seen under Kept::mu (the
// resume counts itself done under it, after collecting the Frees
// deferred during its claim): these ids were claimed, so they are not
// deferred (they would stay held until the next resume) but freed the
// normal way; *stale says so.
static kvc_status free_defer(kvc_session *s, const std::vector<uint64_t> &ids, size_t from,
                             size_t *freed, const std::vector<uint64_t> *seen,
                             const uint64_t *gen = nullptr, bool *stale = nullptr)
{
    std::lock_guard<std::mutex> g(s->kept.mu);
    if (gen && s->life.resumes.load() != *gen) {
        *stale = true;
        return KVC_OK;
    }
    std::vector<uint64_t> rest;
    for (size_t i = from; i < ids.size(); i++) {
        if (seen && (*seen)[i] != 0) {
            auto it = s->kept.keep.find(ids[i]);
            if (it != s->kept.keep.end() && it->second.seq != (*seen)[i])
                continue;
        }
        rest.push_back(ids[i]);
    }
    kvc_status st = check_free_locked(s, rest);
    if (st != KVC_OK)
        return st;
    s->kept.deferred.insert(rest.begin(), rest.end());
    s->books.drop_held(ids.size() - from);
    if (freed)
        *freed = ids.size();
    return KVC_OK;
}

// The session ended: the daemon took everything back, so the books forget
// ids[from..]; the session's end, as the status.
static kvc_status free_ended(kvc_session *s, const std::vector<uint64_t> &ids, size_t from)
{
    {
        std::lock_guard<std::mutex> g(s->kept.mu);
        std::vector<uint64_t> rest(ids.begin() + from, ids.end());
        s->kept.drop_locked(rest);
        s->books.drop_held(rest.size());
    }
    return s->ended_error();
}

// FREE on the channel; the kept entries and the books follow what the
// daemon freed (*done, from the front). *seqs: the kept entries' sequence
// numbers this Free saw.
static kvc_status free_on_channel(kvc_session *s, const std::vector<uint64_t> &ids,
                                  std::vector<uint64_t> *seqs, size_t *done)
{
    std::shared_ptr<Chan> ch = s->link.chan_copy();
    {
        std::lock_guard<std::mutex> g(s->kept.mu);
        *seqs = s->kept.seqs_locked(ids);
    }
    *done = 0;
    kvc_status st = chan_free(s, ch.get(), ids, done);
    std::lock_guard<std::mutex> g(s->kept.mu);
    s->kept.unkeep_seqs_locked(ids, *seqs, *done);
    s->books.drop_held(*done);
    return st;
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
kvc_status session_free_ids(kvc_session *s, const std::vector<uint64_t> &ids, size_t *freed)
{
    if (freed)
        *freed = 0;
    if (ids.empty())
        return KVC_OK;
    standby_end(s, ids);  // a Free gives standby pages back as any page
    if (s->life.ended.load())
        return free_ended(s, ids, 0);
    const uint64_t gen0 = s->life.resumes.load();
    if (s->resuming()) {
        bool stale = false;
        kvc_status st = free_defer(s, ids, 0, freed, nullptr, &gen0, &stale);
        if (!stale)
            return st;
    }
    // A resume waits for Frees in flight (it claims what they leave kept).
    std::shared_lock<std::shared_mutex> rw(s->link.rw);
    if (s->life.ended.load())
        return free_ended(s, ids, 0);
    if (s->resuming())
        return free_defer(s, ids, 0, freed, nullptr);
    const uint64_t gen = s->life.resumes.load();
    std::vector<uint64_t> seqs;
    size_t done = 0;
    kvc_status st = free_on_channel(s, ids, &seqs, &done);
    if (freed)
        *freed = done;
    if (st == KVC_OK)
        return KVC_OK;
    if (s->life.ended.load()) {  // ended meanwhile: the daemon took everything back
        std::string msg = kvc_last_error();
        free_ended(s, ids, done);
        return kvc_fail(st, "%s", msg.c_str());
    }
    if (s->resumable && !s->life.closing.load() &&
        (st == KVC_ERR_UNAVAILABLE || s->resuming() || s->life.resumes.load() != gen))
        return free_defer(s, ids, done, freed, &seqs);
    return st;
}

// Standby (docs/protocol.md "Standby pages"): FREE records with the standby
// flag (at most 16384 ids each, each all or nothing): the pages stay held
// and mapped, counted as standby by the daemon. *done gets how many of `ids`
// (from the front) the daemon took as standby. Only while the session is
// live (the caller unmaps and frees the pages plainly otherwise).
kvc_status session_standby_ids(kvc_session *s, const std::vector<uint64_t> &ids, size_t *done)
{
    *done = 0;
    if (ids.empty())
        return KVC_OK;
    kvc_status live = s->check_live();
    if (live != KVC_OK)
        return live;
    std::shared_lock<std::shared_mutex> rw(s->link.rw);
    live = s->check_live();
    if (live != KVC_OK)
        return live;
    std::shared_ptr<Chan> ch = s->link.chan_copy();
    std::vector<uint8_t> buf;
    uint32_t t = s->conn->timeout_ms.load();
    for (size_t i = 0; i < ids.size(); i += KVC_FD_MAX_FREE_IDS) {
        uint32_t n = static_cast<uint32_t>(std::min<size_t>(KVC_FD_MAX_FREE_IDS, ids.size() - i));
        buf.resize(KVC_FD_HEADER_SIZE + KVC_FD_FREE_FIXED + 8u * n);
        uint64_t req = chan_next_req(ch.get());
        size_t len = kvc_fd_encode_free_flags(buf.data(), buf.size(), req, &ids[i], n,
                                              KVC_FD_FREE_STANDBY);
        Chan::Reply rep;
        kvc_status st =
            chan_request(s, ch.get(), req, buf.data(), len, t, "Free (standby)", &rep, nullptr);
        if (st != KVC_OK)
            return st;
        if (rep.code != 0) {
            kvc_status k = kvc_status_from_grpc_code(static_cast<int>(rep.code));
            return kvc_fail(k == KVC_OK ? KVC_ERR_PROTOCOL : k, "Free (standby): %s",
                            rep.message.c_str());
        }
        {
            std::lock_guard<std::mutex> g(s->kept.mu);
            s->kept.standby.insert(ids.begin() + i, ids.begin() + i + n);
        }
        *done = i + n;
    }
    return KVC_OK;
}

// USE records naming standby pages taken back into use, not waited for
// (fresh request ids nobody waits for: their REPLYs are dropped). The record
// only corrects the daemon's books, so nothing is sent while the session is
// resuming or ended (a resume claims standby pages in use anyway).
void session_use_nowait(kvc_session *s, const std::vector<uint64_t> &ids)
{
    standby_end(s, ids);  // in use again, whether the daemon hears it now or not
    if (ids.empty() || s->life.ended.load() || s->resuming())
        return;
    std::shared_lock<std::shared_mutex> rw(s->link.rw);
    if (s->life.ended.load() || s->resuming())
        return;
    std::shared_ptr<Chan> ch = s->link.chan_copy();
    std::vector<uint8_t> buf;
    char err[256];
    for (size_t i = 0; i < ids.size(); i += KVC_FD_MAX_FREE_IDS) {
        uint32_t n = static_cast<uint32_t>(std::min<size_t>(KVC_FD_MAX_FREE_IDS, ids.size() - i));
        buf.resize(KVC_FD_HEADER_SIZE + KVC_FD_FREE_FIXED + 8u * n);
        size_t len = kvc_fd_encode_use(buf.data(), buf.size(), chan_next_req(ch.get()), &ids[i], n);
        if (!len || kvc_fd_send(ch->fd, buf.data(), len, nullptr, 0, err, sizeof err) != KVC_OK)
            return;  // the channel is gone: the session resumes (or ends) without it
    }
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
    std::lock_guard<std::mutex> g(s->kept.mu);
    s->kept.add_locked(ids, dups);
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
    std::shared_lock<std::shared_mutex> rw(s->link.rw);
    kvc_status live = s->check_live();  // a resume may have ended while we waited
    if (live != KVC_OK)
        return live;
    std::shared_ptr<Chan> ch = s->link.chan_copy();
    {
        std::lock_guard<std::mutex> w(s->watch.mu);
        s->watch.available_pending = false;
    }
    uint64_t done = 0;
    while (done < n) {
        uint32_t chunk = static_cast<uint32_t>(std::min<uint64_t>(n - done, s->max_pages));
        std::vector<uint64_t> got_ids;
        std::vector<int> got_fds;
        kvc_status k = chan_allocate_chunk(s, ch.get(), chunk, got_ids, got_fds);
        if (k == KVC_OK) {
            s->books.held_pages += chunk;
            k = keep_fds(s, got_ids, got_fds);
            if (k != KVC_OK) {
                std::string msg = kvc_last_error();
                close_fds(got_fds);
                size_t freed = 0;
                chan_free(s, ch.get(), got_ids, &freed);
                s->books.drop_held(chunk);
                kvc_fail(k, "%s", msg.c_str());
            }
        }
        if (k != KVC_OK) {
            std::string msg = kvc_last_error();
            close_fds(fds);
            size_t freed = 0;
            if (!ids.empty() && chan_free(s, ch.get(), ids, &freed) != KVC_OK && s->resumable) {
                std::lock_guard<std::mutex> g(s->kept.mu);
                s->kept.deferred.insert(ids.begin() + freed, ids.end());
            }
            {
                std::lock_guard<std::mutex> g(s->kept.mu);
                std::vector<uint64_t> mine(ids.begin(), ids.begin() + freed);
                s->kept.drop_locked(mine);
            }
            s->books.drop_held(ids.size());
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
    uint64_t limit = s->books.limit.load();
    if (limit && (s->books.held_pages.load() + n) * s->page_size > limit)
        return kvc_fail(KVC_ERR_RESOURCE_EXHAUSTED,
                        "session limit: %llu bytes held + %llu asked > limit %llu "
                        "(kvc_session_set_limit)",
                        (unsigned long long)(s->books.held_pages.load() * s->page_size),
                        (unsigned long long)(n * s->page_size), (unsigned long long)limit);
    return chan_session_allocate(s, n, ids, fds);
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
    *req.mutable_session() = s->link.ref_copy();
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
            o.standby_bytes = ss.standby_bytes();
        }
    for (const auto &d : resp.devices())
        if (d.device().uuid() == s->device)
            o.device_standby_bytes = d.pool().standby_bytes();
    o.sessions_open = resp.sessions_open();
    o.uptime_seconds = resp.uptime_seconds();
    std::memcpy(out, &o, std::min(sizeof o, out->struct_size ? out->struct_size : sizeof o));
    out->struct_size = std::min(sizeof o, out->struct_size ? out->struct_size : sizeof o);
    return KVC_OK;
}

}  // namespace kvc_impl
