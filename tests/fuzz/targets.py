"""Coverage-guided fuzz targets of the daemon's Python decoders (docs/fuzzing.md).

Each target takes one input (bytes) and fails (raises) only on a finding: an
exception other than the decoder's documented error types, or an answer
that breaks the decoder's own contract (the checks below). The engine
(atheris, libFuzzer's engine for Python: tests/fuzz/run.py) adds hangs
(-timeout) and unbounded memory (-rss_limit_mb).

  fdchannel     kvcached_service.fdchannel.decode / decode_hot: one record
                of the fd channel, as the daemon and the Python client read it
  journal       kvcached_service.server.recovery.journal.Journal.read: a whole
                journal file, as a restarted daemon reads it
  keeper_names  kvcached_service.server.recovery.keeper: systemd's fd store names
                (page_of, store_format_of, SystemdStore.take_all) and the
                LISTEN_* variables they come in (listen_fds)
  keeper_records  kvcached_service.server.recovery.keeper: the keeper's records
                (decode; Keeper.handle, as the keeper reads the daemon's;
                take_reply, as the daemon reads the keeper's answer to TAKE)
  config        kvcached_service.config.load_settings: a TOML file and
                KVCACHED_* variables

Input formats (the committed corpora, tests/fuzz/corpus/<target>/, are in
them; `seeds(target)` builds the seeds from the shared wire vectors and
fixtures):
  fdchannel     [nfds u8][flags u8][record]: flags bit 0 = MSG_TRUNC (the
                record was cut on receipt), bit 1 = MSG_CTRUNC. The Go and C
                targets read the same format (they ignore flags).
  journal       the file's bytes
  keeper_names  [LISTEN_FDS u8][LISTEN_FDNAMES bytes, UTF-8 with
                replacement]; LISTEN_FDS 255 means "the text before the
                first ':' of the rest is LISTEN_FDS itself"
  keeper_records  [nfds u8 (mod 8)][the record's JSON bytes]
  config        TOML text, then optionally b"\\0ENV\\0" and NAME=VALUE lines
                (KVCACHED_ is prepended to each NAME)
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "protos" / "kvcached" / "v1" / "fdchannel.vectors.json"
CORPUS = Path(__file__).resolve().parent / "corpus"
TARGETS = ("fdchannel", "journal", "keeper_names", "keeper_records", "config")

# The decoders log what they refuse (a torn journal line, fds that are not
# pages): nothing a fuzz run wants to print a million times.
logging.disable(logging.CRITICAL)


class Finding(AssertionError):
    """A decoder's answer breaks its own contract (not an exception it raised)."""


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise Finding(what)


# ---------------------------------------------------------------- fd channel
def fdchannel(data: bytes) -> None:
    from kvcached_service import fdchannel as fc

    if len(data) < 2:
        return
    nfds, flags, rec = data[0], data[1], data[2:]
    fds = list(range(1000, 1000 + nfds))  # never opened: decode() neither uses nor closes them
    truncated, fds_truncated = bool(flags & 1), bool(flags & 2)
    try:
        out = fc.decode(rec, fds, truncated, fds_truncated)
    except fc.MalformedRequest as exc:
        _check(fc.HEADER_SIZE + 8 <= len(rec), f"MalformedRequest without a req_id to answer: {exc}")
        _check(isinstance(exc.req_id, int) and 0 <= exc.req_id < 1 << 64, f"req_id {exc.req_id!r}")
        _check(exc.message.startswith(f"malformed {exc.kind} record: "), exc.message)
        _check(len(exc.message.encode()) <= fc.MAX_MESSAGE, f"a REPLY message of {len(exc.message.encode())} bytes")
        out = None
    except fc.ProtocolError as exc:
        _check(bool(str(exc)), "a ProtocolError with no message")
        out = None
    if out is not None:
        _check(not truncated, f"{type(out).__name__} decoded from a record cut on receipt")
        ids = getattr(out, "page_ids", None)
        if ids is not None:
            _check(all(0 <= i < 1 << 64 for i in ids), "a page id out of u64")
            _check(len(ids) <= fc.MAX_FREE_IDS, f"{len(ids)} page ids")
    if not flags & 3:  # (the C decoder has no MSG_TRUNC/MSG_CTRUNC inputs)
        _c_agrees(rec, nfds)
    # decode_hot reads what it accepts as decode() does (its docstring; the
    # daemon calls it only for records without descriptors or MSG_*TRUNC)
    hot = fc.decode_hot(rec)
    if hot is not None:
        full = fc.decode(rec, [])
        if hot[0] == fc.REQ_ALLOCATE:
            _, req, n, fl, wait_ms = hot
            _check(isinstance(full, fc.AllocateReq) and (full.req_id, full.num_pages, full.wait_timeout_ms, full.device)
                   == (req, n, wait_ms, "") and full.wait == bool(fl & fc.ALLOC_WAIT)
                   and full.notify == bool(fl & fc.ALLOC_NOTIFY), f"decode_hot {hot} but decode {full}")
        else:
            _, req, pid, fl = hot
            _check(isinstance(full, fc.FreeReq) and (full.req_id, full.page_ids, full.flags) == (req, (pid,), fl),
                   f"decode_hot {hot} but decode {full}")


