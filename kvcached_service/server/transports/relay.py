"""The control socket's byte relay (relay.c), the one module that calls it.

relay.c is a small C library (built by the package's build as
`_relay.abi3.so` beside this file; no Python API in it, loaded with ctypes):
a thread that copies bytes both ways between pairs of connected sockets, so
that no byte of gRPC passes through Python. control.py hands it each
admitted connection with the socket it connected to grpcio; the relay owns
both from then on and reports each connection that ended.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from collections.abc import Iterator

# why a connection ended (relay.c's END_*)
ENDED_BY = ("client closed", "server closed", "error", "daemon stopping")

_LIB: ctypes.CDLL | None = None


class RelayUnavailable(RuntimeError):
    """relay.c's library is not built or cannot be loaded."""


def library_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_relay" + suffix)
        if os.path.exists(path):
            return path
    return None


def _lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        path = library_path()
        if path is None:
            raise RelayUnavailable(
                "the control socket's relay (kvcached_service/server/transports/relay.c) is not built: install the package "
                "(`pip install .`, or `pip install -e .` in a checkout; both need a C compiler) or build it in "
                "place with `python setup.py build_ext --inplace`")
        try:
            lib = ctypes.CDLL(path, use_errno=True)
        except OSError as exc:
            raise RelayUnavailable(f"cannot load the control socket's relay {path}: {exc}") from None
        lib.kvc_relay_new.argtypes = [ctypes.c_int]
        lib.kvc_relay_new.restype = ctypes.c_void_p
        lib.kvc_relay_add.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
        lib.kvc_relay_add.restype = ctypes.c_int
        lib.kvc_relay_reap.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.kvc_relay_reap.restype = ctypes.c_int
        lib.kvc_relay_count.argtypes = [ctypes.c_void_p]
        lib.kvc_relay_count.restype = ctypes.c_int
        lib.kvc_relay_stop.argtypes = [ctypes.c_void_p]
        lib.kvc_relay_stop.restype = None
        lib.kvc_relay_free.argtypes = [ctypes.c_void_p]
        lib.kvc_relay_free.restype = None
        _LIB = lib
    return _LIB


def check() -> None:
    """Raise RelayUnavailable unless the library is built and loads."""
    _lib()


class Relay:
    """One relay thread. `notify_fd` (an eventfd, or a pipe's write end) is
    written once per connection that ended: then call `ended()`."""

    _BATCH = 256

    def __init__(self, notify_fd: int):
        lib = _lib()
        handle = lib.kvc_relay_new(notify_fd)
        if not handle:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot start the control socket's relay: {os.strerror(err)}")
        self._lib = lib
        self._handle: int | None = handle
        self._ids = (ctypes.c_uint64 * self._BATCH)()
        self._why = (ctypes.c_int * self._BATCH)()

    def add(self, client_fd: int, server_fd: int, conn_id: int) -> None:
        """Relay between two connected stream sockets; the relay owns (and
        closes) both from now on, also when this raises."""
        if self._handle is None:
            os.close(client_fd)
            os.close(server_fd)
            raise OSError("the control socket's relay is stopped")
        if self._lib.kvc_relay_add(self._handle, client_fd, server_fd, conn_id) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def ended(self) -> Iterator[tuple[int, str]]:
        """(id, why) of each connection that ended since the last call."""
        while self._handle is not None:
            n = self._lib.kvc_relay_reap(self._handle, self._ids, self._why, self._BATCH)
            for i in range(n):
                yield self._ids[i], ENDED_BY[self._why[i]]
            if n < self._BATCH:
                return

    def count(self) -> int:
        return self._lib.kvc_relay_count(self._handle) if self._handle is not None else 0

    def close(self) -> list[tuple[int, str]]:
        """Close every connection and stop the thread: (id, why) of each
        connection that ended and was not reported yet."""
        if self._handle is None:
            return []
        self._lib.kvc_relay_stop(self._handle)  # joins the thread
        ended = list(self.ended())
        self._lib.kvc_relay_free(self._handle)
        self._handle = None
        return ended
