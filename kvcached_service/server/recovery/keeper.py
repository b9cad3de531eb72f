"""The page store: the daemon's own fd of every page it lends, kept by a
process that outlives the daemon, so a restarted daemon resumes sessions
from its own fds instead of comparing the fds clients re-send (docs/cuda.md,
"Page identity", step 1).

On a driver whose exported fds all share one fstat identity (NVIDIA's, seen
on an H200: every export is an fd on /dev/nvidiactl), a re-sent fd cannot
prove which page it is, so resumes with pages were refused. With the store
the client only names its page ids (with its resume token, as before); the
daemon takes those pages' fds from the store and imports them. The page's
memory stays alive meanwhile because the keeper holds a reference to it.

Two halves, one module (this module owns the store's boundary):

- the keeper: `python -m kvcached_service.server.recovery.keeper --state-dir DIR
  --grace S`, started by the daemon in its own session (setsid). It listens
  on `DIR/keeper.sock` (the state dir is 0700: only the daemon's uid and root
  reach it; a peer of another uid is refused by SO_PEERCRED too), holds
  page id -> fd, and serves one daemon at a time: PUT (ids with their fds),
  DROP (ids), TAKE (every id and a duplicate of its fd, in batches), CLEAR
  (a clean shutdown). It raises its soft RLIMIT_NOFILE to the hard limit.
  With no daemon connected it waits `grace` seconds for one (a restart),
  then exits, closing its fds; with no daemon and an empty store it exits
  at once.
- `PageStore`: the daemon's side. `open` connects to the keeper serving the
  state dir or starts one; every call is synchronous and short (the keeper
  only moves fds between tables). A keeper that goes away makes the store
  unavailable (logged once); the daemon serves on without it.

Records: one SOCK_SEQPACKET message each, a JSON object plus up to
`BATCH` fds (SCM_RIGHTS).

Format: what the store holds is page id -> fd, format STORE_FORMAT (1). The
keeper says its format in every `pages` reply (a keeper without the field
is format 1); systemd's store says it in the names (`~<id in base 64>` is
format 1; a later format will name pages `~<format>.<...>`). A store of a
format this daemon does not read (`StoreTooNew`) stops the daemon's start
with one line and takes nothing out of the store, so the newer daemon that
filled it can still resume from it.

- `SystemdStore`: the same store in systemd's own file descriptor store, for
  the daemon run as a unit (systemd ends every process of the unit's
  cgroup when the daemon dies, a keeper too). A page's fd is sent with
  sd_notify `FDSTORE=1`, `FDNAME=~<id in base 64>`, `FDPOLL=0` (systemd must
  not drop an fd it cannot poll: a GPU driver's device fd), removed with
  `FDSTOREREMOVE=1`; the next daemon of the unit gets them back at start as
  `LISTEN_FDS`/`LISTEN_FDNAMES` (sd_listen_fds(3)). Needs
  `FileDescriptorStoreMax=` in the unit (systemd 254+ says how many in
  `$FDSTORE`); `FileDescriptorStorePreserve=restart` keeps it across
  `systemctl restart` too. Chosen by `--page-store auto` when `$FDSTORE`
  and `$NOTIFY_SOCKET` are set.
"""

from __future__ import annotations

import argparse
import array
import json
import logging
import os
import resource
import select
import selectors
import socket
import subprocess
import sys
import time

from ...fdchannel import close_fds, peer_credentials
from ..host.sdnotify import notify_address

log = logging.getLogger("kvcached.keeper")

SOCK = "keeper.sock"
STORE_FORMAT = 1  # the store's format (module docstring); STORE_READS: the ones this daemon reads
STORE_READS = (1,)
BATCH = 250  # fds per record (the kernel's SCM_MAX_FD is 253)
MAX_MSG = 64 << 10
START_WAIT = 5.0  # seconds a new keeper waits for its first daemon


def _send(sock: socket.socket, obj: dict, fds: list[int] | tuple = ()) -> None:
    socket.send_fds(sock, [json.dumps(obj, separators=(",", ":")).encode()], list(fds))


def _recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MSG, BATCH)
    if not data:
        close_fds(fds)
        return None, []
    return decode(data, fds), fds