_CLIB = ROOT / "build" / "fuzz" / "c" / "libkvcfd.so"  # tests/fuzz/c/classify.c, built by scripts/test-fuzz.sh
_clib = None


def _c_agrees(rec: bytes, nfds: int) -> None:
    """Differential check: the C client's decoder (kvc_fd_decode_any, loaded
    from _CLIB when it was built) answers as this one: ok with the same type
    and page count, or the same malformed request (req_id, REPLY message),
    or a protocol error."""
    global _clib
    if _clib is None:
        import ctypes

        if not _CLIB.exists():
            _clib = False
            return
        _clib = ctypes.CDLL(str(_CLIB))
        _clib.kvc_fuzz_err.restype = ctypes.c_char_p
    if _clib is False:
        return
    import ctypes

    from kvcached_service import fdchannel as fc

    req, typ, count = ctypes.c_uint64(), ctypes.c_uint32(), ctypes.c_uint32()
    st = _clib.kvc_fuzz_classify(rec, len(rec), nfds, ctypes.byref(req), ctypes.byref(typ), ctypes.byref(count))
    try:
        out = fc.decode(rec, list(range(nfds)))
    except fc.MalformedRequest as exc:
        _check(st == 1 and req.value == exc.req_id and _clib.kvc_fuzz_err().decode("utf-8", "replace") == exc.message,
               f"Python: {exc.message!r} (req_id {exc.req_id}); C: status {st}, req_id {req.value}, {_clib.kvc_fuzz_err()!r}")
        return
    except fc.ProtocolError as exc:
        _check(st == 10, f"Python: protocol error {exc}; C: status {st} ({_clib.kvc_fuzz_err()!r})")
        return
    kind = {v: k for k, v in fc.NAMES.items()}
    name = {"AllocateReq": "ALLOCATE", "FreeReq": "FREE", "CloseReq": "CLOSE", "AnswerReq": "ANSWER",
            "DroppedReq": "DROPPED", "UseReq": "USE"}.get(type(out).__name__, type(out).__name__.upper())
    _check(st == 0 and typ.value == kind[name], f"Python: {out!r:.200}; C: status {st}, type {typ.value} ({_clib.kvc_fuzz_err()!r})")
    ids = getattr(out, "page_ids", None)
    if ids is not None:
        _check(count.value == len(ids), f"Python: {len(ids)} page ids; C: count {count.value}")


# ---------------------------------------------------------------- journal
_JOURNAL_DIR = "/nonexistent/kvcached-fuzz"  # read() touches no file: the path only names it in messages


def journal(data: bytes) -> None:
    from kvcached_service.server.recovery import journal as jr

    j = jr.Journal(_JOURNAL_DIR)
    try:
        j.read(io.BytesIO(data), len(data))
    except (jr.JournalDamaged, jr.JournalTooNew) as exc:
        _check(str(exc).startswith(f"journal {j.path}"), f"a message that does not name the journal: {exc}")
        if isinstance(exc, jr.JournalDamaged):
            _check(exc.line >= 1 and bool(exc.problem), f"line {exc.line}, problem {exc.problem!r}")
    # what was applied (all of it, or what came before the damage) is in range
    _check(jr._is_int(j.next_session_id, 1, jr.MAX_ID + 1) and jr._is_int(j.next_page_id, 1, jr.MAX_ID + 1),
           f"next ids {j.next_session_id!r} {j.next_page_id!r}")
    for sid, js in j.sessions.items():
        _check(sid == js.sid and jr._is_int(sid, 1), f"session {sid!r}")
        _check(jr._is_int(js.uid, 0, jr.MAX_UID) and isinstance(js.name, str) and isinstance(js.resume_hash, str),
               f"session {sid}: {js}")
        for pid, (dev, ident) in js.pages.items():
            _check(jr._is_int(pid, 1) and isinstance(dev, str) and isinstance(ident, str), f"page {pid!r}")


