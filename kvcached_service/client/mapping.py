"""How a client process maps daemon pages into its own address space.

A Mapper owns one kind of mapping (host memfd pages with mmap; CUDA pages
through the driver, in cuda_mapper.py). The client's Region and Session use
only this interface, so both backends behave the same above it.

Which Mapper maps a device is decided here and only here: a table of device
kind (the DeviceSpec.kind the daemon reports) -> mapper factory
(`mapper_for`). The CUDA mapper's module is imported the first time a CUDA
device is mapped, so a process that only maps host pages never loads it. A
new kind of device is a module with its Mapper and one `register_mapper`
line at the end of this file.
"""

from __future__ import annotations

import abc
import ctypes
import ctypes.util
import importlib
import mmap
import os
from typing import Callable

from .. import errors

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
# void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset);
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
# int munmap(void *addr, size_t length);
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_PROT_NONE = 0x0
_MAP_NORESERVE = 0x4000


class MappingError(OSError):
    pass


KEEP_HANDLES_ENV = "KVCACHED_KEEP_HANDLES"
KEEP_HANDLES_DEFAULT = 8192  # pages per session (16 GiB of 2 MiB pages)


def keep_handles_limit() -> int:
    """How many imported handles a session keeps (docs/protocol.md, "Kept
    handles"): KVCACHED_KEEP_HANDLES, default 8192; 0 keeps none."""
    raw = os.environ.get(KEEP_HANDLES_ENV, "")
    if not raw.strip():
        return KEEP_HANDLES_DEFAULT
    try:
        n = int(raw)
    except ValueError:
        raise errors.InvalidArgument(f"{KEEP_HANDLES_ENV}={raw!r} is not a number of pages") from None
    if n < 0:
        raise errors.InvalidArgument(f"{KEEP_HANDLES_ENV}={raw!r}: must be 0 or more pages")
    return n


def _check_mmap(addr: int | None, what: str) -> int:
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise MappingError(err, f"{what}: {os.strerror(err)}")
    return addr


class Mapper(abc.ABC):
    """Maps pages of one device kind into this process."""

    kind = "abstract"
    # unmap() may be given a run of adjacent pages at once (addr, n * page
    # size, token None): the host mapper puts one PROT_NONE mapping back over
    # the run (1,843 written 2 MiB pages: 9.5 ms against 19.3 ms page by page).
    unmaps_runs = False

    @abc.abstractmethod
    def reserve(self, size: int) -> int:
        """Reserve `size` bytes of address space (no memory); the base."""

    @abc.abstractmethod
    def release(self, base: int, size: int) -> None:
        """Give a reservation back (everything in it must be unmapped)."""

    @abc.abstractmethod
    def map(self, addr: int, fd: int, size: int) -> object:
        """Map the page behind `fd` at `addr` (inside a reservation) and close
        the fd. Returns a token that unmap() takes back."""

    def map_run(self, addr: int, fds: list[int], size: int, page_ids: list[int] | None = None) -> list[object]:
        """Map len(fds) pages of `size` bytes, fds[i] at addr + i * size, all
        or nothing; every fd is closed in every case. Their tokens, in order.
        Page by page here; a backend that pays per call rather than per byte
        overrides it (CUDA: one cuMemSetAccess for the run). `page_ids`
        names the pages, for a mapper that keeps handles."""
        tokens: list[object] = []
        try:
            for i, fd in enumerate(fds):
                tokens.append(self.map(addr + i * size, fd, size))
        except BaseException:
            for fd in fds[len(tokens) + 1:]:  # map() closed the one that failed
                try:
                    os.close(fd)
                except OSError:
                    pass
            for i, token in enumerate(tokens):
                try:
                    self.unmap(addr + i * size, size, token)
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise
        return tokens

    @abc.abstractmethod
    def unmap(self, addr: int, size: int, token: object) -> None:
        """Unmap a page mapped by map() (or, where unmaps_runs, a run of
        adjacent ones: token None); the range stays reserved."""

    @abc.abstractmethod
    def write(self, addr: int, data: bytes) -> None:
        """Copy bytes into mapped memory (tests, demos)."""

    @abc.abstractmethod
    def read(self, addr: int, size: int) -> bytes:
        """Copy bytes out of mapped memory (tests, demos)."""

    # ---- kept handles (docs/protocol.md, "Kept handles") -------------------
    # A mapper whose import of a page costs (CUDA) may keep the imported
    # handle of each page it mapped, by page id, and map a page that comes
    # back from it. The host mapper keeps nothing: a memfd's mmap costs the
    # same either way.
    def keep_handles(self, limit: int) -> None:
        """Keep up to `limit` imported handles from now on (the daemon
        honours FREE's keep flag)."""

    def keeps_any(self, page_ids: list[int]) -> bool:
        """Whether a handle of any of these pages is kept."""
        return False

    def drop_kept(self, page_ids: list[int] | None) -> None:
        """Release the kept handles of these pages (None: all)."""

    def view_device(self) -> str | None:
        """What views of the mapped bytes are (client/torch_views.py): "cpu"
        when this process's CPU reads them at the mapped address (a CPU
        tensor over it), "cuda:N" when they are device memory that the CUDA
        array interface describes, on this process's torch device cuda:N;
        None when no view can be made."""
        return None

    def close(self) -> None:
        pass


