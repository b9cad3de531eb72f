"""The gRPC adapter: protobuf in, Daemon calls, protobuf out.

It sits beside the fd channel adapter (channel.py) in front of the core
(daemon.py). Errors become gRPC status codes in exactly one place, `_abort`
below (every unary rpc through `_rpc`, and Watch), through
errors_grpc.to_grpc. The servicer keeps no state of its own. A SessionRef
is a Bearer to the core, with the caller's uid as the kernel named it to
the control socket's front door (control.py); the core decides what a
bearer may do.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from ... import __version__, errors, fdchannel
from ..._generated.kvcached.v1 import kvcached_pb2 as pb
from ..._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from ...errors_grpc import to_grpc
from .control import Peer
from ..core.daemon import API_VERSION, CORE_OPS, Bearer, Daemon, Event
from ..core.elastic import Reclaim, pending_pages
from ..core.pool import Books, DevicePool
from ..core.sessions import Session

log = logging.getLogger("kvcached.rpc")


def _parse(request, cls):
    """Requests arrive as raw bytes (see add_to_server): a body that is not a
    valid message is bad input, answered like any other."""
    if isinstance(request, (bytes, bytearray, memoryview)):
        try:
            return cls.FromString(bytes(request))
        except DecodeError as exc:
            raise errors.InvalidArgument(f"the request is not a valid {cls.DESCRIPTOR.full_name}: {exc}") from None
    return request


async def _abort(d: Daemon, context, rpc: str, exc: BaseException) -> None:
    """The one place an error becomes a gRPC status."""
    code, message = to_grpc(exc)
    if not isinstance(exc, errors.KVCachedError) or isinstance(exc, errors.Internal):
        log.error("%s failed", rpc, exc_info=exc)
    else:
        log.debug("%s: %s %s", rpc, code.name, message)
    await context.abort(code, message)


def _rpc(fn):
    """Run a unary handler; map any error to its status."""
    rpc = fn.__name__
    request_cls = getattr(pb, _REQUEST_TYPES[rpc])

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            request = _parse(request, request_cls)
        except errors.KVCachedError as exc:
            if rpc in CORE_OPS:  # the core observes these; it never saw this one
                self.d.observe(rpc, exc.code, 0.0)
            await _abort(self.d, context, rpc, exc)
        try:
            return await fn(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error gets a status
            await _abort(self.d, context, rpc, exc)

    return wrapper


_SERVICE = pb.DESCRIPTOR.services_by_name["KVCached"]
_REQUEST_TYPES = {m.name: m.input_type.name for m in _SERVICE.methods}

_LIMIT_FIELDS = ("guaranteed_bytes", "max_bytes", "priority")

_EVENT_KIND = {
    "READY": pb.WatchEvent.READY,
    "RECLAIM": pb.WatchEvent.RECLAIM,
    "BUDGET_CHANGED": pb.WatchEvent.BUDGET_CHANGED,
    "MEMORY_AVAILABLE": pb.WatchEvent.MEMORY_AVAILABLE,
    "SHUTDOWN": pb.WatchEvent.SHUTDOWN,
}


def event_to_pb(ev: Event) -> pb.WatchEvent:
    out = pb.WatchEvent(kind=_EVENT_KIND[ev.kind], time_unix=ev.time_unix)
    if ev.kind == "RECLAIM":
        out.reclaim.CopyFrom(pb.Reclaim(**ev.data))
    elif ev.kind == "BUDGET_CHANGED":
        out.budget.CopyFrom(pb.BudgetChanged(**ev.data))
    elif ev.kind == "MEMORY_AVAILABLE":
        out.available.CopyFrom(pb.MemoryAvailable(**ev.data))
    elif ev.kind == "SHUTDOWN":
        out.shutdown.CopyFrom(pb.Shutdown(**ev.data))
    return out


def device_info(pool: DevicePool) -> pb.DeviceInfo:
    spec = pool.spec
    return pb.DeviceInfo(
        uuid=spec.uuid,
        name=spec.name,
        kind=spec.kind,
        page_size=pool.page_size,
        granularity=spec.granularity,
        total_bytes=spec.total_bytes,
        budget_bytes=pool.budget.bytes,
    )


def pool_stats(books: list[Books]) -> pb.PoolStats:
    out = pb.PoolStats()
    for b in books:
        out.budget_bytes += b.budget_bytes
        out.pooled_bytes += b.pooled_bytes
        out.in_use_bytes += b.in_use_bytes
        out.free_bytes += b.free_bytes
        out.unavailable_bytes += b.unavailable_bytes
        out.zeroing_bytes += b.zeroing * b.page_size
        out.pages_zeroing += b.zeroing
        out.standby_bytes += b.standby * b.page_size
        out.pages_pooled += b.pooled
        out.pages_in_use += b.in_use
        out.pages_created_total += b.created_total
        out.pages_released_total += b.released_total
        out.page_size = b.page_size
    return out


_OUTCOME = {"open": pb.ReclaimOutcome.OPEN, "met": pb.ReclaimOutcome.MET, "answered": pb.ReclaimOutcome.ANSWERED,
            "expired": pb.ReclaimOutcome.EXPIRED, "ended": pb.ReclaimOutcome.ENDED}


def reclaim_outcome(daemon: Daemon, ev: Reclaim) -> pb.ReclaimOutcome:
    return pb.ReclaimOutcome(
        reclaim_id=ev.id, device=ev.device, pages_requested=ev.pages, state=_OUTCOME[ev.state], answered=ev.answered,
        bytes_given=ev.bytes_given, bytes_kept=ev.bytes_kept, reason=ev.why,
        held_bytes=ev.session.held_pages(ev.device) * ev.page_size,
    )


def session_stats(daemon: Daemon, s: Session) -> pb.SessionStats:
    return pb.SessionStats(
        id=s.id,
        name=s.name,
        pid=s.pid,
        uid=s.uid,
        held_bytes=daemon.held_bytes(s),
        pages_held=len(s.pages),
        guaranteed_bytes=s.guaranteed_bytes,
        max_bytes=s.max_bytes,
        priority=s.priority,
        last_active_unix=s.last_active_unix,
        reclaim_ignored=s.reclaim_ignored,
        allocations_total=s.allocations_total,
        frees_total=s.frees_total,
        labels=s.labels,
        opened_unix=s.opened_unix,
        held_bytes_by_device={u: n * daemon.pools[u].page_size for u, n in s.held_by_device.items() if n},
        reclaim_pending_pages=sum(pending_pages(s, p, time.time()) for p in daemon.pools.values()),
        reclaim_requests=s.reclaim_requests,
        standby_bytes=sum(n * daemon.pools[u].page_size for u, n in s.standby_by_device.items()),
    )


class KVCachedService(pb_grpc.KVCachedServicer):
    def __init__(self, daemon: Daemon, peers: Callable[[str], Peer | None] | None = None):
        self.d = daemon
        # the control socket's front door (control.py): context.peer() -> the
        # kernel's credentials of the caller; None for a trusted direct caller
        self._peers = peers

    def _uid(self, context) -> int | None:
        """The caller's uid (SO_PEERCRED through the front door), or None
        when the call did not come through it (the daemon's own uid or root
        on grpcio's private socket, or a test servicer)."""
        if self._peers is None:
            return None
        peer = self._peers(context.peer())
        return peer.uid if peer is not None else None

    def _bearer(self, ref: pb.SessionRef, context) -> Bearer:
        return Bearer(ref.id, ref.token, self._uid(context))

    def _session(self, ref: pb.SessionRef, context) -> Session:
        return self.d.identity.session(ref.id, ref.token, self._uid(context))

    @_rpc
    async def GetInfo(self, request, context):
        d = self.d
        return pb.GetInfoResponse(
            version=__version__,
            api_version=API_VERSION,
            fd_socket=d.settings.fd_socket,
            fd_protocol_version=fdchannel.VERSION,
            backend=d.backend.kind,
            devices=[device_info(p) for p in d.pools.values()],
            max_pages_per_request=d.settings.max_pages_per_request,
            fd_channel_requests=True,
            fd_channel_requests_only=d.settings.page_ops_on_channel_only,
            fd_channel_keep_handles=True,
            fd_channel_standby=True,
        )

    @_rpc
    async def OpenSession(self, request, context):
        s = self.d.open_session(
            self._uid(context),
            request.channel_secret,
            request.name,
            request.guaranteed_bytes,
            request.max_bytes,
            request.priority,
            dict(request.labels),
        )
        return pb.OpenSessionResponse(
            session=pb.SessionRef(id=s.id, token=s.token), pid=s.pid, uid=s.uid, gid=s.gid, admin=s.admin,
            resume_token=s.resume_token,
        )

    @_rpc
    async def ResumeSession(self, request, context):
        s, adopted, forgotten = await self.d.resume_session(
            self._uid(context),
            request.channel_secret, request.session_id, request.resume_token, list(request.page_ids)
        )
        return pb.ResumeSessionResponse(
            session=pb.SessionRef(id=s.id, token=s.token), pages_adopted=adopted, pages_forgotten=forgotten, admin=s.admin
        )

    @_rpc
    async def CloseSession(self, request, context):
        n = await self.d.close_session(self._bearer(request.session, context))
        return pb.CloseSessionResponse(pages_returned=n)

    @_rpc
    async def Allocate(self, request, context):
        a = await self.d.allocate(
            self._bearer(request.session, context), request.device, request.num_pages, request.wait,
            request.wait_timeout_ms, request.notify_when_available,
        )
        return pb.AllocateResponse(allocation_id=a.allocation_id, device=a.device, page_size=a.page_size,
                                   page_ids=a.page_ids, held_bytes=a.held_bytes)

    @_rpc
    async def Free(self, request, context):
        n, s = await self.d.free(self._bearer(request.session, context), list(request.page_ids))
        return pb.FreeResponse(pages_freed=n, held_bytes=self.d.held_bytes(s))

    @_rpc
    async def GetStats(self, request, context):
        d = self.d
        sessions: list[Session] = []
        if request.HasField("session"):
            s = self._session(request.session, context)
            sessions = d.identity.visible_sessions(s)
        pools = list(d.pools.values())
        books = [p.books() for p in pools]
        for b in books:
            b.check()
        return pb.GetStatsResponse(
            total=pool_stats(books),
            devices=[pb.DeviceStats(device=device_info(p), pool=pool_stats([b])) for p, b in zip(pools, books)],
            sessions=[session_stats(d, s) for s in sessions],
            uptime_seconds=time.monotonic() - d.started_monotonic,
            sessions_open=len(d.sessions),
        )

    async def Watch(self, request, context):
        try:
            request = _parse(request, pb.WatchRequest)
            s = self._session(request.session, context)
        except Exception as exc:  # noqa: BLE001 - every error gets a status
            await _abort(self.d, context, "Watch", exc)
            return
        q = self.d.watch(s)
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    return
                yield event_to_pb(ev)
                if ev.kind == "SHUTDOWN":
                    return
        finally:
            self.d.unwatch(s, q)

    @_rpc
    async def SetSessionLimits(self, request, context):
        self.d.identity.admin_session(request.admin.id, request.admin.token, self._uid(context))
        limits = {f: getattr(request, f) if f in _LIMIT_FIELDS else None for f in request.set_fields}
        s = self.d.set_limits(request.session_id, limits)
        return pb.SetSessionLimitsResponse(session=session_stats(self.d, s))

    @_rpc
    async def RequestShrink(self, request, context):
        d = self.d
        d.identity.shrinker_session(request.admin.id, request.admin.token, request.session_id, self._uid(context))
        sent = d.request_shrink(request.session_id, request.target_bytes, request.timeout_ms, reason="admin")
        if request.wait and sent:
            wait_s = max(0.0, max(ev.deadline for ev in sent) - time.time()) + 0.05
            left = context.time_remaining()  # the caller's own deadline: answer with what stands before it
            if left is not None:
                wait_s = min(wait_s, max(0.0, left - answer_margin(left)))
            waiters = [asyncio.ensure_future(ev.settled.wait()) for ev in sent]
            try:
                await asyncio.wait(waiters, timeout=wait_s)
            finally:
                for w in waiters:
                    w.cancel()
        return pb.RequestShrinkResponse(pages_requested=sum(ev.pages for ev in sent),
                                        reclaims=[reclaim_outcome(d, ev) for ev in sent])


def answer_margin(left: float) -> float:
    """How long before a caller's own deadline RequestShrink(wait) answers
    with what stands: a quarter of the time left, at least 0.2 s and at most
    1 s, for the answer's way back through the daemon, the front door and
    the client on a busy host (a fixed 0.2 s missed a 1.5 s deadline under a
    load average of 10)."""
    return min(1.0, max(0.2, left / 4))


def add_to_server(service: KVCachedService, server) -> None:
    """Register the service like the generated add_KVCachedServicer_to_server,
    but with requests delivered as raw bytes, so that the servicer decodes
    them and a malformed body gets INVALID_ARGUMENT with a message instead of
    grpcio's own UNKNOWN."""
    handlers = {}
    for m in _SERVICE.methods:
        resp_cls = getattr(pb, m.output_type.name)
        fn = getattr(service, m.name)
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(fn, request_deserializer=None, response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