# ---------------------------------------------------------------- page store names
def keeper_names(data: bytes) -> None:
    from kvcached_service.server.recovery import keeper as kp

    if not data:
        return
    text = data[1:].decode("utf-8", "replace")
    if data[0] == 255:
        nfds, _, names = text.partition(":")
    else:
        nfds, names = str(data[0]), text
    for name in names.split(":"):
        pid = kp.page_of(name)
        if pid is not None:
            _check(isinstance(pid, int) and 0 <= pid < 1 << 64, f"page_of({name!r:.80}) = {pid}")
            _check(kp.page_of(kp.fdname(pid)) == pid, f"page_of(fdname({pid})) != {pid}")
            _check(kp.store_format_of(name) == 1, f"store_format_of({name!r:.80}) is not 1 for a page's name")
        fmt = kp.store_format_of(name)
        _check(fmt is None or (isinstance(fmt, int) and 0 <= fmt < 10**6), f"store_format_of({name!r:.80}) = {fmt!r}")
    # listen_fds parses LISTEN_*; it makes fds 3.. close-on-exec (harmless
    # to the fuzzer's own) and skips those not open
    env = {"LISTEN_PID": "4242", "LISTEN_FDS": nfds, "LISTEN_FDNAMES": names}
    inherited = kp.listen_fds(env, pid=4242)
    _check(not any(k.startswith("LISTEN_") for k in env), f"LISTEN_* left in the environment: {sorted(env)}")
    _check(all(fd >= kp.LISTEN_FDS_START for _, fd in inherited), f"fds {inherited}")
    # SystemdStore.take_all over these names, with fds of our own (it closes
    # the ones that are not pages; we close the pages')
    names_list = names.split(":")[:64]
    fds = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for _ in names_list]
    store = kp.SystemdStore.__new__(kp.SystemdStore)
    store._inherited, store._stored, store._name_bytes = list(zip(names_list, fds)), set(), 0
    try:
        pages = store.take_all()
    except kp.StoreTooNew as exc:
        _check("systemd's fd store" in str(exc), str(exc))
        kp.close_fds(fds)
        return
    _check(all(isinstance(p, int) and 0 <= p < 1 << 64 for p in pages), f"page ids {sorted(pages)[:5]}")
    kept = set(pages.values())
    for fd in fds:
        if fd in kept:
            os.close(fd)
        else:
            try:  # take_all closed it: fstat must fail
                os.fstat(fd)
            except OSError:
                continue
            os.close(fd)
            raise Finding(f"take_all neither returned nor closed fd {fd}")


# ---------------------------------------------------------------- page store records
def _fds_closed_or_in(fds: list[int], kept, what: str) -> None:
    kept = set(kept)
    for fd in fds:
        if fd in kept:
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue
        os.close(fd)
        raise Finding(f"{what}: fd {fd} neither kept nor closed")


def keeper_records(data: bytes) -> None:
    import socket

    from kvcached_service.server.recovery import keeper as kp

    if not data:
        return
    nfds, raw = data[0] % 8, data[1:]
    devnull = lambda: os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # noqa: E731
    fds = [devnull() for _ in range(nfds)]
    try:
        msg = kp.decode(raw, fds)
    except ValueError:
        _fds_closed_or_in(fds, (), "decode refused the record")
        return
    _check(isinstance(msg, dict), f"decode gave {type(msg).__name__}")
    # the keeper reads it: a store of two pages, the daemon at the other end
    k = kp.Keeper.__new__(kp.Keeper)
    k.store = {1: devnull(), 2: devnull()}
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        k.handle(a, msg, fds)
        _fds_closed_or_in(fds, k.store.values(), f"Keeper.handle({msg!r:.80})")
        b.setblocking(False)
        while True:
            try:
                _, got, _, _ = socket.recv_fds(b, kp.MAX_MSG, kp.BATCH)
            except BlockingIOError:
                break
            kp.close_fds(got)
    finally:
        kp.close_fds(k.store.values())
        a.close()
        b.close()
    # the daemon reads it as an answer to TAKE
    fds = [devnull() for _ in range(nfds)]
    out = {7: devnull()}
    try:
        last = kp.take_reply(msg, fds, out)
        _check(isinstance(last, bool), f"last {last!r}")
    except (ValueError, kp.StoreTooNew):
        pass
    _check(all(isinstance(p, int) and 0 <= p < 1 << 64 for p in out), f"page ids {list(out)[:5]}")
    _fds_closed_or_in(fds, out.values(), f"take_reply({msg!r:.80})")
    kp.close_fds(out.values())


