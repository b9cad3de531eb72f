"""kvcachedctl: look at and steer a running kvcached-serve.

    kvcachedctl stats [--json]            pool numbers per device
    kvcachedctl sessions [--json]         every session (admin)
    kvcachedctl top [--interval S] [--iterations N]
    kvcachedctl set-limits SESSION [--guaranteed SIZE] [--max SIZE] [--priority N]   (admin)
    kvcachedctl shrink SESSION --to SIZE [--timeout-ms MS] [--no-wait]              (admin)
    kvcachedctl plan MODEL|FILE.gguf [--ctx N] [--parallel N] [--page-size SIZE] [--json]
    kvcachedctl health                    exit 0 iff the daemon's health service says SERVING

The socket: --socket (before or after the command), else
$OLLAMA_KVCACHED_SOCKET, else $KVCACHED_SOCKET, else /tmp/kvcached.sock (or
/run/kvcached/kvcached.sock when only that one exists, as under systemd): the
order every kvcached client uses (docs/operations.md says why). SESSION is a
session id or a unique session name.

Before any gRPC call the socket path is checked, so a missing socket, a
directory or socket the user may not open, a file that is not a socket and a
stale socket nobody listens on are each named at once (no timeout to wait).

Exit codes: 0 success, 1 the daemon refused or failed (the message says
why), 2 bad usage, 3 the daemon is not reachable / not serving.
"""

from __future__ import annotations

import argparse
import errno
import grp
import json
import os
import pwd
import socket as _socket
import stat
import sys
import time
from dataclasses import asdict
from typing import Callable, TextIO

from .. import __version__, errors
from ..config import format_size
from .plan import PlanError, format_plan, plan_model, table

DEFAULT_SOCKET = "/tmp/kvcached.sock"
SYSTEMD_SOCKET = "/run/kvcached/kvcached.sock"
SESSION_NAME = "kvcachedctl"

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


class CtlError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.message = message
        self.code = code


# The order every client reads them in (Go, C, the llama.cpp hook, Python):
# the Ollama-specific variable first, so a generic KVCACHED_SOCKET that leaks
# into Ollama's environment never redirects Ollama and its runners.
SOCKET_ENV_VARS = ("OLLAMA_KVCACHED_SOCKET", "KVCACHED_SOCKET")


def socket_source(arg: str | None, env: dict | None = None) -> tuple[str, str]:
    """(path, where it came from: '--socket', '$VAR' or 'default')."""
    env = os.environ if env is None else env
    if arg:
        return arg, "--socket"
    for var in SOCKET_ENV_VARS:
        if env.get(var):
            return env[var], f"${var}"
    if not os.path.exists(DEFAULT_SOCKET) and os.path.exists(SYSTEMD_SOCKET):
        return SYSTEMD_SOCKET, "default"
    return DEFAULT_SOCKET, "default"


def resolve_socket(arg: str | None, env: dict | None = None) -> str:
    return socket_source(arg, env)[0]


# ---- first contact: name the cause before any gRPC call -----------------------
def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"owner {user}, group {group}, mode {stat.S_IMODE(st.st_mode):04o}"


def _join_hint(st: os.stat_result) -> str:
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    groups = sorted(set(os.getgroups()) | {os.getgid()})
    return (f"you are uid {os.getuid()}, groups {','.join(map(str, groups))}: join group '{group}' "
            f"(the daemon's --socket-group; log in again afterwards) or run as root")


def _blocked_dir(path: str) -> tuple[str, os.stat_result] | None:
    """The first directory on the way to `path` this process may not enter."""
    d = os.path.dirname(os.path.abspath(path))
    parts = []
    while True:
        parts.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(parts):
        try:
            st = os.stat(d)
        except OSError:
            return None
        if not os.access(d, os.X_OK):
            return d, st
    return None


