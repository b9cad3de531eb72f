"""Prometheus metrics of kvcached-serve (`--metrics-address host:port`).

Design (after prometheus/client_python's custom collectors):
- One injectable CollectorRegistry per Metrics object; nothing goes to the
  library's global REGISTRY, so tests can build as many as they like.
- Pool, session and daemon numbers are *read at scrape time* by
  DaemonCollector from `daemon.pools`, `daemon.sessions`, `daemon.counters`
  and `daemon.reclaimer`; there is no second copy of that state. The daemon's
  state belongs to its event loop, so the collector (which runs on the HTTP
  server's thread) asks the loop for one snapshot per scrape: the numbers of
  one scrape come from one instant, so pooled + in_use + free == budget holds
  in the scraped values too.
- What the daemon does not count itself -- request outcomes by status code
  and Allocate latency -- is kept by RpcMetrics as plain numbers (a dict of
  counts, bucket lists) turned into metric families at scrape time, and
  each request is observed exactly once: the core operations both adapters
  reach (Allocate, Free, CloseSession; daemon.CORE_OPS) by the core at their
  boundary (Daemon.observers), whether they came over gRPC or as fd channel
  requests; every other rpc by a grpc.aio server interceptor
  (MetricsInterceptor). Status names come from errors.Code (the one table).
- Device memory from NVML (nvidia-ml-py) when a driver is present: total,
  used and free bytes per GPU UUID. Without a driver these series are absent
  and one debug line says why; nothing is retried per scrape.

Label cardinality is bounded: `device` (one per device), `session` (the
session *name*; sessions sharing a name are summed), `rpc` (the ten
methods of kvcached.v1.KVCached), `code` (gRPC status names).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import grpc
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from ... import __version__, errors
from ...errors import Code
from ...errors_grpc import code_of
from ..core.daemon import CORE_OPS

if TYPE_CHECKING:
    from ..core.daemon import Daemon

log = logging.getLogger("kvcached.metrics")

SERVICE_PREFIX = "/kvcached.v1.KVCached/"
# Allocate latency buckets (seconds): a pooled page is tens of microseconds of
# daemon work plus the fd transfer; creating pages on a GPU is ~0.2 ms each; a
# waiting Allocate may take up to its wait timeout (default 10 s).
ALLOCATE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SNAPSHOT_TIMEOUT = 5.0


def parse_address(address: str) -> tuple[str, int]:
    """'127.0.0.1:9400' -> ('127.0.0.1', 9400); '[::1]:9400' -> ('::1', 9400);
    ':9400' -> ('0.0.0.0', 9400)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def code_name(code: Any) -> str:
    """The name of a status: an errors.Code, a grpc.StatusCode, the integer
    cygrpc uses inside aio, or None (OK)."""
    return code_of(code).name


