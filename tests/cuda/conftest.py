"""Fixtures for the CUDA tests: the test driver (built once per session by
scripts/build-testdriver.sh) and one simulated machine per test."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import uuid

import pytest

from kvtest import libcuda, require_testdriver_features, testdriver_features
from tdkit import ROOT, Sim

BUILD = ROOT / "scripts" / "build-testdriver.sh"


@pytest.fixture(scope="session")
def testdriver() -> pathlib.Path:
    """The libcuda the CUDA tests run on: $KVCACHED_TEST_LIBCUDA when set
    (another driver: tests that need the test driver's private features
    skip, naming them), else build (or find up to date)
    build/testdriver/libcuda.so.1. A build failure fails the tests."""
    if os.environ.get("KVCACHED_TEST_LIBCUDA"):
        lib = libcuda()
        if not lib.exists():
            pytest.fail(f"KVCACHED_TEST_LIBCUDA={lib}: no such file")
        return lib
    proc = subprocess.run([str(BUILD)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"scripts/build-testdriver.sh failed:\n{proc.stdout}\n{proc.stderr}")
    lib = pathlib.Path(proc.stdout.strip().splitlines()[-1])
    assert lib.exists(), lib
    return lib


@pytest.fixture(scope="session")
def cuda_include() -> pathlib.Path:
    proc = subprocess.run([str(BUILD), "--include-dir"], capture_output=True, text=True, timeout=600, check=True)
    inc = pathlib.Path(proc.stdout.strip().splitlines()[-1])
    assert (inc / "cuda.h").exists(), inc
    return inc


@pytest.fixture
def sim(testdriver, tmp_path) -> Sim:
    """A fresh simulated machine: its device state lives on tmpfs (as the
    driver's default does) and is removed afterwards."""
    base = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    state = base / f"kvcached-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    reports = tmp_path / "reports"
    reports.mkdir()
    yield Sim(testdriver, state, reports, private=testdriver_features())
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def needs_testdriver(request):
    """For tests of the test driver itself or that need its knobs, fault
    injection or leak report: skipped, with the reason, on another libcuda.
    The reason is what the closest @pytest.mark.testdriver("...") says the
    test needs (docs/gpu-check.md lists them)."""
    mark = request.node.get_closest_marker("testdriver")
    require_testdriver_features(*(mark.args if mark else ()))