def probe_socket(path: str, origin: str, timeout: float) -> None:
    """Raise CtlError(EXIT_UNREACHABLE) naming why nobody can be reached on
    `path`; return when something accepts a connection there."""
    where = f"{path} (from {origin})" if origin != "--socket" else path
    try:
        st = os.stat(path)
    except PermissionError:
        blocked = _blocked_dir(path)
        if blocked:
            d, dst = blocked
            raise CtlError(f"permission denied: cannot enter {d} ({_owner(dst)}) to reach {where}; {_join_hint(dst)}",
                           EXIT_UNREACHABLE) from None
        raise CtlError(f"permission denied on {where}", EXIT_UNREACHABLE) from None
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        what = f"no such directory {parent}" if not os.path.isdir(parent) else "no such file"
        raise CtlError(
            f"no kvcached socket at {where}: {what}. Is kvcached-serve running, and with this --socket? "
            f"(give --socket, or set OLLAMA_KVCACHED_SOCKET / KVCACHED_SOCKET)", EXIT_UNREACHABLE) from None
    except OSError as exc:
        raise CtlError(f"cannot look at {where}: {exc.strerror}", EXIT_UNREACHABLE) from None
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a regular file" if stat.S_ISREG(st.st_mode) else "not a socket"
        raise CtlError(f"{where} is {kind}, not a Unix socket: give the path kvcached-serve's --socket names",
                       EXIT_UNREACHABLE)
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except PermissionError:
        raise CtlError(f"permission denied on the socket {where} ({_owner(st)}); {_join_hint(st)}",
                       EXIT_UNREACHABLE) from None
    except ConnectionRefusedError:
        raise CtlError(f"nothing listens on {where}: a stale socket file (the daemon is not running, or exited "
                       f"without removing it)", EXIT_UNREACHABLE) from None
    except (TimeoutError, _socket.timeout):
        raise CtlError(f"the daemon on {where} does not accept connections within {timeout:g} s (overloaded or hung)",
                       EXIT_UNREACHABLE) from None
    except OSError as exc:
        if exc.errno == errno.EAGAIN:
            raise CtlError(f"the daemon on {where} does not accept connections (its backlog is full)",
                           EXIT_UNREACHABLE) from None
        raise CtlError(f"cannot connect to {where}: {exc.strerror}", EXIT_UNREACHABLE) from None
    finally:
        s.close()


# ---- talking to the daemon --------------------------------------------------
def connect(args):
    from ..client import Client

    path, origin = socket_source(args.socket)
    probe_socket(path, origin, args.timeout)
    try:
        return Client.connect(path, timeout=args.timeout)
    except errors.Unavailable:
        raise CtlError(f"the daemon on {path} accepts connections but does not answer gRPC within "
                       f"{args.timeout:g} s (hung, overloaded, or not kvcached-serve)", EXIT_UNREACHABLE) from None
    except errors.KVCachedError as exc:
        raise CtlError(f"{path}: {exc.message}", EXIT_UNREACHABLE) from None


class AdminSession:
    """A short-lived session of kvcachedctl itself; admin rpcs and the
    all-sessions view need one (the daemon decides from SO_PEERCRED)."""

    def __init__(self, client, command: str, require_admin: bool = True):
        try:
            self.session = client.open_session(SESSION_NAME)
        except errors.PermissionDenied as exc:
            raise CtlError(f"{command}: the daemon refused a session: {exc.message}") from None
        if require_admin and not self.session.admin:
            self.session.close()
            raise CtlError(
                f"{command} needs an admin session: run it as root or as the daemon's user "
                f"(or a uid in the daemon's admin_uids); you are uid {os.getuid()}"
            )

    def __enter__(self):
        return self.session

    def __exit__(self, *exc):
        self.session.close()


def find_session(stats, ref: str, own_id: int):
    others = [s for s in stats.sessions if s.id != own_id]
    if ref.isdigit():
        for s in others:
            if s.id == int(ref):
                return s
        raise CtlError(f"no open session {ref}")
    named = [s for s in others if s.name == ref]
    if not named:
        raise CtlError(f"no open session named {ref!r}")
    if len(named) > 1:
        raise CtlError(f"{len(named)} sessions are named {ref!r} (ids {', '.join(str(s.id) for s in named)}): give an id")
    return named[0]


