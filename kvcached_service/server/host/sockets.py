"""Unix socket files: refuse a live one, replace a stale one, set permissions.

Used for both sockets (main.py for gRPC, channel.py for the fd channel).
"""

from __future__ import annotations

import logging
import os
import socket
import stat

from ... import errors
from ...config import Settings

log = logging.getLogger("kvcached.daemon")


def prepare_socket_path(path: str) -> None:
    """Refuse to start if another daemon listens on `path`; remove a stale
    socket file nobody listens on; refuse anything that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise errors.FailedPrecondition(f"socket directory {parent} does not exist")
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise errors.FailedPrecondition(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nobody listens
        log.info("removed stale socket %s", path)
        return
    except OSError as exc:
        if exc.errno == 91:  # EPROTOTYPE: a SOCK_SEQPACKET listener; try that type
            probe.close()
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)
                return
        else:
            raise
    finally:
        probe.close()
    raise errors.FailedPrecondition(f"another daemon is listening on {path}; refusing to start")


def apply_socket_permissions(path: str, settings: Settings) -> None:
    os.chmod(path, settings.socket_mode_bits)
    gid = settings.socket_gid
    if gid is not None:
        os.chown(path, -1, gid)
