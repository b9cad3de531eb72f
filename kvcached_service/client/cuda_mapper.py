"""Client-side mapping of CUDA pages (fds from cuMemExportToShareableHandle).

The daemon names a device by UUID; this process may number it differently
(CUDA_VISIBLE_DEVICES), so the mapper finds its own ordinal for the UUID with
cuDeviceGetUuid_v2. Mapping a page: cuMemImportFromShareableHandle (the fd
passed by value), close the fd, cuMemMap at offset 0 into the reservation,
cuMemRelease the imported handle (the mapping keeps the memory alive), and
cuMemSetAccess READWRITE for this process's ordinal, once for each run of
adjacent pages mapped together (map_run). Unmapping is cuMemUnmap, once
for each run of adjacent pages unmapped together.

Kept handles (docs/protocol.md, "Kept handles"): when the daemon honours
FREE's keep flag, the mapper keeps the imported handle of each page it maps
(by page id, up to the session's limit) instead of releasing it, and maps a
page that comes back from its kept handle: no import, no release, the fd
that came with it closed. A DROP (or the session's end) releases them.

Every call runs with the device's primary context current (retained for the
mapper's lifetime); the calling thread's previous context is restored after.
Every driver call goes through kvcached_service.cuda.driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

from .. import errors
from ..cuda import driver as cu
from .mapping import Mapper


class CudaMapper(Mapper):
    kind = "cuda"
    unmaps_runs = True

    def __init__(self, device_uuid: str, driver: cu.Driver | None = None):
        self._drv = driver or cu.load()
        self.device_uuid = device_uuid
        self._drv.cuInit(0)
        self.ordinal = self._find_ordinal(device_uuid)
        ctx = cu.CUcontext()
        self._drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.ordinal)
        self._ctx = ctx.value
        self._lock = threading.Lock()
        self._reservations: dict[int, int] = {}  # base -> reserved size
        self._mappings: dict[int, int] = {}  # addr -> size
        self._kept: dict[int, int] = {}  # page id -> kept imported handle
        self._keep_limit = 0  # handles kept at most (keep_handles); 0: release after mapping
        self.kept_hits = 0  # pages mapped from a kept handle (no import)
        self._closed = False
        try:
            gran = ctypes.c_size_t()
            prop = cu.allocation_prop(self.ordinal)
            self._drv.cuMemGetAllocationGranularity(
                ctypes.byref(gran), ctypes.byref(prop), cu.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            )
            self.granularity = gran.value
        except BaseException:
            self._drv.cuDevicePrimaryCtxRelease_v2(self.ordinal)
            raise

    def _find_ordinal(self, uuid: str) -> int:
        drv = self._drv
        count = ctypes.c_int()
        drv.cuDeviceGetCount(ctypes.byref(count))
        seen = []
        for ordinal in range(count.value):
            dev = cu.CUdevice()
            drv.cuDeviceGet(ctypes.byref(dev), ordinal)
            u = cu.CUuuid()
            drv.cuDeviceGetUuid_v2(ctypes.byref(u), dev)
            got = cu.format_uuid(u)
            if got.lower() == uuid.lower():
                return ordinal
            seen.append(got)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise errors.NotFound(
            f"CUDA device {uuid} is not visible to this process (visible: {', '.join(seen) or 'none'}"
            + (f"; CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "")
            + ")"
        )

    @contextlib.contextmanager
    def _current(self):
        if self._closed:
            raise errors.FailedPrecondition("the CUDA mapper is closed")
        with self._drv.current(self._ctx):
            yield

    def _round(self, size: int) -> int:
        g = self.granularity
        return -(-size // g) * g

    # ------------------------------------------------------------------ Mapper

    def reserve(self, size: int) -> int:
        rounded = self._round(size)
        base = cu.CUdeviceptr()
        with self._current():
            self._drv.cuMemAddressReserve(ctypes.byref(base), rounded, self.granularity, 0, 0)
        with self._lock:
            self._reservations[base.value] = rounded
        return base.value

    def release(self, base: int, size: int) -> None:
        with self._lock:
            rounded = self._reservations.get(base, self._round(size))
        with self._current():
            self._drv.cuMemAddressFree(base, rounded)
        with self._lock:
            self._reservations.pop(base, None)

    def map(self, addr: int, fd: int, size: int) -> object:
        return self.map_run(addr, [fd], size)[0]

    def map_run(self, addr: int, fds: list[int], size: int, page_ids: list[int] | None = None) -> list[object]:
        """Import and map each page (or map its kept handle), then one
        cuMemSetAccess over the run (the driver sets access on a fully
        mapped range of several mappings: one call instead of one per page,
        25 us p50 each on an H200): one call into the driver binding
        (`Driver.map_run`). All or nothing; every fd is closed in every
        case. The handles imported are kept (by page id, up to the limit)
        or released."""
        if not fds:
            return []
        if self._closed:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise errors.FailedPrecondition("the CUDA mapper is closed")
        with self._lock:
            kept = [self._kept.get(pid) for pid in page_ids] if page_ids is not None and self._kept else [None] * len(fds)
        imported = self._drv.map_run(self._ctx, self.ordinal, addr, size, fds, kept)
        fresh = [i for i, h in enumerate(kept) if h is None]  # the pages imported now
        self.kept_hits += len(fds) - len(fresh)
        loose = [imported[i] for i in fresh if page_ids is None or not self._keep(page_ids[i], imported[i])]
        if loose:  # the mapping keeps the memory; a handle not kept is not needed
            with contextlib.suppress(cu.CudaDriverError):
                self._drv.release(self._ctx, loose)
        with self._lock:
            for i in range(len(fds)):
                self._mappings[addr + i * size] = size
        return [None] * len(fds)

    def unmap(self, addr: int, size: int, token: object) -> None:
        """Unmap one page, or a run of adjacent ones with one cuMemUnmap
        (the driver unmaps a range made of several whole mappings in one
        call, as it sets access over one; 17-21 us p50 per call on an H200)."""
        with self._current():
            self._drv.cuMemUnmap(addr, size)
        with self._lock:
            end = addr + size
            while addr < end:
                step = self._mappings.pop(addr, None)
                if step is None:
                    break
                addr += step

    # ---- kept handles ---------------------------------------------------
    def _keep(self, page_id: int, handle: int) -> bool:
        with self._lock:
            if len(self._kept) >= self._keep_limit or page_id in self._kept:
                return False
            self._kept[page_id] = handle
            return True

    def keep_handles(self, limit: int) -> None:
        with self._lock:
            self._keep_limit = max(0, limit)

    def keeps_any(self, page_ids: list[int]) -> bool:
        with self._lock:
            kept = self._kept
            return bool(kept) and any(pid in kept for pid in page_ids)

    @property
    def kept(self) -> int:
        """Handles kept now."""
        return len(self._kept)

    def drop_kept(self, page_ids: list[int] | None) -> None:
        """Release the kept handles of these pages (None: all). A page mapped
        now stays mapped: its mapping keeps the memory, not the handle."""
        with self._lock:
            if page_ids is None:
                handles = list(self._kept.values())
                self._kept.clear()
            else:
                handles = [h for h in (self._kept.pop(pid, None) for pid in page_ids) if h is not None]
        if not handles or self._closed:
            return
        first: BaseException | None = None
        with self._current():
            for h in handles:
                try:
                    self._drv.cuMemRelease(h)
                except cu.CudaDriverError as exc:
                    first = first or exc
        if first is not None:
            raise first

    def write(self, addr: int, data: bytes) -> None:
        """Copy `data` to a mapped address. Complete when it returns: from
        pageable host memory cuMemcpyHtoD may return before the DMA lands,
        so it synchronizes (another process may read the page next)."""
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        with self._current():
            self._drv.cuMemcpyHtoD_v2(addr, buf, len(data))
            self._drv.cuCtxSynchronize()

    def read(self, addr: int, size: int) -> bytes:
        buf = ctypes.create_string_buffer(size)
        with self._current():
            self._drv.cuMemcpyDtoH_v2(buf, addr, size)
        return buf.raw

    def memset(self, addr: int, value: int, size: int) -> None:
        """Set `size` bytes at a mapped address (clearing a mapped range)."""
        with self._current():
            self._drv.cuMemsetD8_v2(addr, value, size)
            self._drv.cuCtxSynchronize()

    def view_device(self) -> str | None:
        """Device memory of this process's ordinal for the daemon's device."""
        return f"cuda:{self.ordinal}"

    def close(self) -> None:
        """Unmap what is still mapped, free every reservation, release the
        primary context. Raises the first error after trying everything."""
        if self._closed:
            return
        first: BaseException | None = None
        with self._lock:
            mappings = list(self._mappings.items())
            reservations = list(self._reservations.items())
        for addr, size in mappings:
            try:
                self.unmap(addr, size, None)
            except BaseException as exc:
                first = first or exc
        for base, size in reservations:
            try:
                self.release(base, size)
            except BaseException as exc:
                first = first or exc
        try:
            self.drop_kept(None)
        except BaseException as exc:
            first = first or exc
        self._closed = True
        try:
            self._drv.cuDevicePrimaryCtxRelease_v2(self.ordinal)
        except BaseException as exc:
            first = first or exc
        if first is not None:
            raise first