# ---- rendering --------------------------------------------------------------
def stats_dict(client, stats) -> dict:
    devs = {d.uuid: d for d in client.devices}
    return {
        "socket": client.path,
        "version": client.info.version,
        "backend": client.info.backend,
        "uptime_seconds": stats.uptime_seconds,
        "sessions_open": stats.sessions_open,
        "total": asdict(stats.total),
        "devices": [
            {"uuid": u, "name": devs[u].name if u in devs else "", "kind": devs[u].kind if u in devs else "",
             "total_bytes": devs[u].total_bytes if u in devs else 0, **asdict(p)}
            for u, p in stats.devices.items()
        ],
    }


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def render_stats(client, stats, own: int = 0) -> list[str]:
    """own: sessions kvcachedctl itself holds (not counted as open)."""
    info = client.info
    n = stats.sessions_open - own
    lines = [
        f"kvcached {info.version} on {client.path}: backend {info.backend}, up {_duration(stats.uptime_seconds)}, "
        f"{n} session{'s' if n != 1 else ''} open",
        "",
    ]
    devs = {d.uuid: d for d in client.devices}
    header = ("device", "budget", "in use", "standby", "pooled", "free", "used", "page", "pages created", "released")
    rows = []
    for uuid, p in stats.devices.items():
        rows.append((uuid, format_size(p.budget_bytes), format_size(p.in_use_bytes), format_size(p.standby_bytes),
                     format_size(p.pooled_bytes),
                     format_size(p.free_bytes), _pct(p.in_use_bytes, p.budget_bytes), format_size(p.page_size),
                     str(p.pages_created_total), str(p.pages_released_total)))
    if len(stats.devices) > 1:
        t = stats.total
        rows.append(("total", format_size(t.budget_bytes), format_size(t.in_use_bytes), format_size(t.standby_bytes),
                     format_size(t.pooled_bytes),
                     format_size(t.free_bytes), _pct(t.in_use_bytes, t.budget_bytes), "", str(t.pages_created_total),
                     str(t.pages_released_total)))
    lines += table(header, rows)
    names = [f"  {u}: {d.name} ({d.kind}, {format_size(d.total_bytes)})" for u, d in devs.items()]
    if names:
        lines += ["", *names]
    return lines


def session_dicts(sessions) -> list[dict]:
    return [asdict(s) for s in sessions]


def render_sessions(sessions, own_id: int | None = None) -> list[str]:
    header = ("id", "name", "pid", "uid", "held", "standby", "guaranteed", "max", "prio", "allocs", "frees",
              "reclaim asked/ignored", "idle")
    now = time.time()
    rows = []
    for s in sorted(sessions, key=lambda s: (-s.held_bytes, s.id)):
        rows.append((
            str(s.id) + ("*" if s.id == own_id else ""),
            s.name,
            str(s.pid),
            str(s.uid),
            format_size(s.held_bytes),
            format_size(s.standby_bytes),
            format_size(s.guaranteed_bytes),
            format_size(s.max_bytes) if s.max_bytes else "budget",
            str(s.priority),
            str(s.allocations_total),
            str(s.frees_total),
            f"{s.reclaim_requests}/{s.reclaim_ignored}",
            _duration(max(0.0, now - s.last_active_unix)),
        ))
    out = table(header, rows, right={0, *range(2, 13)})
    if not rows:
        out.append("(no sessions)")
    if own_id is not None:
        out.append(f"(* = this kvcachedctl's own session)")
    return out


def _duration(sec: float) -> str:
    sec = int(sec)
    if sec < 60:
        return f"{sec}s"
    if sec < 3600:
        return f"{sec // 60}m{sec % 60:02d}s"
    if sec < 86400:
        return f"{sec // 3600}h{sec % 3600 // 60:02d}m"
    return f"{sec // 86400}d{sec % 86400 // 3600:02d}h"


# ---- commands ---------------------------------------------------------------
def cmd_stats(args, out: TextIO) -> int:
    with connect(args) as client:
        stats = client.stats()
        if args.json:
            json.dump(stats_dict(client, stats), out, indent=2, sort_keys=True)
            out.write("\n")
        else:
            out.write("\n".join(render_stats(client, stats)) + "\n")
    return EXIT_OK


def cmd_sessions(args, out: TextIO) -> int:
    with connect(args) as client, AdminSession(client, "sessions") as me:
        sessions = [s for s in me.stats().sessions if args.all or s.id != me.id]
        if args.json:
            json.dump(session_dicts(sessions), out, indent=2, sort_keys=True)
            out.write("\n")
        else:
            out.write("\n".join(render_sessions(sessions, me.id if args.all else None)) + "\n")
    return EXIT_OK


