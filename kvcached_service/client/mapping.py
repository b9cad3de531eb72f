"""How a client process maps daemon pages into its own address space.

A Mapper owns one kind of mapping (host memfd pages with mmap; CUDA pages
through the driver, in cuda_mapper.py). The client's Region and Session use
only this interface, so both backends behave the same above it.
"""

from __future__ import annotations

import abc
import ctypes
import ctypes.util
import mmap
import os

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
