"""CUDA backend: pages are VMM allocations exported as POSIX fds.

A page is one cuMemCreate allocation (pinned device memory, requestedHandleTypes
= CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). When the worker creates a page
it also:
- exports it once (cuMemExportToShareableHandle) and keeps that fd for the
  page's life (`PageHandle.fd`): every delivery sends it as it is (the
  kernel gives the receiver its own copy), so lending a pooled page makes
  no driver call at all. At most `kept_export_cap` pages of a device keep
  one (the daemon's open-file limit less a reserve for connections); a page
  over the cap is exported for each delivery instead (`export_fds`, on the
  worker), the fd closed once sent;
- maps it into the daemon's own address space, one slot of a zeroing
  window (a reservation of ARENA_WINDOW_PAGES pages), with access set once
  per run of adjacent slots. The mapping stays for the page's life, so
  zeroing a page is one asynchronous memset over its slot: `zero_pages`
  issues cuMemsetD8Async on the device's stream for each run of adjacent
  slots of the batch, records one event (CU_EVENT_BLOCKING_SYNC: the thread
  sleeps in cuEventSynchronize instead of spinning in cuCtxSynchronize) and
  waits for it. No map, set-access or unmap per zeroing.
Release unmaps the slot (one cuMemUnmap per run of adjacent slots), closes
the kept fd and calls cuMemRelease. Clients import the fd and map it into
their own reservations (client/cuda_mapper.py).

Pages a client re-sends after a daemon restart (adopt_pages) are imported
(the handle maps the page into a slot and releases it later), and the
re-sent fd is kept as the page's export.

Threading: the pool calls a device's create, export and release on the
device's worker thread and zero_pages on a second worker of its own
(server/core/pool/zeroer.py). `worker_init` retains the device's primary context
and makes it current on the calling thread (each worker); the last
`worker_exit` frees the stream, the event and the windows and the context
goes with the last release. Calls made from any other thread (`memory_info`
from a stats path, `close` at shutdown) make the context current for their
duration and restore the thread's previous one.

Zeroing: fresh cuMemCreate memory is not guaranteed to be zero, and a page
going from one uid to another must be cleared: that is why the daemon holds
a CUDA context at all (docs/cuda.md).

Every driver call goes through kvcached_service.cuda.driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import logging
import os
import resource
import threading
from dataclasses import dataclass, field

from .. import errors
from ..cuda import driver as cu
from .base import Backend, DeviceSpec, PageHandle

log = logging.getLogger(__name__)

# Pages of one zeroing window (a reservation in the daemon's address space;
# windows are reserved as pages need slots).
ARENA_WINDOW_PAGES = 512
# Open files kept back from the pages' kept exports: client channels, pidfds,
# control connections, the journal (at least this many, or a quarter of the limit).
FD_RESERVE_MIN = 1024


class CudaUnavailable(errors.FailedPrecondition):
    """The CUDA backend cannot run here; the message says why."""


@dataclass
class _Window:
    """One reservation of the zeroing arena: `slots` page-sized slots."""

    base: int
    size: int
    slot_size: int
    free: list = field(default_factory=list)  # heap of free slot indexes

    def take(self) -> int:
        return self.base + heapq.heappop(self.free) * self.slot_size

    def give(self, addr: int) -> None:
        heapq.heappush(self.free, (addr - self.base) // self.slot_size)

    @property
    def empty(self) -> bool:
        return len(self.free) * self.slot_size == self.size


@dataclass
class _Device:
    spec: DeviceSpec
    ctx: int | None = None  # retained primary context (worker_init .. the last worker_exit)
    ctx_refs: int = 0  # worker threads that retained it
    windows: list = field(default_factory=list)  # _Window, the zeroing arena
    stuck: list = field(default_factory=list)  # (addr, size) slots that failed to unmap (never reused)
    stream: int | None = None  # the zeroing stream (CU_STREAM_NON_BLOCKING), made on first use
    event: int | None = None  # its event (CU_EVENT_BLOCKING_SYNC)
    live: dict = field(default_factory=dict)  # id(page) -> page, for close()
    kept: int = 0  # pages keeping an export (under the backend's lock)


class CudaBackend(Backend):
    kind = "cuda"
    fds_per_page = 1  # a kept export per page, up to kept_export_cap
    fresh_exports = True  # export_fds: new fds (dups of the kept ones, or exports), the caller's to close

    def __init__(self, driver: cu.Driver | None = None):
        self._drv = driver or cu.load()
        self._export_needs_ctx = False  # set if the driver refused an export without a current context
        self._lock = threading.Lock()
        self._tls = threading.local()  # .current: set of devices whose context this thread made current
        self._devices: list[_Device] = []
        self._closed = False
        self._kept_cap: int | None = None  # kept_export_cap when set; None: from the fd limit
        self._probe()

    # ------------------------------------------------------------------ start-up

    def _probe(self) -> None:
        drv = self._drv
        try:
            drv.cuInit(0)
        except cu.CudaDriverError as exc:
            raise CudaUnavailable(f"CUDA driver {drv.path!r} did not initialise: cuInit failed: {exc.name}") from exc
        count = ctypes.c_int()
        try:
            drv.cuDeviceGetCount(ctypes.byref(count))
        except cu.CudaDriverError as exc:
            raise CudaUnavailable(f"cannot count CUDA devices: {exc}") from exc
        if count.value == 0:
            raise CudaUnavailable("the CUDA driver reports no devices (check CUDA_VISIBLE_DEVICES)")
        problems: list[str] = []
        for ordinal in range(count.value):
            try:
                spec, problem = self._probe_device(ordinal)
            except cu.CudaDriverError as exc:
                problems.append(f"device {ordinal}: {exc}")
                continue
            if problem:
                problems.append(f"device {ordinal} ({spec.uuid}, {spec.name}): {problem}")
            else:
                self._devices.append(_Device(spec=spec))
        if problems:
            raise CudaUnavailable("CUDA device check failed: " + "; ".join(problems))

    def _probe_device(self, ordinal: int) -> tuple[DeviceSpec, str | None]:
        drv = self._drv
        dev = cu.CUdevice()
        drv.cuDeviceGet(ctypes.byref(dev), ordinal)
        uuid = cu.CUuuid()
        drv.cuDeviceGetUuid_v2(ctypes.byref(uuid), dev)
        name = ctypes.create_string_buffer(256)
        drv.cuDeviceGetName(name, len(name), dev)
        total = ctypes.c_size_t()
        drv.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
        spec_args = dict(
            uuid=cu.format_uuid(uuid),
            name=name.value.decode(errors="replace"),
            kind="cuda",
            ordinal=ordinal,
            total_bytes=total.value,
        )
        value = ctypes.c_int()
        drv.cuDeviceGetAttribute(ctypes.byref(value), cu.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)
        if not value.value:
            return DeviceSpec(granularity=0, **spec_args), (
                "virtual memory management is not supported "
                "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)"
            )
        drv.cuDeviceGetAttribute(
            ctypes.byref(value), cu.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev
        )
        if not value.value:
            return DeviceSpec(granularity=0, **spec_args), (
                "exporting memory as POSIX file descriptors is not supported "
                "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0)"
            )
        gran = ctypes.c_size_t()
        prop = cu.allocation_prop(ordinal)
        try:
            drv.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), cu.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        except cu.CudaDriverError as exc:
            return DeviceSpec(granularity=0, **spec_args), f"allocation granularity unavailable: {exc}"
        if gran.value <= 0 or gran.value % os.sysconf("SC_PAGE_SIZE"):
            return DeviceSpec(granularity=0, **spec_args), f"unusable allocation granularity {gran.value}"
        return DeviceSpec(granularity=gran.value, **spec_args), None

    # ------------------------------------------------------------------ interface

    def devices(self) -> list[DeviceSpec]:
        return [d.spec for d in self._devices]

    # ------------------------------------------------------------------ interface

    def devices(self) -> list[DeviceSpec]:
        return [d.spec for d in self._devices]

    @property
    def kept_export_cap(self) -> int:
        """Pages of a device that may keep an export: the open-file limit in
        force (the daemon raises its soft limit to the hard one at start)
        less a reserve for everything else the daemon opens."""
        if self._kept_cap is not None:
            return self._kept_cap
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        return max(0, soft - max(FD_RESERVE_MIN, soft // 4))

    @kept_export_cap.setter
    def kept_export_cap(self, n: int | None) -> None:
        """Set it (tests, a small fd limit), or None: from the fd limit again."""
        self._kept_cap = n

    def worker_init(self, device: int) -> None:
        d = self._dev(device)
        ctx = cu.CUcontext()
        self._drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d.spec.ordinal)
        try:
            self._drv.cuCtxSetCurrent(ctx)
        except BaseException:
            self._drv.cuDevicePrimaryCtxRelease_v2(d.spec.ordinal)
            raise
        with self._lock:
            d.ctx = ctx.value
            d.ctx_refs += 1
        self._current_set().add(device)

    def worker_exit(self, device: int) -> None:
        d = self._dev(device)
        if d.ctx is None or device not in self._current_set():
            return
        first: BaseException | None = None
        with self._lock:
            last = d.ctx_refs == 1
        if last:
            try:
                self._free_sync_objects(d)
                self._free_windows(d)
            except BaseException as exc:  # keep going: the context must be released
                first = exc
        with contextlib.suppress(cu.CudaDriverError):
            self._drv.cuCtxSetCurrent(None)
        try:
            self._drv.cuDevicePrimaryCtxRelease_v2(d.spec.ordinal)
            with self._lock:
                d.ctx_refs -= 1
                if d.ctx_refs == 0:
                    d.ctx = None  # kept on failure: close() retries the release
        except cu.CudaDriverError as exc:
            first = first or exc
        self._current_set().discard(device)
        if first is not None:
            raise first

    def create_pages(self, device: int, count: int, page_size: int, zero: bool) -> list[PageHandle]:
        """Create `count` pages, each exported once (kept, up to the cap) and
        mapped into a slot of the zeroing arena; with `zero`, zeroed there
        before this returns. All or nothing."""
        d = self._dev(device)
        if count <= 0:
            raise errors.InvalidArgument(f"page count must be positive, got {count}")
        if page_size <= 0 or page_size % d.spec.granularity:
            raise errors.InvalidArgument(
                f"page size {page_size} is not a multiple of {d.spec.uuid}'s granularity {d.spec.granularity}"
            )
        prop = cu.allocation_prop(d.spec.ordinal)
        pages: list[PageHandle] = []
        try:
            with self._context(d):
                for _ in range(count):
                    handle = cu.CUmemGenericAllocationHandle()
                    self._drv.cuMemCreate(ctypes.byref(handle), page_size, ctypes.byref(prop), 0)
                    pages.append(PageHandle(fd=-1, size=page_size, native=handle.value))
                self._keep_exports(d, pages)
                self._arena_map(d, pages)
                if zero:
                    self._zero(d, pages)
        except BaseException as exc:
            self._rollback(d, pages)
            if isinstance(exc, cu.CudaDriverError):
                raise exc.with_context(f"creating {count} page(s) of {page_size} bytes on {d.spec.uuid}") from None
            if isinstance(exc, OSError):
                raise errors.ResourceExhausted(f"creating {count} page(s) on {d.spec.uuid}: {exc.strerror}") from None
            raise
        with self._lock:
            for page in pages:
                d.live[id(page)] = page
        return pages

    def adopt_pages(self, device: int, fds: list[int], page_size: int) -> list[PageHandle]:
        """Import each re-sent fd (the handle maps the page into the zeroing
        arena and releases it later) and keep the fd as the page's export."""
        d = self._dev(device)
        pages: list[PageHandle] = []
        try:
            with self._context(d):
                for fd in fds:
                    handle = cu.CUmemGenericAllocationHandle()
                    self._drv.cuMemImportFromShareableHandle(
                        ctypes.byref(handle), ctypes.c_void_p(fd), cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                    )
                    pages.append(PageHandle(fd=fd, size=page_size, native=handle.value, ready=True))
                    with self._lock:
                        d.kept += 1
                self._arena_map(d, pages)
        except BaseException as exc:
            self._rollback(d, pages)  # closes the fds of the pages made
            for fd in fds[len(pages):]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if isinstance(exc, cu.CudaDriverError):
                raise exc.with_context(f"adopting {len(fds)} re-sent page(s) on {d.spec.uuid}") from None
            raise
        with self._lock:
            for page in pages:
                d.live[id(page)] = page
        return pages

    def exports_ready(self, pages: list[PageHandle]) -> bool:
        """Whether export_fds of these pages needs no driver call (each keeps
        an export to duplicate; export_fds then needs no current context)."""
        return all(p.fd >= 0 for p in pages)

    def export_fds(self, device: int, pages: list[PageHandle]) -> list[int]:
        """A new fd for each page, which the caller closes once sent: a
        duplicate of the page's kept export (no driver call), or an export
        of its handle (on the worker). The pool sends kept exports as they
        are and calls this only for pages that keep none (and for readers
        that want their own fds). All or nothing. (VMM calls need no
        current context; if the driver says otherwise, every later export
        makes it current.)"""
        d = self._dev(device)
        out: list[int] = []
        try:
            if self._export_needs_ctx and not self.exports_ready(pages):
                with self._context(d):
                    self._export_into(pages, out)
            else:
                try:
                    self._export_into(pages, out)
                except cu.CudaDriverError as exc:
                    if exc.name != "CUDA_ERROR_INVALID_CONTEXT":
                        raise
                    log.info("cuMemExportToShareableHandle needs a current context on this driver; exports make it current")
                    self._export_needs_ctx = True
                    with self._context(d):
                        self._export_into(pages, out)
        except BaseException as exc:
            for fd in out:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if isinstance(exc, cu.CudaDriverError):
                raise exc.with_context(f"exporting {len(pages)} page(s) on {d.spec.uuid}") from None
            if isinstance(exc, OSError):
                raise errors.ResourceExhausted(f"exporting {len(pages)} page(s) on {d.spec.uuid}: {exc.strerror}") from None
            raise
        return out

    def zero_pages(self, device: int, pages: list[PageHandle]) -> None:
        d = self._dev(device)
        try:
            with self._context(d):
                self._zero(d, pages)
        except cu.CudaDriverError as exc:
            raise exc.with_context(f"zeroing {len(pages)} page(s) on {d.spec.uuid}") from None

    def release_pages(self, device: int, pages: list[PageHandle]) -> None:
        d = self._dev(device)
        with self._context(d):
            first = self._release(d, pages)
        if first is not None:
            if isinstance(first, cu.CudaDriverError):
                raise first.with_context(f"releasing pages on {d.spec.uuid}") from None
            raise errors.Internal(f"releasing pages on {d.spec.uuid}: {first}") from first

    def memory_info(self, device: int) -> tuple[int, int]:
        d = self._dev(device)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with self._context(d):
            self._drv.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


    def close(self) -> None:
        """Release what is left: pages the pool did not release, the zeroing
        arena, stream and event, contexts of workers that did not exit.
        Raises the first error after trying everything."""
        if self._closed:
            return
        first: BaseException | None = None
        for d in self._devices:
            with self._lock:
                leftover = list(d.live.values())
            try:
                if leftover:
                    log.warning("releasing %d page(s) still held on %s at close", len(leftover), d.spec.uuid)
                    self.release_pages(d.spec.ordinal, leftover)
            except BaseException as exc:
                first = first or exc
            try:
                if d.windows or d.stuck or d.stream is not None or d.event is not None:
                    with self._context(d, force=True):
                        self._free_sync_objects(d)
                        self._free_windows(d)
            except BaseException as exc:
                first = first or exc
            while d.ctx is not None and d.ctx_refs > 0:  # workers that could not release it
                try:
                    self._drv.cuDevicePrimaryCtxRelease_v2(d.spec.ordinal)
                    d.ctx_refs -= 1
                    if d.ctx_refs == 0:
                        d.ctx = None
                except BaseException as exc:
                    first = first or exc
                    break
        self._closed = True
        if first is not None:
            raise first

    # ------------------------------------------------------------------ internals

    def _dev(self, device: int) -> _Device:
        if not 0 <= device < len(self._devices):
            raise errors.NotFound(f"no CUDA device {device} (this backend has {len(self._devices)})")
        return self._devices[device]

    def _current_set(self) -> set:
        cur = getattr(self._tls, "current", None)
        if cur is None:
            cur = self._tls.current = set()
        return cur

    @contextlib.contextmanager
    def _context(self, d: _Device, force: bool = False):
        """The device's primary context current on this thread for the block.
        On the worker thread after worker_init it already is: no calls."""
        if not force and d.ctx is not None and d.spec.ordinal in self._current_set():
            yield
            return
        drv = self._drv
        prev = cu.CUcontext()
        drv.cuCtxGetCurrent(ctypes.byref(prev))
        ctx = cu.CUcontext()
        drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d.spec.ordinal)
        try:
            drv.cuCtxSetCurrent(ctx)
            try:
                yield
            finally:
                drv.cuCtxSetCurrent(prev)
        finally:
            drv.cuDevicePrimaryCtxRelease_v2(d.spec.ordinal)


    def _keep_exports(self, d: _Device, pages: list[PageHandle]) -> None:
        """Export each new page once and keep the fd, while the device's
        pages keep fewer than kept_export_cap. A failed export only means
        that page is exported for each delivery instead."""
        with self._lock:
            room = self.kept_export_cap - d.kept
            want = pages[: max(0, room)]
            d.kept += len(want)
        fd = ctypes.c_int(-1)
        made = 0
        try:
            for page in want:
                self._drv.cuMemExportToShareableHandle(ctypes.byref(fd), page.native, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
                page.fd, page.ready = fd.value, True
                made += 1
        except cu.CudaDriverError as exc:  # the delivery's own export reports it, if it fails too
            log.debug("kept export on %s failed (%s); deliveries export instead", d.spec.uuid, exc)
        finally:
            if made < len(want):
                with self._lock:
                    d.kept -= len(want) - made

    def _export_into(self, pages: list[PageHandle], out: list[int]) -> None:
        fd = ctypes.c_int(-1)
        for page in pages[len(out):]:
            if page.fd >= 0:
                out.append(os.dup(page.fd))
                continue
            if page.native is None:
                raise errors.Internal("exporting a page that was already released")
            self._drv.cuMemExportToShareableHandle(ctypes.byref(fd), page.native, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            out.append(fd.value)

    # ---- the zeroing arena: every page mapped once, in the daemon ------------

    def _slots(self, d: _Device, n: int, size: int) -> list[int]:
        """Addresses of `n` free slots of `size` bytes (lowest first, so a
        batch's pages are mostly adjacent), reserving windows as needed."""
        out: list[int] = []
        for w in d.windows:
            while w.slot_size == size and w.free and len(out) < n:
                out.append(w.take())
        while len(out) < n:
            base = cu.CUdeviceptr()
            wsize = size * ARENA_WINDOW_PAGES
            try:
                self._drv.cuMemAddressReserve(ctypes.byref(base), wsize, d.spec.granularity, 0, 0)
            except BaseException:
                self._unslot(d, out, size)
                raise
            w = _Window(base.value, wsize, size, list(range(ARENA_WINDOW_PAGES)))
            d.windows.append(w)
            while w.free and len(out) < n:
                out.append(w.take())
        return out

    def _unslot(self, d: _Device, addrs: list[int], size: int) -> None:
        for addr in addrs:
            for w in d.windows:
                if w.slot_size == size and w.base <= addr < w.base + w.size:
                    w.give(addr)
                    break

    def _arena_map(self, d: _Device, pages: list[PageHandle]) -> None:
        """Map each page into a slot of its own and set access once per run
        of adjacent slots. On failure, what was mapped is unmapped again (the
        caller releases the pages)."""
        if not pages:
            return
        size = pages[0].size
        addrs = self._slots(d, len(pages), size)
        mapped: list[PageHandle] = []
        try:
            for page, addr in zip(pages, addrs):
                self._drv.cuMemMap(addr, page.size, 0, page.native, 0)
                page.addr = addr
                mapped.append(page)
            desc = cu.access_desc(d.spec.ordinal)
            for addr, length, _ in _runs(mapped):
                self._drv.cuMemSetAccess(addr, length, ctypes.byref(desc), 1)
        except BaseException:
            self._unslot(d, addrs[len(mapped):], size)
            self._arena_unmap(d, mapped)
            raise

    def _arena_unmap(self, d: _Device, pages: list[PageHandle]) -> BaseException | None:
        """Unmap the pages' slots (one call per run of adjacent slots; page
        by page when a run fails) and free them. A slot that does not unmap
        is kept out of use (`stuck`, retried at close). Returns the first error."""
        first: BaseException | None = None
        mapped = [p for p in pages if p.addr]
        for addr, length, run in _runs(mapped):
            try:
                self._drv.cuMemUnmap(addr, length)
                done = run
            except BaseException:
                done = []
                for p in run:
                    try:
                        self._drv.cuMemUnmap(p.addr, p.size)
                        done.append(p)
                    except BaseException as exc:
                        first = first or exc
                        d.stuck.append((p.addr, p.size))
            self._unslot(d, [p.addr for p in done], run[0].size)
        for p in mapped:
            p.addr = 0
        return first

    def _sync_objects(self, d: _Device) -> tuple[int, int]:
        """The zeroing stream and its event (made on first use, with the
        device's context current)."""
        with self._lock:
            if d.stream is not None and d.event is not None:
                return d.stream, d.event
            stream, event = cu.CUstream(), cu.CUevent()
            self._drv.cuStreamCreate(ctypes.byref(stream), cu.CU_STREAM_NON_BLOCKING)
            try:
                self._drv.cuEventCreate(ctypes.byref(event), cu.CU_EVENT_BLOCKING_SYNC | cu.CU_EVENT_DISABLE_TIMING)
            except BaseException:
                self._drv.cuStreamDestroy_v2(stream)
                raise
            d.stream, d.event = stream.value, event.value
            return d.stream, d.event

    def _free_sync_objects(self, d: _Device) -> None:
        """Destroy the zeroing event and stream; what fails to go is kept for
        close() to retry. Raises the first error after trying both."""
        first: BaseException | None = None
        with self._lock:
            if d.event is not None:
                try:
                    self._drv.cuEventDestroy_v2(d.event)
                    d.event = None
                except BaseException as exc:
                    first = exc
            if d.stream is not None:
                try:
                    self._drv.cuStreamDestroy_v2(d.stream)
                    d.stream = None
                except BaseException as exc:
                    first = first or exc
        if first is not None:
            raise first

    def _free_windows(self, d: _Device) -> None:
        """Free the arena's windows that have no page mapped (all of them at
        shutdown, once every page was released); retry stuck unmaps first."""
        drv = self._drv
        for addr, size in list(d.stuck):
            drv.cuMemUnmap(addr, size)
            d.stuck.remove((addr, size))
            self._unslot(d, [addr], size)
        keep = []
        for w in d.windows:
            if w.empty:
                drv.cuMemAddressFree(w.base, w.size)
            else:
                keep.append(w)
        d.windows = keep

    def _zero(self, d: _Device, pages: list[PageHandle]) -> None:
        """Zero pages through their arena slots: one asynchronous memset per
        run of adjacent slots on the zeroing stream, then one event, waited
        for (blocking sync: the thread sleeps)."""
        if not pages:
            return
        for p in pages:
            if not p.addr or p.native is None:
                raise errors.Internal("zeroing a page that is not mapped in the daemon (released?)")
        stream, event = self._sync_objects(d)
        for addr, length, _ in _runs(pages):
            self._drv.cuMemsetD8Async(addr, 0, length, stream)
        self._drv.cuEventRecord(event, stream)
        self._drv.cuEventSynchronize(event)

    def _release(self, d: _Device, pages: list[PageHandle]) -> BaseException | None:
        """Unmap, close the kept export, release the handle: every page, even
        if one fails; returns the first error."""
        first = self._arena_unmap(d, pages)
        for page in pages:
            if page.ready:
                page.ready = False
                with self._lock:
                    d.kept -= 1
            try:
                self._release_one(page)
            except BaseException as exc:
                first = first or exc
            if page.native is None:
                with self._lock:
                    d.live.pop(id(page), None)
        return first

    def _release_one(self, page: PageHandle) -> None:
        if page.fd >= 0:
            fd, page.fd = page.fd, -1
            os.close(fd)
        if page.native is not None:
            self._drv.cuMemRelease(page.native)
            page.native = None

    def _rollback(self, d: _Device, pages: list[PageHandle]) -> None:
        try:
            failed = self._release(d, pages)
        except BaseException as exc:  # the original error is the one to report
            failed = exc
        if failed is not None:
            log.error("rollback on %s could not release every page: %s", d.spec.uuid, failed)
            with self._lock:
                for page in pages:
                    if page.native is not None:
                        d.live[id(page)] = page  # close() tries again


def _runs(pages: list[PageHandle]):
    """(address, length, pages) for each run of pages whose arena slots are
    adjacent, in address order."""
    out = []
    for p in sorted(pages, key=lambda p: p.addr):
        if out and out[-1][0] + out[-1][1] == p.addr:
            addr, length, run = out[-1]
            run.append(p)
            out[-1] = (addr, length + p.size, run)
        else:
            out.append((p.addr, p.size, [p]))
    return out


def open_backend(libcuda: str | None = None) -> CudaBackend:
    """The daemon's entry point for `--backend cuda`.

    `libcuda` overrides $KVCACHED_LIBCUDA (default libcuda.so.1). Raises
    CudaUnavailable (an errors.FailedPrecondition) whose message says exactly
    why CUDA cannot be used: the library does not load, cuInit fails, there is
    no device, or a device fails a check (VMM, POSIX-fd export, granularity).
    """
    try:
        drv = cu.load(libcuda)
    except cu.DriverLoadError as exc:
        raise CudaUnavailable(str(exc)) from exc
    backend = CudaBackend(drv)
    for spec in backend.devices():
        log.info(
            "CUDA device %d: %s (%s), %d bytes, granularity %d",
            spec.ordinal, spec.uuid, spec.name, spec.total_bytes, spec.granularity,
        )
    return backend


def from_settings(settings) -> CudaBackend:
    """The registry's factory (backends/__init__.py): open_backend with the
    library $KVCACHED_LIBCUDA names (default libcuda.so.1); `kept_exports`
    (>= 0) caps the pages that keep an export, else the fd limit decides."""
    backend = open_backend()
    kept = getattr(settings, "kept_exports", -1)
    if kept >= 0:
        backend.kept_export_cap = kept
    return backend