def cmd_top(args, out: TextIO, sleep: Callable[[float], None] = time.sleep) -> int:
    clear = out.isatty() and not args.no_clear
    with connect(args) as client:
        me = None
        note = ""
        try:
            me = client.open_session(SESSION_NAME)
            if not me.admin:
                note = f"(sessions: not shown; uid {os.getuid()} is not an admin of this daemon)"
        except errors.KVCachedError as exc:
            note = f"(sessions: not shown: {exc.message})"
        try:
            i = 0
            while args.iterations == 0 or i < args.iterations:
                if i:
                    sleep(args.interval)
                stats = me.stats() if me is not None else client.stats()
                lines = render_stats(client, stats, own=1 if me is not None else 0)
                lines.append("")
                if me is not None and me.admin:
                    lines += render_sessions([s for s in stats.sessions if s.id != me.id])
                else:
                    lines.append(note)
                stamp = time.strftime("%H:%M:%S")
                frame = f"kvcachedctl top  {stamp}  (every {args.interval:g}s, Ctrl-C to quit)\n" + "\n".join(lines) + "\n"
                out.write(("\x1b[H\x1b[2J" if clear else ("\n" if i else "")) + frame)
                out.flush()
                i += 1
        except KeyboardInterrupt:
            pass
        finally:
            if me is not None:
                me.close()
    return EXIT_OK


def cmd_set_limits(args, out: TextIO) -> int:
    limits = {}
    if args.guaranteed is not None:
        limits["guaranteed_bytes"] = args.guaranteed
    if args.max is not None:
        limits["max_bytes"] = args.max
    if args.priority is not None:
        limits["priority"] = args.priority
    if not limits:
        raise CtlError("set-limits: give at least one of --guaranteed, --max, --priority", EXIT_USAGE)
    with connect(args) as client, AdminSession(client, "set-limits") as me:
        target = find_session(me.stats(), args.session, me.id)
        s = me.set_limits(target.id, **limits)
        if args.json:
            json.dump(asdict(s), out, indent=2, sort_keys=True)
            out.write("\n")
        else:
            out.write(
                f"session {s.id} '{s.name}': guaranteed {format_size(s.guaranteed_bytes)}, "
                f"max {format_size(s.max_bytes) if s.max_bytes else 'the device budget'}, priority {s.priority}\n"
            )
    return EXIT_OK


def cmd_shrink(args, out: TextIO) -> int:
    with connect(args) as client, AdminSession(client, "shrink") as me:
        target = find_session(me.stats(), args.session, me.id)
        r = me.shrink(target.id, args.to, args.timeout_ms, wait=not args.no_wait)
        if not r.pages_requested:
            out.write(f"session {target.id} '{target.name}' holds {format_size(target.held_bytes)}: "
                      f"already at or below {format_size(args.to)} (or its guarantee); nothing asked\n")
            return EXIT_OK
        out.write(f"asked session {target.id} '{target.name}' (holding {format_size(target.held_bytes)}) "
                  f"to give back {r.pages_requested} pages, down to {format_size(args.to)}\n")
        for o in r.reclaims:
            out.write(f"  {o.device}: {_outcome(o)}\n")
    return EXIT_OK


def _outcome(o) -> str:
    """One reclaim request's outcome, as kvcachedctl shrink prints it."""
    books = f"the daemon's books: it holds {format_size(o.held_bytes)}"
    if o.answered:
        said = f"answered: gave back {format_size(o.bytes_given)}, keeps {format_size(o.bytes_kept)}"
        return said + (f" ({o.reason})" if o.reason else "") + f"; {books}"
    return {
        "MET": f"gave back what was asked; {books}",
        "EXPIRED": f"neither answered nor gave back everything before the deadline; {books}",
        "ENDED": "the session ended",
        "OPEN": f"no answer yet (not waited for); {books}",
    }.get(o.state, f"{o.state}; {books}")


def cmd_plan(args, out: TextIO) -> int:
    try:
        plan = plan_model(args.model, args.ctx, args.parallel, args.page_size)
    except PlanError as exc:
        raise CtlError(str(exc)) from None
    if args.json:
        json.dump(plan.to_dict(), out, indent=2, sort_keys=True)
        out.write("\n")
    else:
        out.write(format_plan(plan) + "\n")
    return EXIT_OK


def cmd_health(args, out: TextIO) -> int:
    """The gRPC health service (not GetInfo): what Docker HEALTHCHECK and a
    Kubernetes exec probe run."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    path, origin = socket_source(args.socket)
    probe_socket(path, origin, args.timeout)
    try:
        with grpc.insecure_channel(f"unix:{path}", options=[("grpc.enable_http_proxy", 0)]) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as exc:
        out.write(f"{path}: not healthy: {exc.code().name}: {exc.details()}\n")
        return EXIT_UNREACHABLE
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    out.write(f"{path}: {status}\n")
    return EXIT_OK if resp.status == health_pb2.HealthCheckResponse.SERVING else EXIT_UNREACHABLE


# ---- argument parsing -------------------------------------------------------
def parse_size(text: str) -> int:
    """'2MiB' -> 2097152, '1.5GB' -> 1500000000, '4096' -> 4096 (pydantic's ByteSize)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text.strip()))
    except ValidationError:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512MiB, 8GiB, 20GB)") from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return v


