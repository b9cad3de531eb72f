"""The closed error taxonomy of kvcached-service. No transport here.

Every failure the daemon reports is one of the classes below. Each class
carries a `Code`, whose numbers are the protocol's status numbers (the same
numbers as gRPC's status codes, so that a REPLY or ERROR record on the fd
channel and a gRPC status mean the same thing). This module imports nothing
of gRPC:

- `status_of(exc)`: the (Code, message) any exception travels as (an
  unexpected exception is INTERNAL). The fd channel encodes errors with it.
- `from_code(code, message)`: the class back from a status number (a REPLY
  or ERROR record, or a gRPC status through the translator).

The two gRPC translators, `to_grpc` (daemon side) and `from_grpc` (client
side), live in `errors_grpc.py`, and nowhere else. tests/test_errors.py
checks that every class survives both round trips.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """Status numbers of the protocol (docs/protocol.md, "Status codes")."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, number: int) -> "Code":
        """The Code of a status number; UNKNOWN for a number outside the table."""
        try:
            return cls(number)
        except ValueError:
            return cls.UNKNOWN


class KVCachedError(Exception):
    """Base class. `code` is the status the error travels as."""

    code: Code = Code.UNKNOWN

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(KVCachedError):
    code = Code.INVALID_ARGUMENT


class NotFound(KVCachedError):
    code = Code.NOT_FOUND


class PermissionDenied(KVCachedError):
    code = Code.PERMISSION_DENIED


class ResourceExhausted(KVCachedError):
    code = Code.RESOURCE_EXHAUSTED


class FailedPrecondition(KVCachedError):
    code = Code.FAILED_PRECONDITION


class Unavailable(KVCachedError):
    code = Code.UNAVAILABLE


class DeadlineExceeded(KVCachedError):
    code = Code.DEADLINE_EXCEEDED


class Internal(KVCachedError):
    code = Code.INTERNAL


class Unknown(KVCachedError):
    code = Code.UNKNOWN


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

_BY_CODE: dict[Code, type[KVCachedError]] = {cls.code: cls for cls in ALL_ERRORS}


def status_of(err: BaseException) -> tuple[Code, str]:
    """The (code, message) an exception travels as, on any transport."""
    if isinstance(err, KVCachedError):
        return err.code, err.message
    return Code.INTERNAL, f"internal error: {type(err).__name__}: {err}"


def from_code(code: int, message: str) -> KVCachedError:
    """The taxonomy class for a status number (never OK): an ERROR or REPLY
    record, or a gRPC status through errors_grpc.from_grpc. A number
    outside the taxonomy gives Unknown, with the message kept."""
    return _BY_CODE.get(Code.of(code), Unknown)(message or Code.of(code).name)
