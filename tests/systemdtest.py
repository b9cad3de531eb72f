"""systemd's side of the file descriptor store, played for tests and the
resume bench (no systemd runs on the development machines): a datagram
NOTIFY_SOCKET that receives sd_notify messages and their fds over
SCM_RIGHTS (FDSTORE=1 with FDNAME, FDSTOREREMOVE=1), a store with
FileDescriptorStoreMax's limit, and the arguments of a start that passes the
stored fds from fd 3 on with LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES
(tests/listen_fds_exec.py)."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

SHIM = str(Path(__file__).with_name("listen_fds_exec.py"))


class FakeSystemd:
    """systemd's side of sd_notify's FDSTORE/FDSTOREREMOVE and of passing
    the store to the service at start."""

    def __init__(self, tmp_path: Path, capacity: int):
        self.path = str(tmp_path / "notify.sock")
        self.capacity = capacity
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.store: dict[str, list[int]] = {}  # FDNAME -> fds, as systemd keeps them
        self.refused = 0  # fds refused for want of room
        self.no_poll = 0  # FDSTORE messages that said FDPOLL=0
        self.lock = threading.Lock()
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, 253)
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in msg.decode().splitlines() if "=" in line)
            with self.lock:
                if fields.get("FDSTORE") == "1":
                    self.no_poll += fields.get("FDPOLL") == "0"
                    name = fields.get("FDNAME", "stored")
                    if sum(map(len, self.store.values())) + len(fds) > self.capacity:
                        self.refused += len(fds)  # systemd logs and closes them
                        for fd in fds:
                            os.close(fd)
                        continue
                    self.store.setdefault(name, []).extend(fds)
                    continue
                if fields.get("FDSTOREREMOVE") == "1":
                    for fd in self.store.pop(fields.get("FDNAME", ""), []):
                        os.close(fd)
                for fd in fds:  # fds with any other message are not kept
                    os.close(fd)

    def env(self) -> dict:
        return {"NOTIFY_SOCKET": self.path, "FDSTORE": str(self.capacity)}

    def names(self) -> set[str]:
        with self.lock:
            return set(self.store)

    def start_args(self) -> dict:
        """daemon_factory's wrap and pass_fds for a start that hands the
        store to the service (systemd's next start of the unit)."""
        with self.lock:
            pairs = [(name, fd) for name, fds in sorted(self.store.items()) for fd in fds]
        wrap = [sys.executable, SHIM] + [f"{n}={fd}" for n, fd in pairs] + ["--"]
        return {"wrap": wrap, "pass_fds": tuple(fd for _, fd in pairs)}

    def close(self) -> None:
        self.stopped = True
        self.sock.close()
        with self.lock:
            for fds in self.store.values():
                for fd in fds:
                    os.close(fd)
            self.store.clear()
