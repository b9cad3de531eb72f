"""The gRPC health service, with a cap on Health.Watch streams per uid.

grpcio's HealthServicer serves Check and Watch to anyone who reaches the
control socket. A Watch is a call in flight for as long as the client
likes, so its connection never counts as idle (grpc_idle_timeout): a uid
could hold connections with a Watch on each for ever. Here each uid that is
not an admin may have at most `max_health_watches_per_uid` Watch streams
open; past that a Watch is answered RESOURCE_EXHAUSTED naming the limit
(Check is never limited: it is what probes use). The caller is named by the
control socket's front door (control.py), as for every other rpc.
"""

from __future__ import annotations

import logging

from grpc_health.v1 import health

from ... import errors, errors_grpc
from ...config import Settings
from .control import ControlFront

log = logging.getLogger("kvcached.health")


class HealthService(health.aio.HealthServicer):
    def __init__(self, settings: Settings, front: ControlFront):
        super().__init__()
        self._settings = settings
        self._front = front
        self.watches_by_uid: dict[int, int] = {}
        self.refused_total = 0

    async def Watch(self, request, context) -> None:
        peer = self._front.peer(context.peer())
        uid = peer.uid if peer is not None else None  # None: the daemon's own uid or root, past the front door
        if uid is not None and not self._settings.is_admin(uid):
            cap = self._settings.max_health_watches_per_uid
            have = self.watches_by_uid.get(uid, 0)
            if have >= cap:
                self.refused_total += 1
                await context.abort(*errors_grpc.to_grpc(errors.ResourceExhausted(
                    f"kvcached: uid {uid} already has {have} Health.Watch streams open "
                    f"(max_health_watches_per_uid={cap}); use Health.Check to poll")))
        if uid is not None:
            self.watches_by_uid[uid] = self.watches_by_uid.get(uid, 0) + 1
        try:
            await super().Watch(request, context)
        finally:
            if uid is not None:
                n = self.watches_by_uid[uid] - 1
                if n:
                    self.watches_by_uid[uid] = n
                else:
                    del self.watches_by_uid[uid]
