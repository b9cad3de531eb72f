"""systemd's notify protocol (sd_notify(3)) for kvcached-serve, no libsystemd.

Under `Type=notify` systemd passes NOTIFY_SOCKET (a path, or "@name" for an
abstract socket); the daemon sends datagrams of newline-separated
assignments to it:

    READY=1          once the control socket serves (health SERVING)
    STATUS=...       a one-line summary, refreshed every few seconds
    WATCHDOG=1       every WATCHDOG_USEC/2 while the event loop is alive
                     (only when WATCHDOG_USEC is set, and WATCHDOG_PID, if
                     set, is this process)
    STOPPING=1       when shutdown begins

The pings come from a task on the daemon's event loop, so a stuck loop
stops pinging and systemd's watchdog restarts the daemon. Without
NOTIFY_SOCKET every call here is a no-op. What the daemon says (its
status line, when it is ready) is ops/systemd.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Callable

log = logging.getLogger("kvcached.sdnotify")

STATUS_INTERVAL = 5.0


def watchdog_seconds(env: dict | None = None) -> float | None:
    """WATCHDOG_USEC as seconds, if the watchdog is meant for this process."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 1e6


def notify_address(address: str) -> str:
    """NOTIFY_SOCKET as a socket address: a path, or "@name" for the
    abstract socket "\\0name"."""
    return "\0" + address[1:] if address.startswith("@") else address


class Notifier:
    """Sends sd_notify messages; silent when there is no NOTIFY_SOCKET."""

    def __init__(self, address: str | None):
        self.address = address
        self._sock: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._warned = False
        if address:
            self._path = notify_address(address)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls) -> "Notifier":
        return cls(os.environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *assignments: str) -> bool:
        if self._sock is None:
            return False
        msg = "\n".join(a.replace("\n", " ") for a in assignments).encode()
        try:
            self._sock.sendto(msg, self._path)
            return True
        except OSError as exc:
            if not self._warned:  # say it once, not every ping
                log.warning("sd_notify to %s failed: %s", self.address, exc)
                self._warned = True
            return False

    def start(self, status: Callable[[], str], watchdog: float | None = None) -> None:
        """READY=1 with the first STATUS, then a task that pings the watchdog
        at half its interval and refreshes STATUS. Call on the event loop."""
        if not self.enabled:
            return
        self.send("READY=1", "STATUS=" + _safe(status))
        self._task = asyncio.get_running_loop().create_task(self._run(status, watchdog))

    async def _run(self, status: Callable[[], str], watchdog: float | None) -> None:
        period = STATUS_INTERVAL if watchdog is None else min(STATUS_INTERVAL, watchdog / 2)
        next_status = 0.0
        loop = asyncio.get_running_loop()
        while True:
            msgs = []
            if watchdog is not None:
                msgs.append("WATCHDOG=1")
            if loop.time() >= next_status:
                msgs.append("STATUS=" + _safe(status))
                next_status = loop.time() + STATUS_INTERVAL
            if msgs:
                self.send(*msgs)
            await asyncio.sleep(period)

    def stopping(self, reason: str = "stopping") -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.send("STOPPING=1", "STATUS=" + reason)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _safe(status: Callable[[], str]) -> str:
    try:
        return status()
    except Exception as exc:  # noqa: BLE001 - a status line must never kill the daemon
        return f"serving (status unavailable: {type(exc).__name__})"