def decode(data: bytes, fds: list[int]) -> dict:
    """One record's JSON object; ValueError (its fds closed) for anything
    else, also JSON nested too deep for the parser (64 KiB of "[")."""
    try:
        try:
            obj = json.loads(data)
        except RecursionError:
            raise ValueError("JSON nested too deep") from None
        if not isinstance(obj, dict):
            raise ValueError("not an object")
    except ValueError:
        close_fds(fds)
        raise
    return obj


def _page_ids(v) -> list[int] | None:
    """A record's "ids": a list of page ids (integers, 0 to 2^64-1), else None."""
    if isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 64 for i in v):
        return v
    return None


# ---- the keeper process -----------------------------------------------------------------
class Keeper:
    def __init__(self, state_dir: str, grace: float):
        self.path = os.path.join(state_dir, SOCK)
        self.grace = grace
        self.store: dict[int, int] = {}
        self.daemon: socket.socket | None = None
        self.alone_since = time.monotonic()
        self.seen_daemon = False

    def serve(self) -> int:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(self.path)
            log.info("a keeper already serves %s", self.path)
            return 0
        except OSError:
            pass
        finally:
            probe.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            lsock.bind(self.path)
        finally:
            os.umask(old)
        lsock.listen(4)
        sel = selectors.DefaultSelector()
        sel.register(lsock, selectors.EVENT_READ)
        log.info("keeper pid %d on %s (open files up to %d)", os.getpid(), self.path,
                 resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        try:
            while True:
                timeout = None
                if self.daemon is None:
                    wait = self.grace if (self.store or not self.seen_daemon) else 0.0
                    if not self.seen_daemon:
                        wait = max(wait, START_WAIT) if self.store else START_WAIT
                    left = self.alone_since + wait - time.monotonic()
                    if left <= 0:
                        log.info("no daemon for %.0f s: exiting, %d page fds closed", wait, len(self.store))
                        return 0
                    timeout = left
                for key, _ in sel.select(timeout):
                    if key.fileobj is lsock:
                        self._accept(lsock, sel)
                    else:
                        self._serve_one(sel)
        finally:
            close_fds(self.store.values())
            self.store.clear()
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _accept(self, lsock: socket.socket, sel) -> None:
        conn, _ = lsock.accept()
        _pid, uid, _gid = peer_credentials(conn)
        if uid not in (os.getuid(), 0):
            log.warning("refused a connection from uid %d", uid)
            conn.close()
            return
        if self.daemon is not None:  # a new daemon: the old one is gone (or about to be)
            sel.unregister(self.daemon)
            self.daemon.close()
        self.daemon = conn
        self.seen_daemon = True
        sel.register(conn, selectors.EVENT_READ)

    def _serve_one(self, sel) -> None:
        conn = self.daemon
        try:
            msg, fds = _recv(conn)
        except (OSError, ValueError) as exc:
            log.warning("daemon connection: %s", exc)
            msg, fds = None, []
        if msg is None:
            sel.unregister(conn)
            conn.close()
            self.daemon = None
            self.alone_since = time.monotonic()
            if self.store:
                log.info("daemon gone: holding %d page fds for %.0f s", len(self.store), self.grace)
            return
        self.handle(conn, msg, fds)

    def handle(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        """One record from the daemon (its fds are the keeper's now: stored
        or closed). A record of the wrong shape is logged and ignored."""
        op, ids = msg.get("op"), _page_ids(msg.get("ids", []))
        if ids is None:
            log.warning("ignored a record whose ids are not page ids: %.80s with %d fds", msg, len(fds))
            close_fds(fds)
        elif op == "put" and len(ids) == len(fds):
            for pid, fd in zip(ids, fds):
                old = self.store.pop(pid, None)
                if old is not None:
                    close_fds([old])
                self.store[pid] = fd
        elif op == "drop":
            close_fds([self.store.pop(pid) for pid in ids if pid in self.store])
            close_fds(fds)
        elif op == "take":
            close_fds(fds)
            items = sorted(self.store.items())
            for i in range(0, max(len(items), 1), BATCH):
                chunk = items[i:i + BATCH]
                _send(conn, {"op": "pages", "format": STORE_FORMAT, "ids": [p for p, _ in chunk],
                             "last": i + BATCH >= len(items)}, [fd for _, fd in chunk])
        elif op == "clear":
            close_fds(self.store.values())
            self.store.clear()
            close_fds(fds)
        else:
            log.warning("ignored a record: %.80s with %d fds", msg, len(fds))
            close_fds(fds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="kvcached page store keeper (started by kvcached-serve)")
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--grace", type=float, required=True)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return Keeper(ns.state_dir, ns.grace).serve()


# ---- the daemon's side ------------------------------------------------------------------
class StoreUnavailable(Exception):
    pass


class StoreTooNew(Exception):
    """The page store holds pages in a format this daemon does not read."""

    def __init__(self, where: str, fmt: object):
        self.format = fmt
        super().__init__(
            f"the page store ({where}) is format {fmt!r:.40}, written by a newer kvcached; this daemon reads format "
            f"{STORE_READS[-1]}. Nothing was taken out of it: start the newer daemon again to resume its sessions"
        )


def take_reply(msg: dict, fds: list[int], out: dict[int, int], where: str = "the keeper") -> bool:
    """One `pages` record of the keeper's answer to TAKE, added to `out`
    ({id: fd}); True when it was the last. Its fds are the caller's: in
    `out`, or closed when the record is refused (ValueError: not the pages
    it says; StoreTooNew: a format this daemon does not read, the keeper
    keeping its own fds)."""
    fmt = msg.get("format", 1)
    if isinstance(fmt, bool) or fmt not in STORE_READS:
        close_fds(fds)
        raise StoreTooNew(where, fmt)
    ids = _page_ids(msg.get("ids"))
    if msg.get("op") != "pages" or ids is None or len(ids) != len(fds) or len(set(ids)) != len(ids) or set(ids) & out.keys():
        close_fds(fds)
        raise ValueError(f"not a pages record: {json.dumps(msg)[:80]} with {len(fds)} fds")
    out.update(zip(ids, fds))
    return bool(msg.get("last"))


class PageStore:
    """The daemon's connection to its keeper."""

    def __init__(self, sock: socket.socket, path: str):
        self._sock = sock
        self.path = path
        self.available = True

    @classmethod
    def open(cls, state_dir: str, grace: float, python: str = sys.executable) -> "PageStore":
        """Connect to the keeper of `state_dir`, starting one when none serves."""
        path = os.path.join(state_dir, SOCK)
        sock = cls._connect(path)
        if sock is None:
            with open(os.path.join(state_dir, "keeper.log"), "ab") as logf:
                subprocess.Popen([python, "-m", "kvcached_service.server.recovery.keeper", "--state-dir", state_dir, "--grace", str(grace)],
                                 stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True, close_fds=True,
                                 )
            deadline = time.monotonic() + 10
            while sock is None and time.monotonic() < deadline:
                time.sleep(0.02)
                sock = cls._connect(path)
            if sock is None:
                raise StoreUnavailable(f"the keeper did not start (see {os.path.join(state_dir, 'keeper.log')})")
        sock.settimeout(5.0)
        return cls(sock, path)

    @staticmethod
    def _connect(path: str) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            s.connect(path)
            return s
        except OSError:
            s.close()
            return None

    def take_all(self) -> dict[int, int]:
        """Every page id the store holds, with a duplicate of its fd (the
        keeper keeps its own). Ours to close."""
        out: dict[int, int] = {}
        try:
            _send(self._sock, {"op": "take"})
            while True:
                msg, fds = _recv(self._sock)
                if msg is None:
                    raise StoreUnavailable("the keeper closed the connection")
                try:
                    last = take_reply(msg, fds, out, f"the keeper of {self.path}")
                except StoreTooNew:
                    close_fds(out.values())
                    raise
                if last:
                    return out
        except (OSError, ValueError, StoreUnavailable) as exc:
            close_fds(out.values())
            self._lost(exc)
            return {}

    def put(self, ids: list[int], fds: list[int]) -> None:
        """The store keeps its own copy of each fd (the caller keeps its fds)."""
        for i in range(0, len(ids), BATCH):
            self._call({"op": "put", "ids": ids[i:i + BATCH]}, fds[i:i + BATCH])

    def drop(self, ids) -> None:
        ids = list(ids)
        for i in range(0, len(ids), 4096):
            self._call({"op": "drop", "ids": ids[i:i + 4096]})

    def clear(self) -> None:
        self._call({"op": "clear"})

    def check(self) -> bool:
        """Whether the keeper is still there (it sends nothing unasked: a
        hang-up or anything readable means it went away)."""
        if self.available:
            p = select.poll()
            p.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            if p.poll(0):
                self._lost(ConnectionResetError("the keeper hung up"))
        return self.available

    def close(self) -> None:
        self.available = False
        self._sock.close()

    def _call(self, obj: dict, fds=()) -> None:
        if not self.available:
            return
        try:
            _send(self._sock, obj, fds)
        except OSError as exc:
            self._lost(exc)

    def _lost(self, exc: Exception) -> None:
        if self.available:
            log.error("page store: the keeper at %s is gone (%s); pages lent from now on cannot be resumed from the store "
                      "after a restart (clients' re-sent fds are checked instead, docs/cuda.md \"Page identity\")", self.path, exc)
        self.available = False
        try:
            self._sock.close()
        except OSError:
            pass


# ---- systemd's file descriptor store ----------------------------------------------
LISTEN_FDS_START = 3
# LISTEN_FDNAMES is one environment string, "name:name:...", one name per fd,
# and the kernel refuses an exec with a string over 128 KiB (MAX_ARG_STRLEN):
# a store whose names do not fit would stop the unit from starting at all.
# Names are therefore short ("~" and the page id in base 64, 4-5 bytes) and
# the daemon stores no page whose name would not fit.
FDNAMES_BUDGET = 131072 - len("LISTEN_FDNAMES=") - 1 - 64
_B64 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz-_"
_B64_VALUE = {ch: i for i, ch in enumerate(_B64)}


def fdname(page_id: int) -> str:
    """The fd store name of a page: "~" and its id in base 64 ("~1F")."""
    digits = ""
    while True:
        page_id, r = divmod(page_id, 64)
        digits = _B64[r] + digits
        if page_id == 0:
            return "~" + digits


_MAX_NAME = 1 + 11  # "~" and a u64 in base 64 (64^11 = 2^66)


def page_of(name: str) -> int | None:
    """The page id of an fd store name, or None for a name that is not one
    (also a name longer than any page's, or naming an id beyond 2^64-1:
    systemd hands back whatever names it holds, up to 128 KiB of them)."""
    if not 2 <= len(name) <= _MAX_NAME or name[0] != "~" or any(ch not in _B64_VALUE for ch in name[1:]):
        return None
    n = 0
    for ch in name[1:]:
        n = n * 64 + _B64_VALUE[ch]
    return n if n < 1 << 64 else None


def store_format_of(name: str) -> int | None:
    """The store format an fd store name was written in: 1 for `~<id>`, N for
    `~N.<...>` (a later format), None for a name that is not a page's."""
    if page_of(name) is not None:
        return 1
    if name.startswith("~") and "." in name:
        head = name[1:].split(".", 1)[0]
        if head.isascii() and head.isdigit() and len(head) <= 6:  # int() takes other scripts' digits too
            return int(head)
    return None


def listen_fds(env: dict | None = None, pid: int | None = None) -> list[tuple[str, int]]:
    """The fds systemd passed this process at start (sd_listen_fds(3)):
    [(name, fd)], fds from 3 on, made close-on-exec. Empty unless LISTEN_PID
    is this process. The LISTEN_* variables are removed from os.environ (as
    sd_listen_fds(unset_environment=1)) so that no child takes them."""
    env = os.environ if env is None else env
    pid = os.getpid() if pid is None else pid
    try:
        if int(env.get("LISTEN_PID", "0")) != pid:
            return []
        n = int(env.get("LISTEN_FDS", "0"))
    except ValueError:  # sd_listen_fds unsets them on this failure too
        n = 0
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(var, None)
    # no fd can be numbered at or above the hard open-file limit (fs.nr_open
    # caps it): LISTEN_FDS=99999999999 is not a minute of failed syscalls
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    n = min(n, (1 << 20 if hard == resource.RLIM_INFINITY else hard) - LISTEN_FDS_START)
    out = []
    for i in range(max(0, n)):
        fd = LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue  # not open after all
        out.append((names[i] if i < len(names) else "unknown", fd))
    return out


class SystemdStore:
    """The daemon's side of systemd's fd store: the same calls as PageStore
    (take_all, put, drop, clear, close, available). `capacity` is the unit's
    FileDescriptorStoreMax= ($FDSTORE), None when systemd did not say
    (before 254): pages beyond it are not stored (said once)."""

    def __init__(self, address: str, capacity: int | None, inherited: list[tuple[str, int]]):
        self.path = address
        self._addr = notify_address(address)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.capacity = capacity
        self.available = True
        self._inherited = inherited
        self._stored: set[int] = set()  # page ids in systemd's store
        self._name_bytes = 0  # their names' share of LISTEN_FDNAMES at the next start
        self._full_said = False

    @classmethod
    def from_env(cls, env: dict | None = None) -> "SystemdStore":
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET")
        if not address:
            raise StoreUnavailable("--page-store systemd needs NOTIFY_SOCKET (the daemon run as a Type=notify unit)")
        cap = env.get("FDSTORE", "")
        return cls(address, int(cap) if cap.isdigit() else None, listen_fds(env))

    @staticmethod
    def wanted(env: dict | None = None) -> bool:
        """--page-store auto: systemd's store when the unit has one."""
        env = os.environ if env is None else env
        return bool(env.get("NOTIFY_SOCKET")) and env.get("FDSTORE", "0").isdigit() and int(env.get("FDSTORE", "0")) > 0

    def take_all(self) -> dict[int, int]:
        """The pages systemd handed back at start, {id: fd} (ours to close;
        systemd keeps its own until drop). Anything else it passed is
        closed: this daemon stores nothing but pages."""
        out: dict[int, int] = {}
        others = 0
        for name, _fd in self._inherited:
            fmt = store_format_of(name)
            if fmt is not None and fmt not in STORE_READS:  # systemd keeps its copies: nothing is lost
                raise StoreTooNew("systemd's fd store", fmt)
        for name, fd in self._inherited:
            pid = page_of(name)
            if pid is not None and pid not in out:
                out[pid] = fd
            else:
                os.close(fd)
                others += 1
        self._inherited = []
        if others:
            log.warning("page store: systemd passed %d fd(s) that are not pages of this daemon: closed", others)
        self._stored = set(out)
        self._name_bytes = sum(len(fdname(pid)) + 1 for pid in out)
        return out

    def _full(self, pid: int) -> str | None:
        """Why page `pid` cannot be stored now (None: it can)."""
        if self.capacity is not None and len(self._stored) >= self.capacity:
            return f"systemd's fd store is full (FileDescriptorStoreMax={self.capacity}); raise it to the budget's pages"
        if self._name_bytes + len(fdname(pid)) + 1 > FDNAMES_BUDGET:
            return (f"systemd could not hand more than {len(self._stored)} fds back at the next start (their names, "
                    "LISTEN_FDNAMES, are one environment string of at most 128 KiB); use larger pages, or the keeper "
                    "(--page-store keeper) where the unit's processes outlive the daemon")
        return None

    def put(self, ids: list[int], fds: list[int]) -> None:
        for pid, fd in zip(ids, fds):
            why = self._full(pid)
            if why is not None:
                if not self._full_said:
                    self._full_said = True
                    log.error("page store: %s: pages lent from now on are not kept, so their sessions resume only by "
                              "the fds their clients re-send", why)
                return
            if self._notify(f"FDSTORE=1\nFDNAME={fdname(pid)}\nFDPOLL=0", [fd]):
                self._stored.add(pid)
                self._name_bytes += len(fdname(pid)) + 1

    def drop(self, ids) -> None:
        for pid in ids:
            if pid in self._stored and self._notify(f"FDSTOREREMOVE=1\nFDNAME={fdname(pid)}"):
                self._stored.discard(pid)
                self._name_bytes -= len(fdname(pid)) + 1

    def clear(self) -> None:
        self.drop(list(self._stored))

    def close(self) -> None:
        self.available = False
        self._sock.close()

    def _notify(self, msg: str, fds: list[int] = ()) -> bool:
        if not self.available:
            return False
        try:
            # sendmsg, not socket.send_fds: that one drops its address argument (CPython 3.9-3.12)
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            self._sock.sendmsg([msg.encode()], anc, 0, self._addr)
            return True
        except OSError as exc:
            log.error("page store: sd_notify to %s failed (%s); pages lent from now on cannot be resumed from the "
                      "store after a restart (clients' re-sent fds are checked instead, docs/cuda.md \"Page identity\")",
                      self.path, exc)
            self.available = False
            return False


if __name__ == "__main__":
    sys.exit(main())