# ---------------------------------------------------------------- config
_CONFIG_FILE: Path | None = None


def config(data: bytes) -> None:
    from kvcached_service import config as cfg

    global _CONFIG_FILE
    if _CONFIG_FILE is None:
        _CONFIG_FILE = Path(tempfile.mkdtemp(prefix="kvcached-fuzz-")) / "kvcached.toml"
    toml, _, envtext = data.partition(b"\0ENV\0")
    _CONFIG_FILE.write_bytes(toml)
    env = {}
    for line in envtext.decode("utf-8", "replace").splitlines()[:16]:
        name, sep, value = line.partition("=")
        if sep and name and "\0" not in name + value:
            env["KVCACHED_" + name.upper()] = value
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVCACHED_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        s = cfg.load_settings({}, str(_CONFIG_FILE))
    except cfg.ConfigError as exc:
        _check(str(exc).startswith(("invalid settings", "config file not found")), str(exc))
        return
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)
    # what the daemon reads from valid settings must not fail later
    lim = s.memory_limit_value
    _check(lim.resolve(80 << 30) >= 0, f"memory_limit {lim} resolves below 0")
    _check(0 < s.page_size_bytes <= cfg.MAX_SIZE and 0 <= s.prealloc_bytes <= cfg.MAX_SIZE
           and 0 <= lim.resolve(1 << 40) <= max(cfg.MAX_SIZE, 1 << 40),
           f"page_size {s.page_size!r}, prealloc {s.prealloc!r}, memory_limit {s.memory_limit!r}")
    if s.host_memory:
        _check(0 <= cfg.parse_size(s.host_memory) <= cfg.MAX_SIZE, f"host_memory {s.host_memory!r}")
    _check(0 <= s.socket_mode_bits <= 0o777, f"socket_mode {s.socket_mode!r}")
    gid = s.socket_gid
    _check(gid is None or (isinstance(gid, int) and gid >= 0), f"socket_group {s.socket_group!r}")
    _check(all(isinstance(u, int) for u in s.allowed_uids + s.admin_uids), "uids")
    if s.metrics_address:
        host, _, port = s.metrics_address.rpartition(":")
        _check(0 <= int(port) <= 65535, f"metrics_address {s.metrics_address!r}")


# ---------------------------------------------------------------- seeds
def _vector_seeds() -> list[bytes]:
    d = json.loads(VECTORS.read_text())
    out = []
    for v in d["vectors"] + d["unexpected"]:
        rec = bytes.fromhex(v["hex"])
        out.append(bytes([min(v["fds"], 255), 0]) + rec)
    # records cut on receipt (a request whose req_id arrived, a HELLO) and
    # ones whose descriptors were cut (a request, a PAGES)
    free = next(bytes.fromhex(v["hex"]) for v in d["vectors"] if v.get("record", {}).get("type") == "FREE")
    hello = next(bytes.fromhex(v["hex"]) for v in d["vectors"] if v.get("record", {}).get("type") == "HELLO")
    pages = next(bytes.fromhex(v["hex"]) for v in d["vectors"] if v.get("record", {}).get("type") == "PAGES")
    cut = free[:8] + (131096).to_bytes(4, "little") + free[12:]
    out += [b"\0\1" + free, b"\0\1" + cut, b"\0\1" + hello[:30], b"\0\2" + free, b"\1\2" + pages]
    return out