# ---------------------------------------------------------------------------
# NVML (device memory as the driver sees it)
class Nvml:
    """Total/used/free bytes per GPU UUID from NVML, or nothing.

    Initialised once; if NVML is missing (no driver, no library) one DEBUG
    line is logged and `memory()` returns {} forever after."""

    def __init__(self, loader: Callable[[], Any] | None = None):
        self._nv = None
        self._handles: list[tuple[str, Any]] = []
        try:
            nv = loader() if loader else _import_pynvml()
            nv.nvmlInit()
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = nv.nvmlDeviceGetUUID(h)
                self._handles.append((uuid.decode() if isinstance(uuid, bytes) else uuid, h))
            self._nv = nv
        except Exception as exc:  # noqa: BLE001 - any reason NVML is unusable
            log.debug("NVML device memory metrics off: %s: %s", type(exc).__name__, exc)

    @property
    def available(self) -> bool:
        return self._nv is not None

    def memory(self) -> dict[str, tuple[int, int, int]]:
        if self._nv is None:
            return {}
        out = {}
        for uuid, h in self._handles:
            try:
                m = self._nv.nvmlDeviceGetMemoryInfo(h)
                out[uuid] = (int(m.total), int(m.used), int(m.free))
            except Exception as exc:  # noqa: BLE001 - a lost GPU: skip it this scrape
                log.debug("NVML memory info for %s failed: %s", uuid, exc)
        return out

    def close(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nv = None


def _import_pynvml():
    import pynvml  # nvidia-ml-py

    return pynvml


# ---------------------------------------------------------------------------
# scrape-time collector
def snapshot(daemon: "Daemon", control: Any = None) -> dict:
    """Every number the collector exports, read from the daemon's live state
    (and the control socket's front door, when given). Must run on the
    daemon's event loop thread (or with the loop idle)."""
    recovery = getattr(daemon, "recovery", None)  # the journal's state (recovery/resume.py; NoRecovery without --state-dir)
    by_name, held = _sessions(daemon)
    return {
        "time": time.time(),
        "backend": getattr(daemon.backend, "kind", "unknown"),
        "uptime": time.monotonic() - daemon.started_monotonic,
        "devices": [_device(uuid, pool) for uuid, pool in daemon.pools.items()],
        "sessions": by_name,
        "held": held,
        "sessions_open": len(daemon.sessions),
        "counters": dict(daemon.counters),
        "control": control.stats() if control is not None else None,
        "journal_damaged": 1 if getattr(recovery, "journal_damage", None) else 0,
        "journal_stale": 1 if getattr(recovery, "journal_stale", None) else 0,
        "reclaim": _reclaim(daemon.reclaimer),
    }


def _device(uuid: str, pool: Any) -> dict:
    """One device's numbers, from its pool's books."""
    b = pool.books()
    return {
        "uuid": uuid,
        "name": pool.spec.name,
        "kind": pool.spec.kind,
        "page_size": b.page_size,
        "total": pool.spec.total_bytes,
        "budget": b.budget_bytes,
        "in_use": b.in_use_bytes,
        "pooled": b.pooled_bytes,
        "free": b.free_bytes,
        "unavailable": b.unavailable_bytes,
        "created_total": b.created_total,
        "released_total": b.released_total,
        "allocations_total": b.allocations_total,
        "allocation_failures_total": b.allocation_failures_total,
        "zeroing": b.zeroing * b.page_size,
        "zero_pages_total": b.zeroed_total,
        "zero_batches_total": b.zero_batches_total,
        "zero_failures_total": b.zero_failures_total,
        "zero_waits_total": b.zero_waits_total,
        "zero_wait_seconds_total": b.zero_wait_seconds_total,
        "kept": b.kept * b.page_size,
        "drops_total": b.drops_total,
        "drop_silent_total": b.drop_silent_total,
        "standby": b.standby * b.page_size,
    }


def _sessions(daemon: "Daemon") -> tuple[dict[str, dict], dict[tuple[str, str], int]]:
    """The open sessions by name (counts, limits, reclaim answers), and the
    bytes each name holds on each device."""
    by_name: dict[str, dict] = {}
    held: dict[tuple[str, str], int] = collections.Counter()
    for s in list(daemon.sessions.values()):
        agg = by_name.setdefault(s.name, {"open": 0, "guaranteed": 0, "max": 0, "ignored": 0, "requests": 0})
        agg["open"] += 1
        agg["guaranteed"] += s.guaranteed_bytes
        agg["max"] += s.max_bytes
        agg["ignored"] += s.reclaim_ignored
        agg["requests"] += s.reclaim_requests
        for uuid, n in s.held_by_device.items():
            pool = daemon.pools.get(uuid)
            if pool is not None:
                held[(s.name, uuid)] += n * pool.page_size
    return by_name, dict(held)


def _reclaim(r: Any) -> dict:
    """The reclaimer's counters."""
    return {
        "answers": r.answers_total,
        "requests": r.requests_total,
        "ignored": r.ignored_total,
        "pages_asked": r.pages_asked_total,
        "pages_returned": r.pages_returned_total,
        "by_reason": dict(r.requests_by_reason),
    }


class DaemonCollector:
    """A prometheus_client custom collector over a live Daemon.

    `loop`: the daemon's event loop. When given, each scrape runs `snapshot`
    on that loop (call_soon_threadsafe) and waits up to SNAPSHOT_TIMEOUT; a
    stuck loop makes the scrape fail, which is the honest answer."""

    def __init__(self, daemon: "Daemon", loop: asyncio.AbstractEventLoop | None = None, nvml: Nvml | None = None, control: Any = None):
        self.daemon = daemon
        self.loop = loop
        self.nvml = nvml
        self.control = control

    def _snapshot(self) -> dict:
        loop = self.loop
        if loop is None or _on_loop_thread(loop):
            return snapshot(self.daemon, self.control)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(snapshot(self.daemon, self.control))
            except BaseException as exc:  # noqa: BLE001 - hand it to the scraper
                fut.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return fut.result(SNAPSHOT_TIMEOUT)

    def describe(self):
        # Let the registry learn the names without taking a snapshot.
        return []

    def collect(self):
        snap = self._snapshot()
        yield from _build_families(snap)
        yield from _device_families(snap["devices"])
        if self.nvml is not None:
            yield from _gpu_families(self.nvml.memory())
        yield from _session_families(snap)
        yield from _daemon_counter_families(snap)
        if snap["control"] is not None:
            yield from _control_families(snap["control"])
        yield from _reclaim_families(snap["reclaim"])


# The per-device series: (name, kind, help, the key of the snapshot's device dict).
_DEVICE_SERIES = (
    ("kvcached_device_total_bytes", "gauge", "Device memory as the backend reports it", "total"),
    ("kvcached_device_budget_bytes", "gauge", "The daemon's budget on the device", "budget"),
    ("kvcached_device_in_use_bytes", "gauge", "Bytes in pages held by sessions (or being delivered or created)", "in_use"),
    ("kvcached_device_pooled_bytes", "gauge", "Bytes in created pages held by no session (warm pool)", "pooled"),
    ("kvcached_device_free_bytes", "gauge", "Budget not backed by any page (pooled + in_use + free = budget)", "free"),
    ("kvcached_device_unavailable_bytes", "gauge",
     "Bytes of the configured limit the device does not have free (other processes, pages of a previous daemon "
     "still mapped by its clients); not in the budget (budget + unavailable = the configured limit)", "unavailable"),
    ("kvcached_device_page_size_bytes", "gauge", "Bytes per page", "page_size"),
    ("kvcached_device_pages_created", "counter", "Pages created on the device", "created_total"),
    ("kvcached_device_pages_released", "counter", "Pages released back to the device", "released_total"),
    ("kvcached_device_allocations", "counter", "Allocations the pool satisfied", "allocations_total"),
    ("kvcached_device_allocation_failures", "counter",
     "Allocations the pool could not satisfy (budget exhausted, after any wait)", "allocation_failures_total"),
    ("kvcached_device_zeroing_bytes", "gauge",
     "Bytes of pooled pages given back and not zeroed yet (the background zeroer's queue; part of pooled)", "zeroing"),
    ("kvcached_device_zeroed_pages", "counter", "Pages the background zeroer zeroed", "zero_pages_total"),
    ("kvcached_device_zero_batches", "counter", "Zeroing batches (one backend call each)", "zero_batches_total"),
    ("kvcached_device_zero_failures", "counter", "Pages released because zeroing them failed", "zero_failures_total"),
    ("kvcached_device_zero_waits", "counter",
     "Allocates that found no zeroed page and waited for pages of their uid being zeroed", "zero_waits_total"),
    ("kvcached_device_zero_wait_seconds", "counter", "Seconds Allocates spent waiting for zeroing", "zero_wait_seconds_total"),
    ("kvcached_device_kept_bytes", "gauge",
     "Bytes of pooled pages whose imported handles a client keeps (FREE with keep; part of pooled): "
     "released only after the client answers DROP", "kept"),
    ("kvcached_device_drops", "counter", "Pages the daemon asked keepers to drop (DROP) before releasing them", "drops_total"),
    ("kvcached_device_standby_bytes", "gauge",
     "Bytes of pages sessions keep mapped as standby (FREE with standby; part of in_use): asked for first "
     "by a reclaim", "standby"),
    ("kvcached_device_drop_silent", "counter", "Keepers that lost their session for not answering DROP in time",
     "drop_silent_total"),
)

# The daemon's own counters: (name, help, the key of snap["counters"]).
_DAEMON_COUNTERS = (
    ("kvcached_sessions_opened", "Sessions opened", "sessions_opened"),
    ("kvcached_sessions_closed", "Sessions ended normally (CloseSession, channel closed, shutdown)", "sessions_closed"),
    ("kvcached_sessions_crashed", "Sessions ended because the client process exited without closing", "sessions_crashed"),
    ("kvcached_fd_channel_errors",
     "fd channel failures (accept, set-up, page delivery, protocol errors that closed a channel)", "fd_channel_errors"),
    ("kvcached_fd_channel_malformed_requests", "Malformed request records answered INVALID_ARGUMENT (the session went on)",
     "fd_channel_malformed_requests"),
)

# The reclaimer's counters: (name, help, the key of snap["reclaim"]).
_RECLAIM_COUNTERS = (
    ("kvcached_reclaim_requests", "Reclaim requests sent to sessions", "requests"),
    ("kvcached_reclaim_asked_pages", "Pages asked back by reclaim requests", "pages_asked"),
    ("kvcached_reclaim_ignored", "Reclaim requests that expired without the pages coming back", "ignored"),
    ("kvcached_reclaim_returned_pages", "Pages freed in answer to an open reclaim request", "pages_returned"),
    ("kvcached_reclaim_answers", "Reclaim requests a session answered (ANSWER: what it gave, what it keeps)", "answers"),
)

_FAMILY = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


def _labelled(kind: str, name: str, doc: str, labels: list[str], samples) -> GaugeMetricFamily | CounterMetricFamily:
    """A family of `kind` with one sample per (label values, value) of `samples`."""
    fam = _FAMILY[kind](name, doc, labels=labels)
    for values, v in samples:
        fam.add_metric(list(values), v)
    return fam


def _build_families(snap: dict):
    info = InfoMetricFamily("kvcached_build", "kvcached-serve version and page backend", labels=["version", "backend"])
    info.add_metric([__version__, snap["backend"]], {})
    yield info
    yield GaugeMetricFamily("kvcached_uptime_seconds", "Seconds since the daemon started", value=snap["uptime"])


def _device_families(devices: list[dict]):
    dinfo = InfoMetricFamily("kvcached_device", "A device the daemon serves", labels=["device", "name", "kind"])
    for d in devices:
        dinfo.add_metric([d["uuid"], d["name"], d["kind"]], {})
    yield dinfo
    for name, kind, doc, key in _DEVICE_SERIES:
        yield _labelled(kind, name, doc, ["device"], (([d["uuid"]], d[key]) for d in devices))


def _gpu_families(mem: dict | None):
    """Device memory from NVML, per GPU UUID (absent without a driver)."""
    if not mem:
        return
    for i, (name, doc) in enumerate((
        ("kvcached_gpu_memory_total_bytes", "GPU memory in total (NVML)"),
        ("kvcached_gpu_memory_used_bytes", "GPU memory used by every process (NVML)"),
        ("kvcached_gpu_memory_free_bytes", "GPU memory free (NVML)"),
    )):
        yield _labelled("gauge", name, doc, ["device"], (([uuid], vals[i]) for uuid, vals in sorted(mem.items())))


def _session_families(snap: dict):
    sessions = sorted(snap["sessions"].items())
    yield GaugeMetricFamily("kvcached_sessions_open", "Open sessions", value=snap["sessions_open"])
    yield _labelled("gauge", "kvcached_session_open", "Open sessions with this name", ["session"],
                    (([name], agg["open"]) for name, agg in sessions))
    yield _labelled("gauge", "kvcached_session_held_bytes", "Bytes held by the sessions of this name on the device",
                    ["session", "device"], (([name, uuid], n) for (name, uuid), n in sorted(snap["held"].items())))
    yield _labelled("gauge", "kvcached_session_guaranteed_bytes",
                    "Guaranteed bytes per device (summed over sessions of this name)", ["session"],
                    (([name], agg["guaranteed"]) for name, agg in sessions))
    yield _labelled("gauge", "kvcached_session_max_bytes",
                    "Maximum bytes per device (summed over sessions of this name; 0 = the device budget)", ["session"],
                    (([name], agg["max"]) for name, agg in sessions))
    yield _labelled("gauge", "kvcached_session_reclaim_ignored",
                    "Reclaim requests the open sessions of this name let expire (resets when a session ends)", ["session"],
                    (([name], agg["ignored"]) for name, agg in sessions))


def _daemon_counter_families(snap: dict):
    c = snap["counters"]
    for name, doc, key in _DAEMON_COUNTERS:
        yield CounterMetricFamily(name, doc, value=c.get(key, 0))
    yield GaugeMetricFamily("kvcached_journal_damaged",
                            "1 when this daemon found its journal damaged at start and moved it aside (no resumes)",
                            value=snap["journal_damaged"])
    yield GaugeMetricFamily("kvcached_journal_stale", "1 while the journal cannot be written (state dir full or read-only): "
                            "the books stay right, but sessions are not resumable after a restart until it is rewritten",
                            value=snap["journal_stale"])


def _control_families(ctl: dict):
    yield GaugeMetricFamily("kvcached_control_connections", "Open connections on the control (gRPC) socket", value=ctl["open"])
    yield _labelled("counter", "kvcached_control_connections_refused",
                    "Control connections refused by a limit (per_uid: max_grpc_connections_per_uid, total: max_grpc_connections)",
                    ["limit"], (([kind], n) for kind, n in sorted(ctl["refused"].items())))
    yield CounterMetricFamily("kvcached_control_connections_closed_idle",
                              "Control connections the daemon closed (idle for grpc_idle_timeout, or at shutdown)",
                              value=ctl["closed_by_server"])


def _reclaim_families(r: dict):
    for name, doc, key in _RECLAIM_COUNTERS:
        yield CounterMetricFamily(name, doc, value=r[key])
    yield _labelled("counter", "kvcached_reclaim_requests_by_reason", "Reclaim requests by reason (allocate, idle, admin)",
                    ["reason"], (([reason], n) for reason, n in sorted(r["by_reason"].items())))


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


# ---------------------------------------------------------------------------
# rpc outcomes and latency: a grpc.aio server interceptor
class RpcMetrics:
    """Rpc outcomes by (rpc, code) and Allocate latency by whether it
    waited, kept as plain numbers and turned into metric families at scrape
    time (a collector, registered in the daemon's registry).

    Every writer runs on the event loop thread (the core's observers and
    the gRPC interceptor); a scrape reads from the HTTP thread, copying each
    container in one step under the GIL. prometheus-client's Counter and
    Histogram would take a lock and look up a labelled child on every
    observation, and the core observes every Allocate and Free: the request
    path's most frequent calls (docs/benchmarks.md, issue 18)."""

    def __init__(self, registry: CollectorRegistry):
        # Make the common series exist from the start (0 is better than absent).
        self._requests: dict[tuple[str, str], int] = {("Allocate", "OK"): 0, ("Free", "OK"): 0}
        self._code_names: dict[Any, str] = {}
        # per wait (False, True): [counts per bucket, the last one +Inf; sum of seconds]
        self._allocate: dict[bool, list] = {w: [[0] * (len(ALLOCATE_BUCKETS) + 1), 0.0] for w in (False, True)}
        registry.register(self)

    def observe(self, rpc: str, code: Any, seconds: float, request: Any = None) -> None:
        self.observe_op(rpc, code, seconds, _waits(request) if rpc == "Allocate" else False)

    def observe_op(self, rpc: str, code: Any, seconds: float, waited: bool) -> None:
        name = self._code_names.get(code)
        if name is None:
            name = self._code_names[code] = code_name(code)
        key = (rpc, name)
        self._requests[key] = self._requests.get(key, 0) + 1
        if rpc == "Allocate":
            h = self._allocate[bool(waited)]
            h[0][bisect.bisect_left(ALLOCATE_BUCKETS, seconds)] += 1  # le: a value on a bound counts in that bucket
            h[1] += seconds

    def describe(self):
        return [CounterMetricFamily("kvcached_rpc_requests", _REQUESTS_DOC, labels=["rpc", "code"]),
                HistogramMetricFamily("kvcached_allocate_duration_seconds", _ALLOCATE_DOC, labels=["wait"])]

    def collect(self):
        requests = CounterMetricFamily("kvcached_rpc_requests", _REQUESTS_DOC, labels=["rpc", "code"])
        for (rpc, code), n in sorted(self._requests.copy().items()):
            requests.add_metric([rpc, code], n)
        yield requests
        hist = HistogramMetricFamily("kvcached_allocate_duration_seconds", _ALLOCATE_DOC, labels=["wait"])
        for w in (False, True):
            h = self._allocate[w]
            counts, total = list(h[0]), h[1]
            cumulative, buckets = 0, []
            for bound, n in zip(ALLOCATE_BUCKETS + (math.inf,), counts):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            hist.add_metric(["true" if w else "false"], buckets, total)
        yield hist


_REQUESTS_DOC = "Control-plane rpcs handled, by method and gRPC status code"
_ALLOCATE_DOC = "Allocate rpc latency in the daemon (including the fd transfer), by whether the caller allowed waiting"


def _waits(request: Any) -> bool:
    """Whether an Allocate asked to wait. The servicer receives raw bytes
    (it decodes them itself), so decode here too when needed."""
    if isinstance(request, (bytes, bytearray)):
        from ..._generated.kvcached.v1 import kvcached_pb2 as pb
        from google.protobuf.message import DecodeError

        try:
            return pb.AllocateRequest.FromString(bytes(request)).wait
        except DecodeError:
            return False
    return bool(getattr(request, "wait", False))


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times and counts every rpc of kvcached.v1.KVCached by status code.

    The status is read from the servicer context after the handler returns
    (or aborts): the servicer maps every error to its code in one place and
    aborts with it, so the code seen here is the code the client sees."""

    def __init__(self, rpc_metrics: RpcMetrics):
        self.m = rpc_metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        rpc = method[len(SERVICE_PREFIX) :]
        if rpc in CORE_OPS:
            return handler  # the core observes these itself (Daemon.observers)
        m = self.m
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                t0 = time.perf_counter()
                code: Any = None
                try:
                    resp = await inner(request, context)
                    code = context.code()
                    return resp
                except BaseException as exc:
                    code = context.code()
                    if code is None or code_name(code) == "OK":
                        code = Code.CANCELLED if isinstance(exc, asyncio.CancelledError) else Code.UNKNOWN
                    raise
                finally:
                    m.observe(rpc, code, time.perf_counter() - t0, request)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                t0 = time.perf_counter()
                code: Any = None
                try:
                    async for item in inner_stream(request, context):
                        yield item
                    code = context.code()
                except BaseException as exc:
                    code = context.code()
                    if code is None or code_name(code) == "OK":
                        code = Code.CANCELLED if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else Code.UNKNOWN
                    raise
                finally:
                    m.observe(rpc, code, time.perf_counter() - t0, request)

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
            )
        return handler


# ---------------------------------------------------------------------------
# the whole thing, as main.py uses it
class Metrics:
    """Registry + collector + interceptor + HTTP endpoint for one daemon.

        metrics = Metrics(daemon)                     # before the grpc server exists
        server = grpc.aio.server(interceptors=metrics.interceptors())
        metrics.start_http("127.0.0.1:9400")          # once the loop runs
        ...
        metrics.stop()
    """

    def __init__(self, daemon: "Daemon", registry: CollectorRegistry | None = None, *, nvml: Nvml | None = None, process: bool = True,
                 control: Any = None):
        self.daemon = daemon
        # No *_created series beside counters and histograms: they double the
        # series count and no alert or dashboard reads them.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.rpc = RpcMetrics(self.registry)
        self.nvml = nvml if nvml is not None else Nvml()
        self.collector = DaemonCollector(daemon, None, self.nvml, control)
        self.registry.register(self.collector)
        if process:
            # process_open_fds / process_max_fds matter here: every host page is one fd.
            ProcessCollector(registry=self.registry)
        self._server = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None
        # Allocate/Free/CloseSession, over gRPC or as fd channel requests:
        # the core reports each once, at its boundary.
        observers = getattr(daemon, "observers", None)
        if observers is not None:
            observers.append(self.rpc.observe_op)  # (rpc, code, seconds, waited)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [MetricsInterceptor(self.rpc)]

    def text(self) -> bytes:
        """The exposition, as a scrape would get it."""
        return generate_latest(self.registry)

    def start_http(self, address: str) -> tuple[str, int]:
        """Serve /metrics on `address` (host:port; port 0 = any free port).
        Call from the daemon's event loop. Returns the bound (host, port)."""
        from prometheus_client import start_http_server

        self.collector.loop = asyncio.get_running_loop()
        host, port = parse_address(address)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise errors.FailedPrecondition(f"metrics_address {address}: cannot listen: {exc.strerror or exc}") from None
        bound = self._server.server_address
        self.address = (bound[0], bound[1])
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        log.info("metrics on http://%s:%d/metrics", shown, bound[1])
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.nvml.close()
