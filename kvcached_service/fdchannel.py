"""The fd channel's codec: framing of the SOCK_SEQPACKET socket that carries page fds.

This module owns that boundary for the daemon and the Python client: every
record is built and parsed here, and every sendmsg/recvmsg with SCM_RIGHTS
happens here. The format is specified, machine-readably, in
protos/kvcached/v1/fdchannel.spec.json (prose: docs/protocol.md), with
shared test vectors in protos/kvcached/v1/fdchannel.vectors.json that this
codec, the Go client's internal/fdchan and the C client's fdchannel.c all
decode the same way (tests/test_fdchannel.py checks this one, and that the
constants below match the spec).
"""

from __future__ import annotations

import array
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable

MAGIC = 0x4643564B  # bytes 'K','V','C','F' little-endian
VERSION = 1
MAX_FDS = 253  # SCM_MAX_FD

HELLO = 1
PAGES = 2
ERROR = 3
GOODBYE = 4
ADOPT = 5  # client to daemon: pages re-sent for ResumeSession
REQ_ALLOCATE = 6  # client to daemon, on a session's channel
REQ_FREE = 7
REQ_CLOSE = 8
REPLY = 9  # daemon to client: the answer to a request record
REQ_ANSWER = 10  # client to daemon: a session's answer to a reclaim request
DROP = 11  # daemon to client: release your kept handles of these pages (docs/protocol.md, "Kept handles")
REQ_DROPPED = 12  # client to daemon: it keeps no handle of these pages any more
REQ_USE = 13  # client to daemon: standby pages in use again (docs/protocol.md, "Standby pages")
NAMES = {HELLO: "HELLO", PAGES: "PAGES", ERROR: "ERROR", GOODBYE: "GOODBYE", ADOPT: "ADOPT", REQ_ALLOCATE: "ALLOCATE",
         REQ_FREE: "FREE", REQ_CLOSE: "CLOSE", REPLY: "REPLY", REQ_ANSWER: "ANSWER", DROP: "DROP",
         REQ_DROPPED: "DROPPED", REQ_USE: "USE"}
REQUESTS = frozenset({REQ_ALLOCATE, REQ_FREE, REQ_CLOSE, REQ_ANSWER, REQ_DROPPED, REQ_USE})  # answered by REPLY, req_id first
# Allocations asked for on the channel are delivered with allocation_id =
# req_id | CHANNEL_ALLOC_BIT, so they never collide with gRPC Allocate ids.
CHANNEL_ALLOC_BIT = 1 << 63
MAX_FREE_IDS = 16384  # page ids in one FREE record

_HEADER = struct.Struct("<IHHII")  # magic, version, type, payload_len, reserved
_HELLO = struct.Struct("<QIIII32s")  # channel_id, pid, uid, gid, max_fds, secret
_PAGES = struct.Struct("<QIIII")  # allocation_id, first_index, count, total, reserved
_ERROR = struct.Struct("<I")  # code, then message
_REQ_ALLOC = struct.Struct("<QIIII")  # req_id, num_pages, flags, wait_timeout_ms, device_len; then device
_REQ_FREE = struct.Struct("<QII")  # req_id, count, flags; then page ids (DROPPED and USE: the same layout)
_DROP = struct.Struct("<II")  # count, reserved; then page ids
_REQ_CLOSE = struct.Struct("<Q")  # req_id
_REPLY = struct.Struct("<QIIQ")  # req_id, code, reserved, value; then message
_REQ_ANSWER = struct.Struct("<QQQQ")  # req_id, reclaim_id, bytes_given, bytes_kept; then reason
_REQ_ID = struct.Struct("<Q")  # the first field of every request
ALLOC_WAIT = 1
ALLOC_NOTIFY = 2
FREE_KEEP = 1  # FREE flags: the sender keeps the imported handle of every page it names
FREE_STANDBY = 2  # FREE flags: the pages stay the session's, mapped, as standby (not given back)
HEADER_SIZE = _HEADER.size
SECRET_SIZE = 32
# Largest record a client sends (a FREE with MAX_FREE_IDS ids), and the
# largest the daemon sends (a REPLY with its message, or a full PAGES record).
MAX_CLIENT_RECORD = HEADER_SIZE + 16 + 8 * MAX_FREE_IDS
MAX_RECORD = HEADER_SIZE + 4096 + 64
MAX_MESSAGE = 4000  # bytes of an ERROR or REPLY message the daemon sends (cut there)
MAX_DROP_IDS = (MAX_RECORD - HEADER_SIZE - 8) // 8  # 519: page ids in one DROP (the record fits MAX_RECORD)
MAX_REASON = 1024  # bytes of an ANSWER's reason


