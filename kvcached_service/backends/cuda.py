"""CUDA backend: pages are VMM allocations exported as POSIX fds.

A page is one cuMemCreate allocation (pinned device memory, requestedHandleTypes
= CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). The daemon keeps only its
CUmemGenericAllocationHandle: each delivery sends a new fd
(cuMemExportToShareableHandle) and the daemon closes it once sent, so a
lent page holds no descriptor in the daemon (100k pages need no 100k fds;
docs/architecture.md, "File descriptors"). So that handing out a pooled
page makes no driver call on the event loop, the worker exports a *ready*
fd when it creates or zeroes a page (for at most ready_export_cap pages
per device); the delivery hands that one over. Clients import the fd and
map it into their own reservations (client/cuda_mapper.py). Zeroing maps
the handle, not an fd; release is cuMemRelease.

Pages a client re-sends after a daemon restart (adopt_pages) are imported;
the imported handle is exported again for later deliveries when the driver
allows it (checked once, on the first adoption), otherwise the client's fd
is kept for that page and duplicated for each delivery.

Threading: the pool calls every method of one device on that device's worker
thread. `worker_init` retains the device's primary context and makes it
current there; `worker_exit` frees the device's zeroing window and releases
the context. Calls made from any other thread (`memory_info` from a stats
path, `close` at shutdown) make the context current for their duration and
restore the thread's previous one.

Zeroing: fresh cuMemCreate memory is not guaranteed to be zero, and a page
going from one uid to another must be cleared. The daemon zeroes through its
own mapping: one reserved address window per device, pages mapped into it in
batches, cuMemSetAccess, cuMemsetD8_v2, cuCtxSynchronize, cuMemUnmap. That is
why the daemon holds a CUDA context at all (docs/cuda.md).

Every driver call goes through kvcached_service.cuda.driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field

from .. import errors
from ..cuda import driver as cu
from .base import Backend, DeviceSpec, PageHandle

log = logging.getLogger(__name__)

# Pages mapped into the zeroing window at once (one memset per batch).
ZERO_BATCH_PAGES = 32


class CudaUnavailable(errors.FailedPrecondition):
    """The CUDA backend cannot run here; the message says why."""


@dataclass
class _Device:
    spec: DeviceSpec
    ctx: int | None = None  # retained primary context (worker_init .. worker_exit)
    window: int = 0  # zeroing window base (0: none reserved)
    window_size: int = 0
    stuck: list = field(default_factory=list)  # (addr, size) the window failed to unmap
    live: dict = field(default_factory=dict)  # id(page) -> page, for close()
    ready: int = 0  # pages holding a ready export (under the backend's lock)


class CudaBackend(Backend):
    kind = "cuda"
    fds_per_page = 0
    fresh_exports = True
    # Pages of a device that may hold a ready export at once (see export_fds).
    ready_export_cap = 1024

    def __init__(self, driver: cu.Driver | None = None):
        self._drv = driver or cu.load()
        self._export_needs_ctx = False  # set if the driver refused an export without a current context
        self._reexport_imported: bool | None = None  # can an imported handle be exported again? (first adoption)
        self._lock = threading.Lock()
        self._tls = threading.local()  # .current: set of devices whose context this thread made current
        self._devices: list[_Device] = []
        self._closed = False
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

    def worker_init(self, device: int) -> None:
        d = self._dev(device)
        ctx = cu.CUcontext()
        self._drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d.spec.ordinal)
        try:
            self._drv.cuCtxSetCurrent(ctx)
        except BaseException:
            self._drv.cuDevicePrimaryCtxRelease_v2(d.spec.ordinal)
            raise
        d.ctx = ctx.value
        self._current_set().add(device)

    def worker_exit(self, device: int) -> None:
        d = self._dev(device)
        if d.ctx is None:
            return
        first: BaseException | None = None
        try:
            self._free_window(d)
        except BaseException as exc:  # keep going: the context must be released
            first = exc
        with contextlib.suppress(cu.CudaDriverError):
            self._drv.cuCtxSetCurrent(None)
        try:
            self._drv.cuDevicePrimaryCtxRelease_v2(d.spec.ordinal)
            d.ctx = None  # kept on failure: close() retries the release
        except cu.CudaDriverError as exc:
            first = first or exc
        self._current_set().discard(device)
        if first is not None:
            raise first

    def create_pages(self, device: int, count: int, page_size: int, zero: bool) -> list[PageHandle]:
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
                for i in range(count):
                    pages.append(self._create_one(d, prop, page_size, i, count))
                if zero:
                    self._zero(d, pages)
        except BaseException as exc:
            self._rollback(d, pages)
            if isinstance(exc, cu.CudaDriverError):
                raise exc.with_context(f"creating {count} page(s) of {page_size} bytes on {d.spec.uuid}") from None
            raise
        with self._lock:
            for page in pages:
                d.live[id(page)] = page
        self._make_ready(d, pages)
        return pages

    def adopt_pages(self, device: int, fds: list[int], page_size: int) -> list[PageHandle]:
        """Import each re-sent fd (the handle lets the daemon zero, export
        and release the page later). The fd is closed when the driver can
        export an imported handle again (checked on the first adoption);
        otherwise it is kept and duplicated for each later delivery."""
        d = self._dev(device)
        pages: list[PageHandle] = []
        try:
            with self._context(d):
                for i, fd in enumerate(fds):
                    handle = cu.CUmemGenericAllocationHandle()
                    self._drv.cuMemImportFromShareableHandle(
                        ctypes.byref(handle), ctypes.c_void_p(fd), cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                    )
                    pages.append(PageHandle(fd=fd, size=page_size, native=handle.value))
                if pages and self._reexport_imported is None:
                    self._reexport_imported = self._probe_reexport(pages[0])
        except BaseException as exc:
            self._rollback(d, pages)
            for fd in fds[len(pages):]:
                os.close(fd)
            if isinstance(exc, cu.CudaDriverError):
                raise exc.with_context(f"adopting {len(fds)} re-sent page(s) on {d.spec.uuid}") from None
            raise
        if self._reexport_imported:
            for page in pages:
                fd, page.fd = page.fd, -1
                os.close(fd)
        with self._lock:
            for page in pages:
                d.live[id(page)] = page
        return pages

    def _probe_reexport(self, page: PageHandle) -> bool:
        """Can the driver export an imported handle? (The documentation does
        not say; the test driver can.) One export, closed at once."""
        fd = ctypes.c_int(-1)
        try:
            self._drv.cuMemExportToShareableHandle(ctypes.byref(fd), page.native, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        except cu.CudaDriverError as exc:
            log.info("the driver does not export an imported handle again (%s): adopted pages keep their re-sent fd", exc.name)
            return False
        os.close(fd.value)
        return True

    def _make_ready(self, d: _Device, pages: list[PageHandle]) -> None:
        """On the worker, after creating or zeroing pages (they go to the
        pool next): export each one's fd for its next delivery, up to
        ready_export_cap per device, so that handing out a pooled page makes
        no driver call on the event loop. A failed export only means the
        delivery exports (on the worker) instead."""
        with self._lock:
            room = self.ready_export_cap - d.ready
            if room <= 0:
                return
            want = [p for p in pages if p.fd < 0 and p.native is not None][:room]
            d.ready += len(want)
        fd = ctypes.c_int(-1)
        made = 0
        try:
            for page in want:
                self._drv.cuMemExportToShareableHandle(ctypes.byref(fd), page.native, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
                page.fd = fd.value
                page.ready = True
                made += 1
        except (cu.CudaDriverError, OSError) as exc:
            log.debug("ready export on %s failed (%s); the delivery exports instead", d.spec.uuid, exc)
        finally:
            if made < len(want):
                with self._lock:
                    d.ready -= len(want) - made

    def exports_ready(self, pages: list[PageHandle]) -> bool:
        """Whether export_fds of these pages needs no driver call (each has
        a ready export, or an adopted page's kept fd to duplicate)."""
        return all(p.fd >= 0 for p in pages)

    def export_fds(self, device: int, pages: list[PageHandle]) -> list[int]:
        """A new fd for each page, which the caller closes once sent: the
        page's ready export (made on the worker when the page was created or
        zeroed; handed over, the page keeps none), a duplicate of the fd an
        adopted page kept, or an export of the page's handle. The pool calls
        it on the event loop only when exports_ready() (no driver call),
        otherwise on the device worker. (VMM calls need no current context;
        if the driver says otherwise, every later export makes it current.)"""
        d = self._dev(device)
        out: list[int] = []
        try:
            if self._export_needs_ctx and not self.exports_ready(pages):
                with self._context(d):
                    self._export_into(d, pages, out)
            else:
                try:
                    self._export_into(d, pages, out)
                except cu.CudaDriverError as exc:
                    if exc.name != "CUDA_ERROR_INVALID_CONTEXT":
                        raise
                    log.info("cuMemExportToShareableHandle needs a current context on this driver; exports make it current")
                    self._export_needs_ctx = True
                    with self._context(d):
                        self._export_into(d, pages, out)
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

    def _export_into(self, d: _Device, pages: list[PageHandle], out: list[int]) -> None:
        drv = self._drv
        fd = ctypes.c_int(-1)
        for page in pages[len(out):]:
            if page.ready:  # handed over: the page keeps none
                ready_fd, page.fd, page.ready = page.fd, -1, False
                with self._lock:
                    d.ready -= 1
                out.append(ready_fd)
                continue
            if page.fd >= 0:  # an adopted page's kept fd
                out.append(os.dup(page.fd))
                continue
            if page.native is None:
                raise errors.Internal("exporting a page that was already released")
            drv.cuMemExportToShareableHandle(ctypes.byref(fd), page.native, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            out.append(fd.value)

    def zero_pages(self, device: int, pages: list[PageHandle]) -> None:
        d = self._dev(device)
        try:
            with self._context(d):
                self._zero(d, pages)
        except cu.CudaDriverError as exc:
            raise exc.with_context(f"zeroing {len(pages)} page(s) on {d.spec.uuid}") from None
        self._make_ready(d, pages)

    def release_pages(self, device: int, pages: list[PageHandle]) -> None:
        d = self._dev(device)
        first: BaseException | None = None
        with self._context(d):
            for page in pages:
                if page.ready:
                    page.ready = False
                    with self._lock:
                        d.ready -= 1
                try:
                    self._release_one(page)
                except BaseException as exc:
                    first = first or exc
                if page.native is None:
                    with self._lock:
                        d.live.pop(id(page), None)
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
        """Release what is left: pages the pool did not release, zeroing
        windows of workers that did not exit. Raises the first error after
        trying everything."""
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
                if d.window or d.stuck:
                    with self._context(d, force=True):
                        self._free_window(d)
            except BaseException as exc:
                first = first or exc
            if d.ctx is not None:  # worker_exit could not release it
                try:
                    self._drv.cuDevicePrimaryCtxRelease_v2(d.spec.ordinal)
                    d.ctx = None
                except BaseException as exc:
                    first = first or exc
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

    def _create_one(self, d: _Device, prop, page_size: int, i: int, count: int) -> PageHandle:
        """One allocation; no fd is kept (export_fds makes one per delivery)."""
        handle = cu.CUmemGenericAllocationHandle()
        self._drv.cuMemCreate(ctypes.byref(handle), page_size, ctypes.byref(prop), 0)
        return PageHandle(fd=-1, size=page_size, native=handle.value)

    def _release_one(self, page: PageHandle) -> None:
        if page.fd >= 0:
            fd, page.fd = page.fd, -1
            os.close(fd)
        if page.native is not None:
            self._drv.cuMemRelease(page.native)
            page.native = None

    def _rollback(self, d: _Device, pages: list[PageHandle]) -> None:
        for page in pages:
            try:
                self._release_one(page)
            except BaseException as exc:  # the original error is the one to report
                log.error("rollback on %s could not release a page: %s", d.spec.uuid, exc)
                if page.native is not None:
                    with self._lock:
                        d.live[id(page)] = page  # close() tries again

    def _ensure_window(self, d: _Device, size: int) -> None:
        if d.window and d.window_size >= size:
            return
        self._free_window(d)
        want = max(size, d.spec.granularity * ZERO_BATCH_PAGES)
        want = -(-want // d.spec.granularity) * d.spec.granularity
        base = cu.CUdeviceptr()
        self._drv.cuMemAddressReserve(ctypes.byref(base), want, d.spec.granularity, 0, 0)
        d.window, d.window_size = base.value, want

    def _free_window(self, d: _Device) -> None:
        drv = self._drv
        for addr, size in list(d.stuck):
            drv.cuMemUnmap(addr, size)
            d.stuck.remove((addr, size))
        if d.window:
            drv.cuMemAddressFree(d.window, d.window_size)
            d.window, d.window_size = 0, 0

    def _zero(self, d: _Device, pages: list[PageHandle]) -> None:
        """Zero pages through the daemon's own mapping, a batch at a time."""
        if not pages:
            return
        if d.stuck:
            self._free_window(d)  # an earlier batch failed to unmap: retry first
        batch: list[PageHandle] = []
        batch_bytes = 0
        limit = max(max(p.size for p in pages), d.spec.granularity * ZERO_BATCH_PAGES)
        for page in pages:
            if batch and batch_bytes + page.size > limit:
                self._zero_batch(d, batch, batch_bytes)
                batch, batch_bytes = [], 0
            batch.append(page)
            batch_bytes += page.size
        self._zero_batch(d, batch, batch_bytes)

    def _zero_batch(self, d: _Device, batch: list[PageHandle], nbytes: int) -> None:
        drv = self._drv
        self._ensure_window(d, nbytes)
        mapped: list[tuple[int, int]] = []
        try:
            addr = d.window
            for page in batch:
                if page.native is None:
                    raise errors.Internal("zeroing a page that was already released")
                drv.cuMemMap(addr, page.size, 0, page.native, 0)
                mapped.append((addr, page.size))
                addr += page.size
            desc = cu.access_desc(d.spec.ordinal)
            drv.cuMemSetAccess(d.window, nbytes, ctypes.byref(desc), 1)
            drv.cuMemsetD8_v2(d.window, 0, nbytes)
            drv.cuCtxSynchronize()
        finally:
            first: BaseException | None = None
            for addr, size in mapped:
                try:
                    drv.cuMemUnmap(addr, size)
                except BaseException as exc:
                    d.stuck.append((addr, size))
                    first = first or exc
            if first is not None:
                # The window is unusable until those unmap; give it up.
                with contextlib.suppress(cu.CudaDriverError):
                    self._free_window(d)
                raise first


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
    library $KVCACHED_LIBCUDA names (default libcuda.so.1)."""
    return open_backend()
