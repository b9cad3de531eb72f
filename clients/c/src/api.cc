// libkvcached: the C API (extern "C"), over the units of internal.h. Every
// function catches everything at the boundary: no exception crosses the ABI.
#include "internal.h"

using namespace kvc_impl;

namespace {

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

#define NEED(cond, what) \
    if (!(cond))         \
    return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "%s", what)

// ---- kvc_session_open's steps ---------------------------------------------

kvc_status open_check_options(const kvc_session_options *o)
{
    NEED(o->struct_size == sizeof(kvc_session_options),
         "options.struct_size is not sizeof(kvc_session_options): call "
         "kvc_session_options_init");
    NEED(o->name, "options.name is NULL");
    NEED(o->num_labels == 0 || o->labels, "options.labels is NULL");
    return KVC_OK;
}

// The device the options name (the first one if none), and a daemon that
// takes page requests on the fd channel.
kvc_status open_pick_device(const pb::GetInfoResponse &info, const kvc_session_options *o,
                            const pb::DeviceInfo **dev)
{
    for (const auto &d : info.devices())
        if (!o->device || !*o->device || d.uuid() == o->device) {
            *dev = &d;
            break;
        }
    if (!*dev)
        return kvc_fail(KVC_ERR_NOT_FOUND, "the daemon serves no device %s (first: %s)",
                        o->device, info.devices(0).uuid().c_str());
    // Page operations go on the fd channel only (docs/protocol.md).
    if (!info.fd_channel_requests())
        return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                        "the daemon (version \"%s\") takes no page requests on the fd channel "
                        "(GetInfo().fd_channel_requests is false); this library sends "
                        "Allocate, Free and Close only there: upgrade kvcached-serve",
                        info.version().c_str());
    return KVC_OK;
}

kvc_status open_init(kvc_client *client, const pb::DeviceInfo &dev, const kvc_session_options *o,
                     kvc_session *s)
{
    const pb::GetInfoResponse &info = client->conn->info;
    s->conn = client->conn;
    s->device = dev.uuid();
    s->kind = dev.kind();
    s->page_size = dev.page_size();
    s->max_pages = info.max_pages_per_request() ? info.max_pages_per_request() : 1;
    s->wait = o->wait != 0;
    s->wait_timeout_ms = o->wait_timeout_ms;
    if (s->page_size == 0)
        return kvc_fail(KVC_ERR_PROTOCOL, "device %s has page size 0", s->device.c_str());
    return KVC_OK;
}

// Connect the session's fd channel (s->link.fd) and read the daemon's HELLO.
kvc_status open_hello(kvc_client *client, kvc_session *s, kvc_fd_record *rec)
{
    char err[512];
    kvc_status st =
        kvc_fd_connect(client->conn->info.fd_socket().c_str(), &s->link.fd, err, sizeof err);
    if (st != KVC_OK)
        return kvc_fail(st, "%s", err);
    int eof = 0;
    uint32_t t = client->conn->timeout_ms.load();
    st = kvc_fd_recv(s->link.fd, t ? static_cast<int>(t) : -1, rec, &eof, err, sizeof err);
    if (st != KVC_OK)
        return kvc_fail(st, "waiting for HELLO: %s", err);
    if (eof)
        return kvc_fail(KVC_ERR_UNAVAILABLE, "the daemon closed the fd channel before HELLO");
    if (rec->type == KVC_FD_ERROR) {
        kvc_status k = kvc_status_from_grpc_code(static_cast<int>(rec->error_code));
        return kvc_fail(k == KVC_OK ? KVC_ERR_PROTOCOL : k, "fd channel refused: %s",
                        rec->message);
    }
    if (rec->type != KVC_FD_HELLO) {
        kvc_fd_record_close_fds(rec);
        return kvc_fail(KVC_ERR_PROTOCOL, "first record on the fd channel is type %u, not HELLO",
                        rec->type);
    }
    return KVC_OK;
}