class HostMapper(Mapper):
    """memfd pages: reservations are PROT_NONE anonymous mappings; a page is
    mapped over its slot with MAP_FIXED|MAP_SHARED and unmapped by putting
    the PROT_NONE reservation back."""

    kind = "host"
    unmaps_runs = True

    def reserve(self, size: int) -> int:
        addr = _libc.mmap(None, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        return _check_mmap(addr, f"reserving {size} bytes of address space")

    def release(self, base: int, size: int) -> None:
        if _libc.munmap(base, size) != 0:
            err = ctypes.get_errno()
            raise MappingError(err, f"munmap: {os.strerror(err)}")

    def map(self, addr: int, fd: int, size: int) -> object:
        try:
            got = _libc.mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
            _check_mmap(got, "mapping a page")
        finally:
            os.close(fd)
        return None

    def unmap(self, addr: int, size: int, token: object) -> None:
        got = _libc.mmap(
            addr, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0
        )
        _check_mmap(got, "unmapping a page")

    def write(self, addr: int, data: bytes) -> None:
        ctypes.memmove(addr, data, len(data))

    def read(self, addr: int, size: int) -> bytes:
        return ctypes.string_at(addr, size)

    def view_device(self) -> str | None:
        return "cpu"


# ---- the table: device kind -> mapper ------------------------------------
MapperFactory = Callable[[str], Mapper]  # the device's UUID -> a Mapper for it

_MAPPERS: dict[str, MapperFactory] = {}


def register_mapper(kind: str, factory: MapperFactory) -> None:
    """Map devices of `kind` with `factory(device_uuid)` (adds or replaces)."""
    _MAPPERS[kind] = factory


def unregister_mapper(kind: str) -> None:
    """Drop a kind (tests that registered one)."""
    _MAPPERS.pop(kind, None)


def mapper_kinds() -> list[str]:
    return list(_MAPPERS)


def lazy_mapper(module: str, cls: str) -> MapperFactory:
    """A factory that imports `module` (relative to this package) on first
    use and makes `cls(device_uuid)`."""

    def factory(device_uuid: str) -> Mapper:
        return getattr(importlib.import_module(module, __package__), cls)(device_uuid)

    factory.__qualname__ = f"lazy_mapper({module!r}, {cls!r})"
    return factory


def mapper_for(kind: str, device_uuid: str) -> Mapper:
    """A new Mapper for the device `device_uuid`, whose pages are of `kind`.
    Raises FailedPrecondition for a kind this client has no mapper for."""
    factory = _MAPPERS.get(kind)
    if factory is None:
        raise errors.FailedPrecondition(f"device {device_uuid} has kind {kind!r}, which this client cannot map")
    return factory(device_uuid)


# One line per kind of device.
register_mapper("host", lambda device_uuid: HostMapper())
register_mapper("cuda", lazy_mapper(".cuda_mapper", "CudaMapper"))
