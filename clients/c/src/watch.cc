// libkvcached: The Watch stream of a session: reclaim requests (the callback), MEMORY_AVAILABLE,
// SHUTDOWN; opened again after a resume.
#include "internal.h"

namespace kvc_impl {

// ---- Watch ------------------------------------------------------------

// One Watch stream; returns its final status.
grpc::Status watch_stream(kvc_session *s, grpc::ClientContext *ctx)
{
    pb::WatchRequest req;
    *req.mutable_session() = s->link.ref_copy();
    auto reader = s->conn->stub->Watch(ctx, req);
    pb::WatchEvent ev;
    while (reader->Read(&ev)) {
        switch (ev.kind()) {
        case pb::WatchEvent::READY: {
            std::lock_guard<std::mutex> g(s->watch.mu);
            s->watch.ready = true;
            break;
        }
        case pb::WatchEvent::RECLAIM: {
            std::lock_guard<std::mutex> g(s->watch.cb_mu);
            if (s->watch.fn) {
                kvc_reclaim rq;
                rq.device = ev.reclaim().device().c_str();
                rq.pages = ev.reclaim().pages();
                rq.bytes = rq.pages * s->page_size;
                rq.deadline_unix = ev.reclaim().deadline_unix();
                rq.reason = ev.reclaim().reason().c_str();
                rq.id = ev.reclaim().id();
                try {
                    s->watch.fn(s->watch.user, &rq);
                } catch (...) {
                    // A C callback cannot throw; a C++ one must not take the
                    // thread down.
                }
            }
            break;
        }
        case pb::WatchEvent::MEMORY_AVAILABLE: {
            std::lock_guard<std::mutex> g(s->watch.mu);
            s->watch.available_pending = true;
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
        s->watch.cv.notify_all();
    }
    return reader->Finish();
}

// The Watch thread. On a resumable session a stream cut by the daemon's
// death is opened again (with the new SessionRef) once the session resumed.
void watch_loop(kvc_session *s)
{
    grpc::Status st;
    for (;;) {
        uint64_t gen = s->life.resumes.load();
        grpc::ClientContext *ctx;
        {
            std::lock_guard<std::mutex> g(s->watch.mu);
            if (s->watch.stopping)
                break;
            s->watch.ctx = std::make_unique<grpc::ClientContext>();
            ctx = s->watch.ctx.get();
        }
        st = watch_stream(s, ctx);
        if (!s->resumable && !st.ok() && !s->life.ended.load() && !s->life.closing.load()) {
            // A session that cannot be resumed is over when its daemon is
            // gone: say so now (its fd channel closed), not at the next call.
            bool stopping;
            {
                std::lock_guard<std::mutex> g(s->watch.mu);
                stopping = s->watch.stopping;
            }
            if (!stopping && channel_gone(s))
                s->mark_ended(KVC_ERR_FAILED_PRECONDITION, s->hangup_message());
        }
        if (!s->resumable || st.ok() || s->life.ended.load())
            break;
        std::unique_lock<std::mutex> g(s->watch.mu);
        if (s->watch.stopping)
            break;
        // A daemon that died cuts the stream about when its fd channel
        // hangs up; anything else ends the thread as before.
        s->watch.cv.wait_for(g, std::chrono::seconds(2), [&] {
            return s->watch.stopping || s->life.ended.load() || s->life.state.load() == kResuming ||
                   s->life.resumes.load() != gen;
        });
        if (s->life.state.load() != kResuming && s->life.resumes.load() == gen)
            break;
        s->watch.cv.wait(g, [&] {
            return s->watch.stopping || s->life.ended.load() ||
                   (s->life.state.load() == kLive && s->life.resumes.load() != gen);
        });
        if (s->watch.stopping || s->life.ended.load())
            break;
        s->watch.ready = false;
    }
    {
        std::lock_guard<std::mutex> g(s->watch.mu);
        s->watch.done = true;
        s->watch.status = st;
    }
    s->watch.cv.notify_all();
}

kvc_status watch_start(kvc_session *s)
{
    std::unique_lock<std::mutex> g(s->watch.mu);
    if (!s->watch.started) {
        if (s->life.ended.load()) {
            g.unlock();
            return s->ended_error();
        }
        if (s->resuming()) {
            g.unlock();
            return s->resuming_error();
        }
        s->watch.started = true;
        s->watch.thread = std::thread(watch_loop, s);
    }
    uint32_t t = s->conn->timeout_ms.load();
    auto ready = [s] { return s->watch.ready || s->watch.done; };
    if (t)
        s->watch.cv.wait_for(g, std::chrono::milliseconds(t), ready);
    else
        s->watch.cv.wait(g, ready);
    if (s->watch.ready)
        return KVC_OK;
    if (s->watch.done)
        return s->rpc_error(s->watch.status, "Watch");
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
        std::lock_guard<std::mutex> g(s->watch.mu);
        if (!s->watch.started)
            return;
        s->watch.stopping = true;
        if (s->watch.ctx)
            s->watch.ctx->TryCancel();
        t = std::move(s->watch.thread);
    }
    s->watch.cv.notify_all();
    if (t.joinable())
        t.join();
}

}  // namespace kvc_impl