// OpenSession with the channel's secret; the session is then the daemon's.
kvc_status open_claim(kvc_client *client, const kvc_session_options *o, const kvc_fd_record &hello,
                      kvc_session *s)
{
    pb::OpenSessionRequest req;
    req.set_channel_secret(hello.secret, KVC_FD_SECRET_SIZE);
    req.set_name(o->name);
    req.set_guaranteed_bytes(o->guaranteed_bytes);
    req.set_max_bytes(o->max_bytes);
    req.set_priority(o->priority);
    for (size_t i = 0; i < o->num_labels; i++) {
        if (!o->labels[i].key || !o->labels[i].value)
            return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "label %zu has a NULL key or value", i);
        (*req.mutable_labels())[o->labels[i].key] = o->labels[i].value;
    }
    pb::OpenSessionResponse resp;
    grpc::ClientContext ctx;
    client->conn->prepare(ctx);
    grpc::Status gs = client->conn->stub->OpenSession(&ctx, req, &resp);
    if (!gs.ok())
        return from_grpc(gs, "OpenSession");
    s->link.chan = std::make_shared<Chan>(s->link.fd);
    s->link.ref = resp.session();
    s->id = resp.session().id();
    s->link.admin = resp.admin();
    s->resume_token = resp.resume_token();
    s->resumable = !s->resume_token.empty();
    return KVC_OK;
}

// Kept handles and standby as the daemon offers them, and the monitor thread.
kvc_status open_start_monitor(kvc_session *s)
{
    const pb::GetInfoResponse &info = s->conn->info;
    // Kept handles only where the daemon honours the keep flag (an older
    // one could release a page whose memory a kept handle holds); the
    // mapper keeps them on CUDA only.
    s->keep_limit = keep_limit_from_env();
    kvc_mapper_keep_reset(s->mapper, info.fd_channel_keep_handles() ? s->keep_limit : 0);
    s->standby_ok = info.fd_channel_standby();
    s->monitor.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->monitor.wake_fd < 0) {
        int e = errno;
        return kvc_fail(KVC_ERR_SYSTEM, "eventfd: %s", std::strerror(e));
    }
    s->monitor.thread = std::thread(monitor_loop, s);
    return KVC_OK;
}

