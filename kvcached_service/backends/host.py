"""Host backend: pages are sealed memfds.

Real pages with real fds: a client maps one with mmap(MAP_SHARED) and every
process that maps the same page sees the same bytes. This is what the daemon
runs on when no GPU is present, and what CPU-only llama.cpp hosts use.

Each memfd is sealed against shrinking and growing, so a client cannot
truncate a page under another mapping (which would SIGBUS it). Zeroing
punches a hole over the whole page: the kernel drops the memory and every
mapping reads zeros, without the daemon mapping the page at all. A page
nobody wrote is all hole already (lseek SEEK_DATA says so), and is not
punched again.

Each page is one memfd, so the daemon holds one open fd per page it tracks
(pooled or lent): a budget of N pages needs RLIMIT_NOFILE above N plus a few
hundred (the systemd unit sets LimitNOFILE=1048576; docs/architecture.md,
"File descriptors").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os

from .. import errors
from .base import Backend, DeviceSpec, PageHandle

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
# int fallocate(int fd, int mode, off_t offset, off_t len);
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int

HOST_UUID = "HOST-0"


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HostBackend(Backend):
    kind = "host"

    def __init__(self, total_bytes: int | None = None):
        total = total_bytes or _physical_memory()
        self._spec = DeviceSpec(
            uuid=HOST_UUID,
            name="host memory (memfd)",
            kind="host",
            ordinal=0,
            total_bytes=total,
            granularity=os.sysconf("SC_PAGE_SIZE"),
        )

    def devices(self) -> list[DeviceSpec]:
        return [self._spec]

    def memory_info(self, device: int) -> tuple[int, int]:
        """(free, total): free is the kernel's MemAvailable (memory that can
        be had without swapping), capped at the device size. memfd pages any
        process has written (pages of a previous daemon still mapped by its
        clients among them) are not available, as on a GPU."""
        total = self._spec.total_bytes
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return min(total, int(line.split()[1]) * 1024), total
        except OSError:
            pass
        return total, total

    def create_pages(self, device: int, count: int, page_size: int, zero: bool) -> list[PageHandle]:
        pages: list[PageHandle] = []
        try:
            for _ in range(count):
                pages.append(self._create_one(page_size))
        except OSError as exc:
            self.release_pages(device, pages)
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise errors.ResourceExhausted(
                    f"out of file descriptors after {len(pages)} of {count} pages (every page is one fd in the daemon; "
                    f"raise LimitNOFILE / ulimit -n): {exc.strerror}"
                ) from exc
            if exc.errno in (errno.ENOMEM, errno.ENOSPC):
                raise errors.ResourceExhausted(f"host memory exhausted: {exc.strerror}") from exc
            raise errors.Internal(f"memfd page creation failed: {exc}") from exc
        # memfd pages are zero when created: nothing to do for `zero`.
        return pages

    @staticmethod
    def _create_one(page_size: int) -> PageHandle:
        fd = os.memfd_create("kvcached-page", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, page_size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        return PageHandle(fd=fd, size=page_size)

    def zero_pages(self, device: int, pages: list[PageHandle]) -> None:
        for page in pages:
            if _libc.fallocate(page.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, page.size) != 0:
                err = ctypes.get_errno()
                raise errors.Internal(f"zeroing page (fallocate PUNCH_HOLE) failed: {os.strerror(err)}")

    def needs_zeroing(self, pages: list[PageHandle]) -> list[PageHandle]:
        """Pages with data in them. A memfd nobody wrote (or one already
        punched) is all hole and reads as zeros: lseek(SEEK_DATA) says so
        with ENXIO in one cheap syscall, so such pages skip the trip to the
        device worker. Anything else (or any doubt) is zeroed."""
        dirty = []
        for page in pages:
            try:
                os.lseek(page.fd, 0, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    continue  # no data at or after offset 0: all hole
            dirty.append(page)
        return dirty

    def adopt_pages(self, device: int, fds: list[int], page_size: int) -> list[PageHandle]:
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        try:
            for fd in fds:
                size = os.fstat(fd).st_size
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                if size != page_size or seals & want != want:
                    raise errors.PermissionDenied(f"a re-sent fd is not a sealed page of {page_size} bytes (size {size})")
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise errors.PermissionDenied(f"a re-sent fd is not a page: {exc.strerror}") from None
        except errors.KVCachedError:
            for fd in fds:
                os.close(fd)
            raise
        return [PageHandle(fd=fd, size=page_size) for fd in fds]

    def release_pages(self, device: int, pages: list[PageHandle]) -> None:
        first: OSError | None = None
        for page in pages:
            if page.fd < 0:
                continue
            try:
                os.close(page.fd)
            except OSError as exc:
                first = first or exc
            page.fd = -1
        if first is not None:
            raise errors.Internal(f"closing page fd failed: {first}")


def from_settings(settings) -> HostBackend:
    """The registry's factory (backends/__init__.py): `--host-memory`, or
    the physical RAM, as the device size."""
    from ..config import parse_size

    return HostBackend(parse_size(settings.host_memory) if settings.host_memory else None)
