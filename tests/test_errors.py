"""The error taxonomy (kvcached_service/errors.py) and its two gRPC
translators (errors_grpc.py): every class survives the round trip through
gRPC and through a status number (the fd channel), the taxonomy itself
imports nothing of gRPC, and the codes are the protocol's numbers."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import grpc
import pytest

from kvtest import ROOT
from kvcached_service import errors
from kvcached_service.errors import Code
from kvcached_service.errors_grpc import code_of, from_grpc, to_grpc

SPEC = ROOT / "protos" / "kvcached" / "v1" / "fdchannel.spec.json"


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


@pytest.mark.parametrize("cls", errors.ALL_ERRORS)
def test_error_round_trip(cls):
    # daemon -> gRPC -> client
    code, msg = to_grpc(cls("what went wrong"))
    back = from_grpc(_FakeRpcError(code, msg))
    assert type(back) is cls and back.message == "what went wrong"
    # daemon -> fd channel (a status number) -> client
    number, msg = errors.status_of(cls("what went wrong"))
    assert isinstance(number, int) and number == code.value[0]  # the same number on both transports
    by_number = errors.from_code(number, msg)
    assert type(by_number) is cls and by_number.message == "what went wrong"


def test_unknown_codes():
    assert type(errors.from_code(99, "x")) is errors.Unknown
    assert type(errors.from_code(Code.DATA_LOSS, "d")) is errors.Unknown  # a code outside the taxonomy
    assert errors.from_code(Code.ABORTED, "").message == "ABORTED"  # never an empty message


def test_unexpected_exception_is_internal():
    code, msg = to_grpc(ZeroDivisionError("x"))
    assert code is grpc.StatusCode.INTERNAL and "ZeroDivisionError" in msg
    assert errors.status_of(ZeroDivisionError("x"))[0] is Code.INTERNAL  # the same on the fd channel
    assert isinstance(from_grpc(_FakeRpcError(grpc.StatusCode.DATA_LOSS, "d")), errors.Unknown)


def test_codes_are_grpc_numbers_and_the_spec_table():
    for sc in grpc.StatusCode:
        assert Code(sc.value[0]).name == sc.name
        assert code_of(sc) == Code(sc.value[0]) and code_of(sc.value[0]) == Code(sc.value[0])
    assert code_of(None) is Code.OK
    spec = json.loads(SPEC.read_text())
    assert spec["status_codes"] == {c.name: c.value for c in Code}


def test_the_taxonomy_imports_no_grpc():
    code = "import sys, kvcached_service.errors; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_one_translator_each_way():
    """errors_grpc is the only place in the package that maps between the
    taxonomy and gRPC status codes (containerd's errdefs shape)."""
    pkg = ROOT / "kvcached_service"
    offenders = []
    for path in pkg.rglob("*.py"):
        if "_generated" in path.parts or path.name == "errors_grpc.py":
            continue
        text = path.read_text()
        for needle in ("StatusCode.", ".value[0]", "from_rpc_error", "to_status("):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, offenders
    assert pathlib.Path(pkg / "errors_grpc.py").exists()