// A session that could not open: its channel and mapper go (the session
// itself is then deleted by its owner).
void open_undo(kvc_session *s)
{
    if (s->link.chan)
        s->link.chan.reset();  // owns the fd
    else if (s->link.fd >= 0)
        close(s->link.fd);
    s->link.fd = -1;
    kvc_mapper_destroy(s->mapper);
    s->mapper = nullptr;
}

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
        kvc_status st = open_check_options(o);
        if (st != KVC_OK)
            return st;
        const pb::DeviceInfo *dev = nullptr;
        if ((st = open_pick_device(client->conn->info, o, &dev)) != KVC_OK)
            return st;
        auto s = std::make_unique<kvc_session>();
        if ((st = open_init(client, *dev, o, s.get())) != KVC_OK)
            return st;
        auto hello = std::make_unique<kvc_fd_record>();
        st = open_hello(client, s.get(), hello.get());
        // The driver is loaded only once the daemon has accepted us.
        if (st == KVC_OK)
            st = kvc_mapper_create(s->kind.c_str(), s->device.c_str(), &s->mapper);
        if (st == KVC_OK)
            st = open_claim(client, o, *hello, s.get());
        if (st == KVC_OK)
            st = open_start_monitor(s.get());
        if (st != KVC_OK) {
            open_undo(s.get());
            return st;
        }
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
            std::lock_guard<std::mutex> g(s->watch.mu);
            if (s->watch.started && std::this_thread::get_id() == s->watch.thread.get_id())
                return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                                "kvc_session_close called from the session's reclaim callback");
        }
        {
            std::lock_guard<std::mutex> g(s->books.mu);
            if (s->books.regions)
                return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                                "session %llu still has %zu regions or blocks: destroy them first",
                                (unsigned long long)s->id, s->books.regions);
        }
        // First the resume monitor (a CloseSession hangs up the channel; a
        // resume in progress is abandoned).
        monitor_stop(s);
        if (!s->life.ended.load() && s->life.state.load() == kLive) {
            // CLOSE on the channel; the daemon then closes it.
            std::shared_ptr<Chan> ch = s->link.chan_copy();
            uint64_t req = chan_next_req(ch.get());
            uint8_t buf[KVC_FD_HEADER_SIZE + 8];
            size_t len = kvc_fd_encode_close(buf, sizeof buf, req);
            Chan::Reply rep;
            chan_request(s, ch.get(), req, buf, len, s->conn->timeout_ms.load(), "CloseSession",
                         &rep, nullptr);  // closing the channel ends it anyway
        }
        watch_stop(s);
        s->link.chan.reset();  // closes the fd channel
        s->link.fd = -1;
        s->kept.drop_all();
        kvc_mapper_keep_reset(s->mapper, 0);  // every kept handle ends with the session
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
    return s ? s->books.held_pages.load() * s->page_size : 0;
}
KVC_API uint64_t kvc_session_kept_handles(const kvc_session *s)
{
    return s && s->mapper ? kvc_mapper_kept_total(s->mapper) : 0;
}
KVC_API int kvc_session_ended(const kvc_session *s) { return s && s->life.ended.load() ? 1 : 0; }
KVC_API int kvc_session_is_admin(const kvc_session *s) { return s && s->link.admin.load() ? 1 : 0; }
KVC_API int kvc_session_is_resumable(const kvc_session *s) { return s && s->resumable ? 1 : 0; }
KVC_API int kvc_session_is_resuming(const kvc_session *s)
{
    return s && s->resuming() ? 1 : 0;
}
KVC_API uint64_t kvc_session_resume_count(const kvc_session *s)
{
    return s ? s->life.resumes.load() : 0;
}

KVC_API kvc_status kvc_session_wait_resumed(kvc_session *s, uint32_t timeout_ms)
{
    return guarded([&]() -> kvc_status {
        NEED(s, "session is NULL");
        if (s->life.ended.load())
            return s->ended_error();
        if (!s->resumable)
            return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                            "session %llu is not resumable: the daemon keeps no state (start "
                            "kvcached-serve with --state-dir)",
                            (unsigned long long)s->id);
        std::unique_lock<std::mutex> g(s->life.mu);
        s->life.cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [s] {
            return s->life.ended.load() || s->life.state.load() == kLive;
        });
        g.unlock();
        if (s->life.ended.load())
            return s->ended_error();
        if (s->life.state.load() == kLive)
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
            std::lock_guard<std::mutex> g(s->watch.cb_mu);
            s->watch.fn = fn;
            s->watch.user = user_data;
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
        std::shared_ptr<Chan> ch = s->link.chan_copy();
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
        std::unique_lock<std::mutex> g(s->watch.mu);
        bool got = s->watch.cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [s] {
            return s->watch.available_pending || s->watch.done || s->life.ended.load();
        });
        if (s->watch.available_pending) {
            s->watch.available_pending = false;
            return KVC_OK;
        }
        if (s->life.ended.load()) {
            g.unlock();
            return s->ended_error();
        }
        if (s->watch.done)
            return s->rpc_error(s->watch.status, "Watch ended");
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
        *req.mutable_admin() = s->link.ref_copy();
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
        std::lock_guard<std::mutex> g(s->books.mu);
        s->books.blocks[r->base] = r;
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
            std::lock_guard<std::mutex> g(s->books.mu);
            auto it = s->books.blocks.find(reinterpret_cast<uintptr_t>(ptr));
            if (it == s->books.blocks.end())
                return kvc_fail(KVC_ERR_NOT_FOUND,
                                "%p is not a block of session %llu (kvc_session_alloc)", ptr,
                                (unsigned long long)s->id);
            r = it->second;
            s->books.blocks.erase(it);
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
        uint64_t limit = s->books.limit.load();
        uint64_t mine = s->books.held_pages.load() * s->page_size;
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
        s->books.limit = limit_bytes;
        return KVC_OK;
    });
}