class ProtocolError(Exception):
    """A record that does not follow docs/protocol.md and whose framing is
    broken (or that has no request id to answer): the receiver closes the
    channel (spec: on_protocol_error)."""


class MalformedRequest(ProtocolError):
    """A request record (ALLOCATE, FREE, CLOSE, ANSWER) whose framing is
    sound (header, length, type) and whose req_id can be read, but which
    breaks its type's own rules. The daemon answers it with a REPLY
    INVALID_ARGUMENT carrying `message` and the session goes on (spec:
    on_malformed_request); a client never receives requests, so for it this
    is a protocol error like any other."""

    def __init__(self, kind: str, req_id: int, fault: str):
        self.kind = kind
        self.req_id = req_id
        self.fault = fault
        super().__init__(f"malformed {kind} record: {fault}")

    @property
    def message(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Hello:
    channel_id: int
    pid: int
    uid: int
    gid: int
    max_fds: int
    secret: bytes


@dataclass(frozen=True)
class Pages:
    allocation_id: int
    first_index: int
    total: int
    page_ids: tuple[int, ...]
    fds: tuple[int, ...]


@dataclass(frozen=True)
class Adopt:
    """Pages a client re-sends after a daemon restart (same layout as PAGES;
    allocation_id is the session id being resumed)."""

    session_id: int
    first_index: int
    total: int
    page_ids: tuple[int, ...]
    fds: tuple[int, ...]


@dataclass(frozen=True)
class AllocateReq:
    req_id: int
    num_pages: int
    wait: bool
    notify: bool
    wait_timeout_ms: int
    device: str


@dataclass(frozen=True)
class FreeReq:
    req_id: int
    page_ids: tuple[int, ...]
    flags: int = 0  # FREE_KEEP; other bits ignored

    @property
    def keep(self) -> bool:
        return bool(self.flags & FREE_KEEP)

    @property
    def standby(self) -> bool:
        return bool(self.flags & FREE_STANDBY)


@dataclass(frozen=True)
class DroppedReq:
    """The client keeps no handle of these pages any more (an answer to
    DROP, or on its own)."""

    req_id: int
    page_ids: tuple[int, ...]


@dataclass(frozen=True)
class UseReq:
    """Standby pages of the session in use again (no Allocate needed)."""

    req_id: int
    page_ids: tuple[int, ...]


@dataclass(frozen=True)
class Drop:
    """The daemon asks the client to release its kept handles of these
    pages, then to say so with DROPPED."""

    page_ids: tuple[int, ...]


@dataclass(frozen=True)
class CloseReq:
    req_id: int


@dataclass(frozen=True)
class AnswerReq:
    """A session's answer to a reclaim request (a RECLAIM Watch event):
    what it gave back for it and what it keeps, and why."""

    req_id: int
    reclaim_id: int
    bytes_given: int
    bytes_kept: int
    reason: str


@dataclass(frozen=True)
class Reply:
    req_id: int
    code: int  # a status number (errors.Code); 0 = OK
    value: int  # held bytes (ALLOCATE), pages freed (FREE), pages returned (CLOSE)
    message: str


@dataclass(frozen=True)
class Error:
    code: int
    message: str


@dataclass(frozen=True)
class Goodbye:
    pass


Record = Hello | Pages | Adopt | Error | Goodbye | AllocateReq | FreeReq | CloseReq | AnswerReq | Reply | Drop | DroppedReq | UseReq


def _frame(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, kind, len(payload), 0) + payload


def encode_hello(h: Hello) -> bytes:
    if len(h.secret) != SECRET_SIZE:
        raise ValueError("secret must be 32 bytes")
    return _frame(HELLO, _HELLO.pack(h.channel_id, h.pid, h.uid, h.gid, h.max_fds, h.secret))


def encode_pages(allocation_id: int, first_index: int, total: int, page_ids: list[int], kind: int = PAGES) -> bytes:
    if not 1 <= len(page_ids) <= MAX_FDS:
        raise ValueError(f"a PAGES record carries 1..{MAX_FDS} pages, not {len(page_ids)}")
    payload = _PAGES.pack(allocation_id, first_index, len(page_ids), total, 0)
    return _frame(kind, payload + struct.pack(f"<{len(page_ids)}Q", *page_ids))


def encode_adopt(session_id: int, first_index: int, total: int, page_ids: list[int]) -> bytes:
    return encode_pages(session_id, first_index, total, page_ids, kind=ADOPT)


def encode_error(code: int, message: str) -> bytes:
    return _frame(ERROR, _ERROR.pack(code) + message.encode("utf-8", "replace")[:MAX_MESSAGE])


def encode_allocate(req_id: int, num_pages: int, device: str = "", wait: bool = False, notify: bool = False, wait_timeout_ms: int = 0) -> bytes:
    dev = device.encode()
    flags = (ALLOC_WAIT if wait else 0) | (ALLOC_NOTIFY if notify else 0)
    return _frame(REQ_ALLOCATE, _REQ_ALLOC.pack(req_id, num_pages, flags, wait_timeout_ms, len(dev)) + dev)


def encode_free(req_id: int, page_ids: list[int], keep: bool = False, kind: int = REQ_FREE, standby: bool = False) -> bytes:
    if not 1 <= len(page_ids) <= MAX_FREE_IDS:
        raise ValueError(f"a {NAMES[kind]} record carries 1..{MAX_FREE_IDS} page ids, not {len(page_ids)}")
    flags = (FREE_KEEP if keep else 0) | (FREE_STANDBY if standby else 0)
    return _frame(kind, _REQ_FREE.pack(req_id, len(page_ids), flags) + struct.pack(f"<{len(page_ids)}Q", *page_ids))


def encode_dropped(req_id: int, page_ids: list[int]) -> bytes:
    return encode_free(req_id, page_ids, kind=REQ_DROPPED)


def encode_use(req_id: int, page_ids: list[int]) -> bytes:
    return encode_free(req_id, page_ids, kind=REQ_USE)


def encode_drop(page_ids: list[int]) -> bytes:
    if not 1 <= len(page_ids) <= MAX_DROP_IDS:
        raise ValueError(f"a DROP record carries 1..{MAX_DROP_IDS} page ids, not {len(page_ids)}")
    return _frame(DROP, _DROP.pack(len(page_ids), 0) + struct.pack(f"<{len(page_ids)}Q", *page_ids))


def encode_close(req_id: int) -> bytes:
    return _frame(REQ_CLOSE, _REQ_CLOSE.pack(req_id))


def encode_answer(req_id: int, reclaim_id: int, bytes_given: int, bytes_kept: int, reason: str = "") -> bytes:
    why = reason.encode("utf-8", "replace")
    if len(why) > MAX_REASON:
        raise ValueError(f"an ANSWER's reason is at most {MAX_REASON} bytes, not {len(why)}")
    return _frame(REQ_ANSWER, _REQ_ANSWER.pack(req_id, reclaim_id, bytes_given, bytes_kept) + why)


_REPLY_BARE = struct.Struct("<IHHII" + _REPLY.format.lstrip("<"))  # header and a REPLY without message, in one pack


def encode_reply(req_id: int, code: int, value: int = 0, message: str = "") -> bytes:
    if not message:  # the common answer: one pack, no concatenation
        return _REPLY_BARE.pack(MAGIC, VERSION, REPLY, _REPLY.size, 0, req_id, code, 0, value)
    return _frame(REPLY, _REPLY.pack(req_id, code, 0, value) + message.encode("utf-8", "replace")[:MAX_MESSAGE])


def encode_goodbye() -> bytes:
    return _frame(GOODBYE, b"")


def decode(data: bytes, fds: list[int] | tuple[int, ...], truncated: bool = False, fds_truncated: bool = False) -> Record:
    """Parse one record. On error the caller still owns (and must close) fds.

    Raises MalformedRequest for a request record (ALLOCATE, FREE, CLOSE,
    ANSWER) whose framing is sound and whose req_id can be read but which
    breaks its own rules (the daemon answers it: REPLY INVALID_ARGUMENT),
    ProtocolError for anything else malformed (the receiver closes the
    channel). `truncated` / `fds_truncated`: the kernel cut the record or
    its descriptor list on receipt (MSG_TRUNC / MSG_CTRUNC); a record
    boundary is never lost on SOCK_SEQPACKET, so a cut request whose req_id
    arrived is answered too."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"record of {len(data)} bytes is shorter than the header")
    magic, version, kind, length, _ = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:08x}")
    if version != VERSION:
        raise ProtocolError(f"unsupported fd protocol version {version}")
    payload = data[HEADER_SIZE:]
    name = NAMES.get(kind)
    if truncated:
        if kind in REQUESTS and len(payload) >= 8 and length > len(payload):
            raise MalformedRequest(name, _REQ_ID.unpack_from(payload)[0],
                                   f"{HEADER_SIZE + length} bytes, more than the {MAX_CLIENT_RECORD} a client may send")
        raise ProtocolError(f"record cut on receipt (header says {length} payload bytes)")
    if len(payload) != length:
        raise ProtocolError(f"payload is {len(payload)} bytes, header says {length}")
    if name is None:
        raise ProtocolError(f"unknown record type {kind}")
    if kind in REQUESTS:
        return _decode_request(kind, name, payload, fds, fds_truncated)
    if fds_truncated:
        raise ProtocolError(f"{name} record's descriptors were cut on receipt")
    return _decode_daemon_record(kind, name, payload, fds)


def _decode_daemon_record(kind: int, name: str, payload: bytes, fds: list[int] | tuple[int, ...]) -> Record:
    """A record the daemon sends (HELLO, PAGES, REPLY, ERROR, DROP,
    GOODBYE), or ADOPT; its framing checked by `decode`."""
    length = len(payload)
    if kind == HELLO:
        if length != _HELLO.size or fds:
            raise ProtocolError("malformed HELLO")
        return Hello(*_HELLO.unpack(payload))
    if kind in (PAGES, ADOPT):
        if length < _PAGES.size:
            raise ProtocolError(f"{name} record too short")
        alloc, first, count, total, _ = _PAGES.unpack_from(payload)
        if not 1 <= count <= MAX_FDS or length != _PAGES.size + 8 * count or count != len(fds):
            raise ProtocolError(f"{name} record says {count} pages, carries {len(fds)} fds and {length} bytes")
        if first + count > total:
            raise ProtocolError(f"{name} record covers pages {first}..{first + count} of an allocation of {total}")
        ids = struct.unpack_from(f"<{count}Q", payload, _PAGES.size)
        return (Pages if kind == PAGES else Adopt)(alloc, first, total, tuple(ids), tuple(fds))
    if kind == REPLY:
        if length < _REPLY.size or fds:
            raise ProtocolError("REPLY record too short" if length < _REPLY.size else "REPLY record carries descriptors")
        req, code, _, value = _REPLY.unpack_from(payload)
        return Reply(req, code, value, payload[_REPLY.size :].decode("utf-8", "replace"))
    if kind == ERROR:
        if length < _ERROR.size or fds:
            raise ProtocolError("malformed ERROR")
        (code,) = _ERROR.unpack_from(payload)
        return Error(code, payload[_ERROR.size :].decode("utf-8", "replace"))
    if kind == DROP:
        if length < _DROP.size or fds:
            raise ProtocolError("DROP record too short" if length < _DROP.size else "DROP record carries descriptors")
        count, _ = _DROP.unpack_from(payload)
        if not 1 <= count <= MAX_DROP_IDS or length != _DROP.size + 8 * count:
            raise ProtocolError(f"DROP record says {count} page ids and has {length - _DROP.size} bytes of them")
        return Drop(struct.unpack_from(f"<{count}Q", payload, _DROP.size))
    assert kind == GOODBYE
    if length or fds:
        raise ProtocolError("malformed GOODBYE")
    return Goodbye()


def _decode_request(kind: int, name: str, payload: bytes, fds, fds_truncated: bool) -> Record:
    """A request record: no req_id is a protocol error; after that every
    fault is a MalformedRequest naming it."""
    length = len(payload)
    if length < _REQ_ID.size:
        raise ProtocolError(f"{name} record of {length} payload bytes has no req_id")
    (req,) = _REQ_ID.unpack_from(payload)
    if fds or fds_truncated:
        raise MalformedRequest(name, req, f"carries descriptors ({len(fds)}{' and more, cut' if fds_truncated else ''}); requests carry none")
    if kind == REQ_ALLOCATE:
        if length < _REQ_ALLOC.size:
            raise MalformedRequest(name, req, f"{length} payload bytes, fewer than its fixed {_REQ_ALLOC.size}")
        _, n, flags, wait_ms, dev_len = _REQ_ALLOC.unpack_from(payload)
        if length != _REQ_ALLOC.size + dev_len:
            raise MalformedRequest(name, req, f"device_len {dev_len} but {length - _REQ_ALLOC.size} bytes of device")
        dev = payload[_REQ_ALLOC.size :].decode("utf-8", "replace")
        return AllocateReq(req, n, bool(flags & ALLOC_WAIT), bool(flags & ALLOC_NOTIFY), wait_ms, dev)
    if kind in (REQ_FREE, REQ_DROPPED, REQ_USE):
        if length < _REQ_FREE.size:
            raise MalformedRequest(name, req, f"{length} payload bytes, fewer than its fixed {_REQ_FREE.size}")
        _, count, flags = _REQ_FREE.unpack_from(payload)
        if count > MAX_FREE_IDS:
            raise MalformedRequest(name, req, f"{count} page ids, more than {MAX_FREE_IDS}")
        if length != _REQ_FREE.size + 8 * count:
            raise MalformedRequest(name, req, f"count {count} but {length - _REQ_FREE.size} bytes of page ids")
        ids = struct.unpack_from(f"<{count}Q", payload, _REQ_FREE.size)
        if kind == REQ_FREE:
            return FreeReq(req, ids, flags)
        return DroppedReq(req, ids) if kind == REQ_DROPPED else UseReq(req, ids)
    if kind == REQ_CLOSE:
        if length != _REQ_CLOSE.size:
            raise MalformedRequest(name, req, f"{length} payload bytes, not {_REQ_CLOSE.size}")
        return CloseReq(req)
    assert kind == REQ_ANSWER
    if length < _REQ_ANSWER.size:
        raise MalformedRequest(name, req, f"{length} payload bytes, fewer than its fixed {_REQ_ANSWER.size}")
    if length - _REQ_ANSWER.size > MAX_REASON:
        raise MalformedRequest(name, req, f"a reason of {length - _REQ_ANSWER.size} bytes, more than {MAX_REASON}")
    _, reclaim_id, given, kept = _REQ_ANSWER.unpack_from(payload)
    return AnswerReq(req, reclaim_id, given, kept, payload[_REQ_ANSWER.size :].decode("utf-8", "replace"))


# Plain ints (the socket module's are enum members, whose operators cost
# more than the rest of a small record's handling), computed once.
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)
_MSG_TRUNC = int(socket.MSG_TRUNC)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_MSG_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_CUT = _MSG_TRUNC | _MSG_CTRUNC
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_NO_ANC: list = []


def send_record(sock: socket.socket, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one record (blocking or not, as the socket is set). Raises
    BlockingIOError when a non-blocking socket is full; nothing was sent."""
    if fds:
        if len(fds) > MAX_FDS:
            raise ValueError(f"at most {MAX_FDS} fds per record")
        sent = sock.sendmsg((data,), [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds).tobytes())])
    else:
        # send(), not sendmsg((data,), []): the same one syscall, without
        # building a message header in Python (3 us less per REPLY here)
        sent = sock.send(data)
    if sent != len(data):  # SOCK_SEQPACKET sends whole records or fails
        raise ProtocolError(f"short send of a record: {sent} of {len(data)} bytes")