SOCKET_HELP = f"daemon socket (default: $OLLAMA_KVCACHED_SOCKET, then $KVCACHED_SOCKET, then {DEFAULT_SOCKET})"
TIMEOUT_HELP = "seconds to wait for the daemon (default 5)"


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    # --socket and --timeout go before or after the command. After it they
    # default to SUPPRESS so that they do not overwrite a value given before.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", default=argparse.SUPPRESS, help=SOCKET_HELP)
    common.add_argument("--timeout", type=_positive_float, default=argparse.SUPPRESS, help=TIMEOUT_HELP)

    ap = argparse.ArgumentParser(prog="kvcachedctl", description="Look at and steer a running kvcached-serve.")
    ap.add_argument("--version", action="version", version=f"kvcachedctl {__version__}")
    ap.add_argument("--socket", default=None, help=SOCKET_HELP)
    ap.add_argument("--timeout", type=_positive_float, default=5.0, help=TIMEOUT_HELP)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("stats", parents=[common], help="pool numbers per device")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_stats)

    p = sub.add_parser("sessions", parents=[common], help="every session with its usage and limits (admin)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--all", action="store_true", help="include kvcachedctl's own session")
    p.set_defaults(fn=cmd_sessions)

    p = sub.add_parser("top", parents=[common], help="live view of devices and sessions")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--iterations", type=int, default=0, help="stop after N frames (default: until Ctrl-C)")
    p.add_argument("--no-clear", action="store_true", help="append frames instead of redrawing the screen")
    p.set_defaults(fn=cmd_top)

    p = sub.add_parser("set-limits", parents=[common], help="change a session's guarantee, maximum or priority (admin)")
    p.add_argument("session", help="session id or unique name")
    p.add_argument("--guaranteed", type=_size, help="guaranteed bytes per device (512MiB, 2GiB, ...)")
    p.add_argument("--max", type=_size, help="maximum bytes per device (0 = the device budget)")
    p.add_argument("--priority", type=int, help="reclaim priority (lower gives pages back first)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_set_limits)

    p = sub.add_parser("shrink", parents=[common], help="ask a session to give pages back (admin)")
    p.add_argument("session", help="session id or unique name")
    p.add_argument("--to", type=_size, required=True, metavar="SIZE", help="bytes per device the session may keep (never below its guarantee)")
    p.add_argument("--timeout-ms", type=int, default=0, help="how long it has (default: the daemon's reclaim timeout)")
    p.add_argument("--no-wait", action="store_true",
                   help="return once asked; by default wait until the session answers, gives the pages back, or the time is up")
    p.set_defaults(fn=cmd_shrink)

    p = sub.add_parser("plan", help="KV-cache memory of a model (Ollama name or GGUF file)")
    p.add_argument("model", help="Ollama model name (llama3.1:8b) or a GGUF file path")
    p.add_argument("--ctx", type=_positive_int, default=4096, help="context length per sequence (default 4096)")
    p.add_argument("--parallel", type=_positive_int, default=1, help="parallel sequences (default 1)")
    p.add_argument("--page-size", type=_size, default=2 << 20, help="daemon page size (default 2MiB)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("health", parents=[common], help="exit 0 iff the daemon's gRPC health service says SERVING")
    p.add_argument("--service", default="", help="health service name (default: the whole server)")
    p.set_defaults(fn=cmd_health)
    return ap


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args, out)
    except CtlError as exc:
        print(f"kvcachedctl {args.command}: {exc.message}", file=sys.stderr)
        return exc.code
    except errors.PermissionDenied as exc:
        print(f"kvcachedctl {args.command}: permission denied: {exc.message}", file=sys.stderr)
        return EXIT_FAIL
    except errors.Unavailable as exc:
        print(f"kvcachedctl {args.command}: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except errors.KVCachedError as exc:
        print(f"kvcachedctl {args.command}: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return EXIT_FAIL
    except BrokenPipeError:
        return EXIT_OK
