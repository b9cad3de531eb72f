"""The interface every page backend implements.

A backend turns "N pages of this device" into physical allocations, each
exported as a file descriptor another process can map. It is chosen once at
start-up (`--backend host|cuda|auto`). The pool calls the methods of one
device on that device's worker threads (see server/core/worker.py): `zero_pages`
on the zeroer's, everything else on the device worker; `worker_init` runs
once on each, so a backend may keep thread-bound state there (the CUDA
backend makes the device's primary context current). No method but
`needs_zeroing` (cheap by contract) is ever called from the event loop; a
warm loan calls none: it sends the descriptor each page keeps
(`PageHandle.fd`).
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    """A device as the backend sees it."""

    uuid: str  # "GPU-xxxxxxxx-..." or "HOST-0"
    name: str
    kind: str  # "host" | "cuda": how clients map this device's pages
    ordinal: int  # the backend's own index (CUDA device ordinal in the daemon)
    total_bytes: int
    granularity: int  # page sizes must be a multiple of this


@dataclass(eq=False, slots=True)
class PageHandle:
    """One physical page. `fd` is a descriptor the backend keeps for it and
    closes in release_pages, and what a loan sends: the host backend's
    memfd, a CUDA page's export made once at creation; -1 when the backend
    keeps none (a CUDA page over the daemon's fd cap: export_fds makes one
    per delivery). Slotted: the daemon holds one per page (100k pages:
    docs/benchmarks.md, "Scale")."""

    fd: int
    size: int
    native: object = None  # backend-private: the CUDA allocation handle, ...
    ready: bool = False  # CUDA: `fd` is an export the backend keeps for the page's life (CudaBackend._keep_exports)
    addr: int = 0  # CUDA: the page's slot in the daemon's zeroing arena (0: not mapped there)


class Backend(abc.ABC):
    """A source of shareable physical pages."""

    kind: str = "abstract"
    # Open descriptors the daemon holds for each page it tracks (pooled or
    # lent). host: 1 (the memfd is the page); cuda: 1 (the page's export,
    # kept for its life, up to CudaBackend.kept_export_cap per device).
    # docs/architecture.md, "File descriptors".
    fds_per_page: int = 1
    # export_fds makes new descriptors (the caller closes them once sent)
    # rather than returning the pages' own.
    fresh_exports: bool = False

    @abc.abstractmethod
    def devices(self) -> list[DeviceSpec]:
        """The devices this backend serves, in a stable order."""

    def worker_init(self, device: int) -> None:
        """Called once on the device's worker thread before any other call."""

    def worker_exit(self, device: int) -> None:
        """Called once on the device's worker thread after the last call."""

    @abc.abstractmethod
    def create_pages(self, device: int, count: int, page_size: int, zero: bool) -> list[PageHandle]:
        """Create and export `count` pages. All or nothing: on failure every
        page made so far is released and the error is raised (an
        errors.ResourceExhausted when the device is out of memory, an
        errors.Internal naming the driver error otherwise). With `zero`, the
        pages read as zeros when this returns."""

    @abc.abstractmethod
    def zero_pages(self, device: int, pages: list[PageHandle]) -> None:
        """Make every page read as zeros (in every process that maps it)."""

    def export_fds(self, device: int, pages: list[PageHandle]) -> list[int]:
        """The descriptors to send for `pages`, in order. By default each
        page's own fd, which the backend keeps (the caller must not close
        it). With `fresh_exports`, new descriptors the caller owns and
        closes after sending; all or nothing (on failure none is left
        open). The pool calls it on the device worker, only for pages
        that keep no descriptor (a loan sends a kept one as it is) and for
        readers that want their own (the page store)."""
        return [p.fd for p in pages]

    def needs_zeroing(self, pages: list[PageHandle]) -> list[PageHandle]:
        """The pages among these that zero_pages must clear. The one method
        called on the event loop thread (when pages are freed): it must be
        cheap and never block. By default every page."""
        return pages

    @abc.abstractmethod
    def release_pages(self, device: int, pages: list[PageHandle]) -> None:
        """Close the exported fds and free the allocations. Memory stays
        alive while another process still references a page; the daemon
        forgets it either way. Must release every page even if one fails;
        raises the first error afterwards."""

    def identity(self, fd: int) -> str:
        """A stable name for the page behind an fd, the same in every
        process and for every fd of that page: the journal records it and a
        resume claim must match it. Both backends' fds are files, so the
        file's (device, inode) names the page."""
        st = os.fstat(fd)
        return f"{st.st_dev}:{st.st_ino}"

    @abc.abstractmethod
    def adopt_pages(self, device: int, fds: list[int], page_size: int) -> list[PageHandle]:
        """Take pages a client re-sent after a daemon restart back into the
        daemon's keeping (ownership of the fds passes to the backend). All
        or nothing: on failure nothing is kept and the fds are closed."""

    def memory_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of the device as the backend sees it."""
        spec = self.devices()[device]
        return spec.total_bytes, spec.total_bytes

    def close(self) -> None:
        """Release everything backend-wide (after every worker exited)."""