def send_request(sock: socket.socket, encode: Callable[..., bytes], req_id: int, *args: Any, **kwargs: Any) -> None:
    """Encode a request record with `encode(req_id, *args, **kwargs)` and
    send it: a client's one call into the codec per request."""
    send_record(sock, encode(req_id, *args, **kwargs))


def send_answer(sock: socket.socket, allocation_id: int, page_ids: list[int], fds: list[int] | tuple[int, ...],
                req_id: int, held_bytes: int) -> int:
    """An ALLOCATE's answer when it fits one PAGES record: the PAGES (with
    the fds), then the REPLY, each straight into the socket. Returns the
    records sent: 2, or fewer when the socket had no room or failed (0:
    nothing was sent; 1: the PAGES went, the REPLY is the caller's to
    send). Never blocks on a non-blocking socket and raises nothing for a
    full or failed one: the caller's slow path says why."""
    if not 1 <= len(page_ids) <= MAX_FDS:
        return 0
    try:
        send_record(sock, encode_pages(allocation_id, 0, len(page_ids), page_ids), fds)
    except OSError:
        return 0
    try:
        send_record(sock, encode_reply(req_id, 0, held_bytes))
    except OSError:
        return 1
    return 2


# The daemon's hot path (recv_request): the two requests a client sends on
# every grow and trim, in their common 40-byte form, read with one unpack:
# header, req_id, then ALLOCATE's num_pages, flags, wait_timeout_ms and
# device_len (0: the first device), or FREE's count (1), flags, page id.
_HOT = struct.Struct("<IHHIIQIIQ")
HOT_SIZE = _HOT.size  # 40
_HOT_LEN = HOT_SIZE - HEADER_SIZE


