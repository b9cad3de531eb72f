"""kvcached-serve whose fd channel adapter profiles every record it reads
(tests/test_trip.py only; nothing in the package knows about it). The
test imports `recorder` from here for the client's side.

    python tests/helpers/traced_serve.py KVCACHED-SERVE-ARGS...

ChannelServer._read_one (the loop's read callback, one record per call) runs
under sys.setprofile (garbage collection off); each call into a file of the
kvcached_service package made while it runs is kept as [depth, file,
qualified name, caller's file, the package's files on the stack] (files
relative to the checkout). A record served within its callback (a warm
Allocate) is one JSON line of $KVCACHED_TRIP_LOG when the callback returns.
A record whose serving goes on after its callback (an Allocate that waits
for pages made on the device worker: a cold pool) stays traced, on the
loop thread and in every DeviceWorker call, until its REPLY is sent; then
its calls are one line.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import sys

import kvcached_service
from kvcached_service import fdchannel
from kvcached_service.server.transports import channel
from kvcached_service.server.core import worker
from kvcached_service.server.ops.main import main

PKG = os.path.dirname(kvcached_service.__file__) + os.sep  # only the package's files: not a .venv inside the checkout
TREE = os.path.dirname(os.path.dirname(kvcached_service.__file__)) + os.sep


_SUSPENDABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


def recorder(calls: list):
    """A sys.setprofile function that appends the package's calls to
    `calls`. A coroutine or generator resumed (the profiler says "call"
    again for the same frame) is no new call: left out."""
    started: set = set()  # frames of coroutines and generators already entered (kept alive: ids stay unique)

    def profile(frame, event, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PKG):
            return
        if frame.f_code.co_flags & _SUSPENDABLE:
            if frame in started:
                return
            started.add(frame)
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


class _Trace:
    """The trip being traced: its calls, whether its REPLY went out."""

    def __init__(self, log: str):
        self.log = log
        self.calls: list | None = None  # None: nothing traced now
        self.replied = False

    def start(self) -> None:
        self.calls, self.replied = [], False
        gc.disable()  # a collection's finalizers are no step of the trip
        sys.setprofile(recorder(self.calls))

    def end(self) -> None:
        sys.setprofile(None)
        gc.enable()
        with open(self.log, "a") as f:
            f.write(json.dumps(self.calls) + "\n")
        self.calls = None


def _traced(trace: _Trace):
    read_one = channel.ChannelServer._read_one

    def traced_read_one(self, conn):
        if trace.calls is not None:  # a trip still waiting for its pages: keep tracing
            return read_one(self, conn)
        trace.start()
        try:
            return read_one(self, conn)
        finally:
            if trace.replied or trace.calls is not None and not any(fn == "Daemon.lend" for _, _, fn, *_ in trace.calls):
                trace.end()  # served in this callback (or no Allocate): one line now

    send_record = fdchannel.send_record

    def traced_send_record(sock, data, fds=()):
        send_record(sock, data, fds)
        if trace.calls is not None and data[6:8] == _REPLY_TYPE:  # the trip's answer went out
            trace.replied = True
            if sys.getprofile() is not None and not _in_read_one():
                trace.end()  # a later callback sent it (a cold pool): the trip ends here

    call = worker.DeviceWorker.call

    async def traced_call(self, fn, *args):
        if trace.calls is None:
            return await call(self, fn, *args)
        calls = trace.calls

        def on_worker(*a):  # the worker thread's part of the trip, traced there
            sys.setprofile(recorder(calls))
            try:
                return fn(*a)
            finally:
                sys.setprofile(None)

        return await call(self, on_worker, *args)

    channel.ChannelServer._read_one = traced_read_one
    fdchannel.send_record = traced_send_record
    worker.DeviceWorker.call = traced_call


def _in_read_one() -> bool:
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "traced_read_one":
            return True
        f = f.f_back
    return False


_REPLY_TYPE = fdchannel.REPLY.to_bytes(2, "little")


if __name__ == "__main__":
    # before the server starts: ChannelServer registers self._read_one with the loop per channel
    _traced(_Trace(os.environ["KVCACHED_TRIP_LOG"]))
    sys.exit(main(sys.argv[1:]))
