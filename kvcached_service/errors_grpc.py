"""The two translators between the error taxonomy (errors.py) and gRPC.

- `to_grpc(exc)`: the daemon side. The status code and message any
  exception is answered with (service.py aborts every failed rpc, unary or
  Watch, through it).
- `from_grpc(rpc_error)`: the client side. The taxonomy class for a failed
  rpc (the Python client's gRPC adapter raises through it).

`grpc_code` / `code_of` convert one code between the two enums (a status is
the same number on both sides); the metrics interceptor uses `code_of` to
name the code of an rpc it observed. There is no other mapping.
"""

from __future__ import annotations

from typing import Any

import grpc

from .errors import Code, KVCachedError, from_code, status_of

_TO_GRPC: dict[Code, grpc.StatusCode] = {Code(sc.value[0]): sc for sc in grpc.StatusCode}


def grpc_code(code: Code) -> grpc.StatusCode:
    return _TO_GRPC[code]


def code_of(status: Any) -> Code:
    """A grpc.StatusCode, the integer cygrpc uses inside aio, or None (OK)."""
    if status is None:
        return Code.OK
    if isinstance(status, grpc.StatusCode):
        return Code.of(status.value[0])
    if isinstance(status, int):
        return Code.of(status)
    return Code.UNKNOWN


def to_grpc(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The daemon side: the status code and message an exception travels as."""
    code, message = status_of(err)
    return grpc_code(code), message


def from_grpc(err: grpc.RpcError) -> KVCachedError:
    """The client side: the taxonomy class for a failed rpc."""
    status = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    code = code_of(status)
    return from_code(code if code != Code.OK else Code.UNKNOWN, details or code.name)