def decode_hot(data: bytes) -> tuple | None:
    """A one-page FREE or an ALLOCATE without a device name, as a plain
    tuple: (REQ_ALLOCATE, req_id, num_pages, flags, wait_timeout_ms) or
    (REQ_FREE, req_id, page_id, flags). None for anything else (decode() then
    parses it, and classifies any fault). Meant for records that came with
    no descriptors and no MSG_TRUNC/MSG_CTRUNC; what it accepts, decode()
    reads the same way (tests/test_fdchannel.py checks it on every vector)."""
    if len(data) != HOT_SIZE:
        return None
    magic, version, kind, length, _, req, a, b, c = _HOT.unpack(data)
    if magic != MAGIC or version != VERSION or length != _HOT_LEN:
        return None
    if kind == REQ_ALLOCATE:
        if c >> 32:  # device_len > 0: decode() reads the name
            return None
        return (REQ_ALLOCATE, req, a, b, c)
    if kind == REQ_FREE and a == 1:
        return (REQ_FREE, req, c, b)
    return None


def recv_request(sock: socket.socket, max_size: int = MAX_CLIENT_RECORD) -> tuple | Record | None:
    """The daemon's read of one record from a client: decode_hot's tuple for
    the common requests, else what recv_record returns (a Record, None at
    end of stream; ProtocolError / MalformedRequest as there)."""
    data, ancdata, flags, _ = sock.recvmsg(max_size + 1, _FD_SPACE, _MSG_CMSG_CLOEXEC)
    if not ancdata and not flags & _CUT:  # (the kernel echoes MSG_CMSG_CLOEXEC in flags)
        hot = decode_hot(data)
        if hot is not None:
            return hot
    return _parse_received(data, ancdata, flags)


def recv_record(sock: socket.socket, max_size: int = MAX_RECORD) -> Record | None:
    """Receive and parse one record; None at end of stream. Descriptors of a
    malformed record are closed before ProtocolError is raised."""
    data, ancdata, flags, _ = sock.recvmsg(max_size + 1, _FD_SPACE, _MSG_CMSG_CLOEXEC)
    return _parse_received(data, ancdata, flags)


def _parse_received(data: bytes, ancdata: list, flags: int) -> Record | None:
    fds: list[int] = []
    for level, ctype, cdata in ancdata:
        if level == _SOL_SOCKET and ctype == _SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
            fds.extend(arr)
    if not data and not fds:
        return None
    try:
        return decode(data, fds, bool(flags & _MSG_TRUNC), bool(flags & _MSG_CTRUNC))
    except ProtocolError:
        close_fds(fds)
        raise


def close_fds(fds) -> None:
    import os

    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from the kernel (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)