def _journal_seeds() -> list[bytes]:
    out = [p.read_bytes() for p in sorted((ROOT / "tests" / "fixtures").glob("*/journal.jsonl"))]
    lines = [
        {"op": "snapshot", "format": 3, "next_session_id": 3, "next_page_id": 9, "scope": "pid:[4026531836] boot b", "sessions": [
            {"sid": 1, "uid": 1000, "name": "chat", "resume_hash": "ab" * 32, "guaranteed_bytes": 0, "max_bytes": 0,
             "priority": 0, "labels": {"model": "x"}, "pages": {"1": ["GPU-0", "1:2"], "2": ["GPU-0", "1:3"]},
             "pid": 4242, "pstart": 123456, "orphan_until": 1_800_000_000_000}]},
        {"op": "open", "sid": 2, "uid": 0, "name": "e", "rh": "cd" * 32, "g": 4096, "m": 8192, "p": -1, "labels": {},
         "pid": 77, "ps": 99},
        {"op": "resume", "sid": 1, "pid": 4243, "ps": 123999},
        {"op": "alloc", "sid": 2, "dev": "HOST-0", "pages": [[3, "1:4"], [4, "1:5"]]},
        {"op": "free", "sid": 2, "pages": [3]},
        {"op": "limits", "sid": 1, "g": 0, "m": 1 << 30, "p": 5},
        {"op": "close", "sid": 1},
    ]
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines).encode()
    out += [text, text[:-7], text[:-1], text.replace(b'"format":3', b'"format":4'), b'{"op":"snapshot"}\n',
            text + b"[" * 3000 + b"\n"]  # a torn but complete last record; JSON nested past the parser's recursion limit
    return out


def _keeper_seeds() -> list[bytes]:
    from kvcached_service.server.recovery.keeper import fdname

    names = ":".join(fdname(p) for p in (1, 63, 64, 4095, (1 << 62) - 1, 1 << 63))
    return [b"\x06" + names.encode(), b"\x03~1:~2.Zm9v:stored-socket", b"\xff12:~1:~1:~A", b"\xffx:~1", b"\x02~:~~", b"\x01~3.x"]


def _keeper_record_seeds() -> list[bytes]:
    recs = [({"op": "put", "ids": [5, 6]}, 2), ({"op": "drop", "ids": [1, 5]}, 0), ({"op": "take"}, 0),
            ({"op": "clear"}, 0), ({"op": "pages", "format": 1, "ids": [3, 4], "last": True}, 2),
            ({"op": "pages", "format": 2, "ids": [], "last": True}, 0), ({"op": "put", "ids": [1]}, 3),
            ({"op": "put", "ids": [1]}, 1), ({"op": "drop", "ids": [[1]]}, 1), ({"op": "pages", "ids": 5}, 1)]
    return [bytes([n]) + json.dumps(r).encode() for r, n in recs] + [b"\x01[[[[", b"\x00{}", b"\x00[1]", b"\x01" + b"[" * 5000]


def _config_seeds() -> list[bytes]:
    return [
        b'memory_limit = "8GiB"\npage_size = "2MiB"\nprealloc = "256MiB"\nsocket_mode = "0660"\n',
        b'memory_limit = "90%"\nallowed_uids = [0, 1000]\nmetrics_address = "127.0.0.1:9400"\nbackend = "host"\n',
        b'state_dir = "/tmp/s"\npage_store = "keeper"\nmax_grpc_connections = 8\ngrpc_admin_reserve = 2\n',
        b'socket = "/tmp/a.sock"\n\0ENV\0MEMORY_LIMIT=50%\nADMIN_UIDS=0,5\nSOCKET_GROUP=0\nZERO_PAGES=false\n',
        b'channel_ops_only = false\nlog_level = "DEBUG"\npool_idle_seconds = 1.5\n',
        b'[oops\n',
        b'memory_limit = "9999999999EiB"\nsocket_group = "4294967296"\n',
        b'socket = "/tmp/k.sock"\nfd_socket = "/tmp/k.sock"\n',
        b'page_size = "0"\n', b'memory_limit = "0"\n', b'channel_ops_only = true\ngrpc_page_ops = true\n',
        b'grpc_admin_reserve = 2000\n', b'host_memory = "1GiB"\n\0ENV\0SOCKET=\n',
    ]


def seeds(target: str) -> list[bytes]:
    return {"fdchannel": _vector_seeds, "journal": _journal_seeds, "keeper_names": _keeper_seeds,
            "keeper_records": _keeper_record_seeds, "config": _config_seeds}[target]()


def write_seeds(target: str, into: Path) -> Path:
    """The seeds of `target` as files in `into` (a libFuzzer corpus dir)."""
    import hashlib

    into.mkdir(parents=True, exist_ok=True)
    for s in seeds(target):
        (into / hashlib.sha1(s).hexdigest()).write_bytes(s)
    return into
