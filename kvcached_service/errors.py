"""The closed error taxonomy of kvcached-service, and its one mapping to gRPC.

Every failure the daemon reports is one of the classes below. The daemon
raises them anywhere; `to_status` turns one into a gRPC status code in
exactly one place (the servicer's wrapper, and the fd channel's replies), and
`from_rpc_error` / `from_code` turn a gRPC error or a status number back into
the same class on the client side. A round-trip test
(tests/test_errors.py) keeps the two directions in step.
"""

from __future__ import annotations

import grpc


class KVCachedError(Exception):
    """Base class. `code` is the gRPC status code the error travels as."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(KVCachedError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVCachedError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(KVCachedError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KVCachedError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KVCachedError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(KVCachedError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KVCachedError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(KVCachedError):
    code = grpc.StatusCode.INTERNAL


class Unknown(KVCachedError):
    code = grpc.StatusCode.UNKNOWN


ALL_ERRORS: tuple[type[KVCachedError], ...] = (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unavailable,
    DeadlineExceeded,
    Internal,
)

_BY_CODE: dict[grpc.StatusCode, type[KVCachedError]] = {cls.code: cls for cls in ALL_ERRORS}
_BY_NUMBER: dict[int, type[KVCachedError]] = {cls.code.value[0]: cls for cls in ALL_ERRORS}


def to_status(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The daemon side: the status code and message an exception travels as."""
    if isinstance(err, KVCachedError):
        return err.code, err.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"


def from_rpc_error(err: grpc.RpcError) -> KVCachedError:
    """The client side: the taxonomy class for a failed rpc."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, Unknown)
    return cls(details or code.name)


def from_code(code: int, message: str) -> KVCachedError:
    """The client side, for a status that arrived as a number (an ERROR or
    REPLY record on the fd channel) rather than as a failed rpc."""
    return _BY_NUMBER.get(code, Unknown)(message)
