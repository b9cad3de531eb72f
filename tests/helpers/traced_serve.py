"""kvcached-serve whose fd channel adapter profiles every record it reads
(tests/test_trip.py only; nothing in the package knows about it). The
test imports `recorder` from here for the client's side.

    python tests/helpers/traced_serve.py KVCACHED-SERVE-ARGS...

ChannelServer._read_one (the loop's read callback, one record per call) runs
under sys.setprofile (garbage collection off); each call into a file of the
kvcached_service package made while
it runs is kept as [depth, file, qualified name, caller's file] (files
relative to the checkout), and every callback's calls are appended to
$KVCACHED_TRIP_LOG as one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import kvcached_service
from kvcached_service.server import channel
from kvcached_service.server.main import main

PKG = os.path.dirname(kvcached_service.__file__) + os.sep  # only the package's files: not a .venv inside the checkout
TREE = os.path.dirname(os.path.dirname(kvcached_service.__file__)) + os.sep


def recorder(calls: list):
    """A sys.setprofile function that appends the package's calls to `calls`."""

    def profile(frame, event, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PKG):
            return
        # the package's files on the stack below this frame, nearest first:
        # the first is the caller (a frame of the standard library between
        # them, contextlib resuming a @contextmanager generator, is no step
        # of the trip); all of them tell an upcall
        depth, f, below = 0, frame.f_back, []
        while f is not None:
            depth += 1
            name = f.f_code.co_filename
            if name.startswith(PKG) and (not below or below[-1] != name[len(TREE):]):
                below.append(name[len(TREE):])
            f = f.f_back
        code = frame.f_code
        calls.append([depth + 1, code.co_filename[len(TREE):], getattr(code, "co_qualname", code.co_name),
                      below[0] if below else "", below])

    return profile


def _traced(read_one, log: str):
    def traced_read_one(self, conn):
        calls: list = []
        gc.disable()  # a collection's finalizers are no step of the trip
        sys.setprofile(recorder(calls))
        try:
            return read_one(self, conn)
        finally:
            sys.setprofile(None)
            gc.enable()
            with open(log, "a") as f:
                f.write(json.dumps(calls) + "\n")

    return traced_read_one


if __name__ == "__main__":
    # before the server starts: ChannelServer registers self._read_one with the loop per channel
    channel.ChannelServer._read_one = _traced(channel.ChannelServer._read_one, os.environ["KVCACHED_TRIP_LOG"])
    sys.exit(main(sys.argv[1:]))
