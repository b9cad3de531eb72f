"""The daemon's standard gRPC health service, from the client side."""

from __future__ import annotations

import os
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(socket: str, timeout: float = 1.0, service: str = "") -> bool:
    """True when the daemon on `socket` answers SERVING."""
    if not os.path.exists(socket):
        return False
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(socket: str, timeout: float = 30.0, alive: Callable[[], bool] | None = None, interval: float = 0.05) -> bool:
    """Wait until the daemon on `socket` is SERVING. Returns False on
    timeout, or as soon as `alive()` says the daemon process is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        if is_serving(socket):
            return True
        time.sleep(interval)
    return False