KVC_API uint64_t kvc_session_limit(const kvc_session *s) { return s ? s->books.limit.load() : 0; }

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
    // standby pages are unmapped from the caller's view (kvc_region_standby_bytes)
    return r ? (r->mapped_pages.load() - std::min(r->mapped_pages.load(), r->standby_pages.load())) *
                   r->page
             : 0;
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

KVC_API kvc_status kvc_region_map_ranges_local(kvc_region *r, const kvc_range *ranges, size_t n)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        return region_map_ranges_local(r, ranges, n);
    });
}

KVC_API kvc_status kvc_region_unmap_ranges_local(kvc_region *r, const kvc_range *ranges, size_t n)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        return region_unmap_ranges(r, ranges, n, true);
    });
}

KVC_API uint64_t kvc_region_local_bytes(const kvc_region *r)
{
    return r ? r->local_pages.load() * r->page : 0;
}

KVC_API kvc_status kvc_region_unmap(kvc_region *r, uint64_t offset, uint64_t size)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        kvc_range one = {offset, size};
        return region_unmap_ranges(r, &one, 1, false);
    });
}

KVC_API kvc_status kvc_region_unmap_ranges(kvc_region *r, const kvc_range *ranges, size_t n)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        return region_unmap_ranges(r, ranges, n, false);
    });
}

KVC_API kvc_status kvc_region_unmap_ranges_standby(kvc_region *r, const kvc_range *ranges, size_t n)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        return region_unmap_ranges_standby(r, ranges, n);
    });
}

KVC_API kvc_status kvc_region_set_standby_limit(kvc_region *r, uint64_t bytes)
{
    return guarded([&]() -> kvc_status {
        NEED(r, "region is NULL");
        return region_set_standby_limit(r, bytes);
    });
}

KVC_API uint64_t kvc_region_standby_limit(const kvc_region *r)
{
    return r ? r->standby_limit.load() : 0;
}

KVC_API uint64_t kvc_region_standby_bytes(const kvc_region *r)
{
    return r ? r->standby_pages.load() * r->page : 0;
}

KVC_API kvc_status kvc_region_release_standby(kvc_region *r, uint64_t bytes, uint64_t *released)
{
    return guarded([&]() -> kvc_status {
        if (released)
            *released = 0;
        NEED(r, "region is NULL");
        return region_release_standby(r, bytes, released);
    });
}

KVC_API kvc_status kvc_region_rebind(kvc_region *r, kvc_session *to)
{
    return guarded([&]() -> kvc_status {
        NEED(r && to, "region or session is NULL");
        kvc_session *from = r->session;
        if (from == to)
            return KVC_OK;
        if (!from->life.ended.load())
            return kvc_fail(KVC_ERR_FAILED_PRECONDITION,
                            "the region's session %llu is still live: rebinding would orphan the "
                            "pages it lent; close the region or wait until that session ended",
                            (unsigned long long)from->id);
        if (to->life.ended.load())
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
        uint64_t owned = r->standby_pages.load();  // held by the old session's books too
        region_orphan_standby_locked(r);
        owned -= r->standby_pages.load();
        for (uint64_t k = 0; k < r->mapped.size(); k++)
            if (r->mapped[k] == kSlotMapped) {
                r->mapped[k] = kSlotOrphan;
                r->ids[k] = 0;
                owned++;
            }
        {
            std::lock_guard<std::mutex> f(from->books.mu);
            from->books.regions--;
        }
        from->books.drop_held(owned);
        {
            std::lock_guard<std::mutex> t(to->books.mu);
            to->books.regions++;
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
        if (!slot_in_use(r->mapped[k]))
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
