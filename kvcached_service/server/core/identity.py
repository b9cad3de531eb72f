"""Who is asking: the caller checks of the core (daemon.py).

A request names its caller as a `Who`: a Session its own fd channel vouches
for (the kernel named the sender), or a `Bearer` (a SessionRef from gRPC,
with the uid the control socket's front door saw). Identity turns either
into the Session a request acts for, or refuses it:
- a SessionRef is good only with its token and only for the uid that opened
  the session;
- a Bearer's page operations are refused unless the daemon runs with
  --grpc-page-ops;
- OpenSession and ResumeSession bind an fd channel found by its secret,
  only for a caller of the channel's uid;
- admin requests need an admin session (admin_uids), RequestShrink an admin
  or a session of the target's uid.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Union

from ... import errors
from ...config import Settings
from .sessions import PortDirectory, Session, SessionPort, Tombstones


@dataclass(frozen=True)
class Bearer:
    """A SessionRef as gRPC carries it, and the uid of the caller as the
    kernel named it to the control socket's front door (None: a trusted
    caller that reached grpcio directly, i.e. the daemon's own uid or
    root). A SessionRef is good only for the uid that opened the session."""

    id: int
    token: bytes
    uid: int | None = None


Who = Union[Session, Bearer]


class Identity:
    """The caller checks over the core's live sessions (the Daemon's own
    dict and tombstones, shared, not copied) and the fd channel adapter's
    unbound channels (`ports`, set when the adapter attaches)."""

    def __init__(self, sessions: dict[int, Session], tombstones: Tombstones, settings: Settings):
        self.sessions = sessions
        self.tombstones = tombstones
        self.settings = settings
        self.ports: PortDirectory | None = None

    def target(self, sid: int) -> Session:
        """The live session `sid` (an admin request's target)."""
        s = self.sessions.get(sid)
        if s is None:
            reason = self.tombstones.get(sid)
            if reason is not None:
                raise errors.FailedPrecondition(f"session {sid} is closed ({reason})")
            raise errors.NotFound(f"no session {sid}")
        return s

    def resolve(self, who: Who, op: str, mutating: bool = True) -> Session:
        """The session a request acts for. A Session comes vouched by its fd
        channel; a Bearer is checked (token) and, for requests that change
        pages, refused unless grpc_page_ops."""
        if isinstance(who, Session):
            if who.closed:
                raise errors.FailedPrecondition(f"session {who.id} is closed")
            return who
        if mutating and self.settings.page_ops_on_channel_only:
            # refused whatever the SessionRef; but never tell another uid more than PERMISSION_DENIED
            target = self.sessions.get(who.id)
            if target is not None:
                self.check_uid(who.uid, target)
            raise errors.FailedPrecondition(
                f"this daemon serves {op} only as a request on the session's fd channel, where the kernel vouches "
                "for the sender (channel_ops_only, the default; kvcached-serve --grpc-page-ops serves it over gRPC too); "
                "see docs/protocol.md"
            )
        return self.session(who.id, who.token, who.uid)

    def directory(self) -> PortDirectory:
        """The fd channel adapter (Unavailable before it attaches)."""
        if self.ports is None:
            raise errors.Unavailable("the fd channel is not serving yet")
        return self.ports

    def port(self, caller_uid: int | None, secret: bytes, rpc: str) -> SessionPort:
        """The unbound fd channel of `secret`, for OpenSession or
        ResumeSession. The session's identity is its fd channel's peer: the
        gRPC caller that binds it must be of the same uid."""
        port = self.directory().find(secret)
        if caller_uid is not None and caller_uid != port.uid:
            raise errors.PermissionDenied(
                f"{rpc} comes from uid {caller_uid}, but the fd channel of that secret belongs to uid {port.uid}: "
                "call it from the process (uid) that connected the channel")
        return port

    @staticmethod
    def check_uid(caller_uid: int | None, s: Session) -> None:
        """A SessionRef is good only for the uid that opened the session."""
        if caller_uid is not None and caller_uid != s.uid:
            who = f"the caller's ({caller_uid})" if caller_uid >= 0 else "a caller whose connection is gone"
            raise errors.PermissionDenied(
                f"session {s.id} belongs to another uid than {who}: a SessionRef is good only for the uid that opened the session")

    def session(self, ref_id: int, token: bytes, caller_uid: int | None = None) -> Session:
        """The session a SessionRef names; checks the caller's uid (when the
        front door named it) and the token."""
        if not ref_id:
            raise errors.InvalidArgument("session is required (SessionRef with id and token)")
        s = self.target(ref_id)
        self.check_uid(caller_uid, s)
        if not hmac.compare_digest(s.token, token):
            raise errors.PermissionDenied(f"token does not match session {ref_id}")
        return s

    def admin_session(self, ref_id: int, token: bytes, caller_uid: int | None = None) -> Session:
        s = self.session(ref_id, token, caller_uid)
        if not s.admin:
            raise errors.PermissionDenied(f"session {s.id} (uid {s.uid}) is not an admin session (admin_uids)")
        return s

    def visible_sessions(self, s: Session) -> list[Session]:
        """The sessions GetStats shows to s: every session for an admin;
        otherwise s itself first, then the other sessions of the same uid.
        Same-uid visibility is safe: that uid can already ptrace, signal or
        read the memory of those processes; it is what lets Ollama (one uid)
        see its own llama-server children without being made an admin."""
        if s.admin:
            return list(self.sessions.values())
        return [s] + [x for x in self.sessions.values() if x.uid == s.uid and x is not s]

    def shrinker_session(self, ref_id: int, token: bytes, target_sid: int, caller_uid: int | None = None) -> Session:
        """The session a RequestShrink comes from: an admin, or a session of
        the target's own uid (asking one's own processes to give memory back
        needs no more than the uid already has)."""
        s = self.session(ref_id, token, caller_uid)
        if s.admin:
            return s
        target = self.target(target_sid)
        if target.uid != s.uid:
            raise errors.PermissionDenied(
                f"session {s.id} (uid {s.uid}) may only shrink sessions of its own uid "
                f"(session {target_sid} is uid {target.uid}) unless it is an admin session (admin_uids)")
        return s
