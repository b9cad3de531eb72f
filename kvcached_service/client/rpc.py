"""The Python client's gRPC adapter: the only client module that imports
grpc or protobuf. Calls in, value types (types.py) out; every failed rpc is
raised through errors_grpc.from_grpc.

Page operations are not here: the client sends Allocate, Free and Close as
requests on the session's fd channel (channel.py). gRPC carries the rest:
GetInfo, OpenSession, ResumeSession, GetStats, Watch and the admin rpcs.
"""

from __future__ import annotations

from typing import Iterator

import grpc

from .. import errors
from .._generated.kvcached.v1 import kvcached_pb2 as pb
from .._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from ..errors import Code
from ..errors_grpc import code_of, from_grpc
from .types import Device, Event, Info, Opened, PoolStats, ReclaimOutcome, SessionStats, Shrink, Stats

# Reconnect quickly after a daemon restart (gRPC's default backoff grows to minutes).
_CHANNEL_OPTIONS = [
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 1000),  # also the connect timeout: not too short
    ("grpc.max_reconnect_backoff_ms", 1000),
]

Ref = tuple[int, bytes]  # (session id, token)


def _ref(ref: Ref) -> pb.SessionRef:
    return pb.SessionRef(id=ref[0], token=ref[1])


def _pool_stats(m: pb.PoolStats) -> PoolStats:
    return PoolStats(*(getattr(m, f) for f in PoolStats.__dataclass_fields__))


def _session_stats(m: pb.SessionStats) -> SessionStats:
    vals = {f: getattr(m, f) for f in SessionStats.__dataclass_fields__}
    vals["labels"] = dict(m.labels)
    vals["held_bytes_by_device"] = dict(m.held_bytes_by_device)
    return SessionStats(**vals)


def _event(m: pb.WatchEvent) -> Event:
    kind = pb.WatchEvent.Kind.Name(m.kind)
    if kind == "RECLAIM":
        r = m.reclaim
        return Event(kind, m.time_unix, r.device, r.pages, r.deadline_unix, r.reason, reclaim_id=r.id)
    if kind == "MEMORY_AVAILABLE":
        return Event(kind, m.time_unix, m.available.device, m.available.pages)
    if kind == "SHUTDOWN":
        return Event(kind, m.time_unix, reason=m.shutdown.reason, data={"grace_seconds": m.shutdown.grace_seconds})
    if kind == "BUDGET_CHANGED":
        b = m.budget
        return Event(kind, m.time_unix, b.device, data={
            "budget_bytes": b.budget_bytes, "guaranteed_bytes": b.guaranteed_bytes,
            "max_bytes": b.max_bytes, "priority": b.priority})
    return Event(kind, m.time_unix)


class WatchStream:
    """Watch events of one session; `cancel` ends the stream (from any thread)."""

    def __init__(self, call):
        self._call = call
        self.cancelled = False

    def __iter__(self) -> Iterator[Event]:
        try:
            for m in self._call:
                yield _event(m)
        except grpc.RpcError as exc:
            if code_of(exc.code()) == Code.CANCELLED and self.cancelled:
                return
            raise from_grpc(exc) from None

    def cancel(self) -> None:
        self.cancelled = True
        self._call.cancel()


class Rpc:
    """A gRPC connection to the daemon's control socket."""

    def __init__(self, path: str, timeout: float):
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix:{path}", options=_CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise errors.Unavailable(f"no kvcached daemon answers on {path} (is kvcached-serve running?)") from None
        self._stub = pb_grpc.KVCachedStub(self._channel)

    def _call(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None

    def get_info(self) -> Info:
        m = self._call("GetInfo", pb.GetInfoRequest())
        devices = tuple(Device(d.uuid, d.name, d.kind, d.page_size, d.granularity, d.total_bytes, d.budget_bytes) for d in m.devices)
        return Info(m.version, m.api_version, m.fd_socket, m.fd_protocol_version, m.backend, devices,
                    m.max_pages_per_request, m.fd_channel_requests, m.fd_channel_requests_only, m.fd_channel_keep_handles,
                    m.fd_channel_standby)

    def open_session(self, secret: bytes, name: str, guaranteed_bytes: int, max_bytes: int, priority: int,
                     labels: dict[str, str] | None) -> Opened:
        m = self._call("OpenSession", pb.OpenSessionRequest(
            channel_secret=secret, name=name, guaranteed_bytes=guaranteed_bytes, max_bytes=max_bytes,
            priority=priority, labels=labels or {}))
        return Opened(m.session.id, m.session.token, m.admin, m.pid, m.uid, m.gid, m.resume_token)

    def resume_session(self, secret: bytes, session_id: int, resume_token: bytes, page_ids: list[int]) -> Opened:
        m = self._call("ResumeSession", pb.ResumeSessionRequest(
            channel_secret=secret, session_id=session_id, resume_token=resume_token, page_ids=page_ids))
        return Opened(m.session.id, m.session.token, m.admin, pages_adopted=m.pages_adopted, pages_forgotten=m.pages_forgotten)

    def stats(self, ref: Ref | None = None) -> Stats:
        m = self._call("GetStats", pb.GetStatsRequest(session=_ref(ref)) if ref else pb.GetStatsRequest())
        return Stats(
            _pool_stats(m.total),
            {d.device.uuid: _pool_stats(d.pool) for d in m.devices},
            [_session_stats(s) for s in m.sessions],
            m.uptime_seconds,
            m.sessions_open,
        )

    def watch(self, ref: Ref) -> WatchStream:
        return WatchStream(self._stub.Watch(pb.WatchRequest(session=_ref(ref))))

    def set_limits(self, ref: Ref, session_id: int, **limits) -> SessionStats:
        req = pb.SetSessionLimitsRequest(admin=_ref(ref), session_id=session_id, set_fields=list(limits), **limits)
        return _session_stats(self._call("SetSessionLimits", req).session)

    def request_shrink(self, ref: Ref, session_id: int, target_bytes: int, timeout_ms: int, wait: bool = False) -> Shrink:
        req = pb.RequestShrinkRequest(admin=_ref(ref), session_id=session_id, target_bytes=target_bytes, timeout_ms=timeout_ms, wait=wait)
        # waiting: the daemon answers by the request's deadline (timeout_ms, or its reclaim timeout)
        m = self._call("RequestShrink", req, timeout=self.timeout + (timeout_ms / 1000 if timeout_ms else 60) if wait else None)
        return Shrink(m.pages_requested, tuple(
            ReclaimOutcome(r.reclaim_id, r.device, r.pages_requested, pb.ReclaimOutcome.State.Name(r.state), r.answered,
                           r.bytes_given, r.bytes_kept, r.reason, r.held_bytes) for r in m.reclaims))

    def close(self) -> None:
        self._channel.close()
