"""scripts/gpu-check.sh, the one-run verdict, against the CUDA test driver in
each of its strictness modes (tests/cudadriver/README.md): green where the
project's assumptions hold, DIFF rows where the driver's behaviour differs
from the test driver's own default model (the `same` identity mode's
shared inode, the lenient driver's readable exports and fork), and the
verdict line that follows from them. Each run gets its own simulated
machine."""

from __future__ import annotations

import pytest

import json
import os
import pathlib
import shutil
import subprocess
import uuid

from kvtest import testdriver_features as has_private_features
from tdkit import ROOT

# gpu-check.sh in each of the test driver's strictness modes (its knobs): skipped, with the reason, when
# KVCACHED_TEST_LIBCUDA names another libcuda; the default run works on any libcuda
only_on_testdriver = pytest.mark.usefixtures("needs_testdriver")

SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def run_check(testdriver, tmp_path, **extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    base = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    state = base / f"kvc-gpucheck-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "CUDA_VISIBLE", "GPU_CHECK_"))}
    env.update(KVCACHED_LIBCUDA=str(testdriver), KVCACHED_TESTDRV_STATE=str(state), KVCACHED_TESTDRV_MEMORY="1G",
               TMPDIR=str(tmp_path), GPU_CHECK_PAGES="8", GPU_CHECK_KEEP="1")
    env.update(extra)
    try:
        p = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    rows_files = list(tmp_path.glob("kvcached-gpu-check.*/rows.jsonl"))
    assert len(rows_files) == 1, (rows_files, p.stdout, p.stderr)
    rows = [json.loads(line) for line in rows_files[0].read_text().splitlines() if line.strip()]
    return p, rows


def verdicts(rows: list[dict], verdict: str) -> list[str]:
    return [r["check"] for r in rows if r["verdict"] == verdict]


def seen(rows: list[dict], prefix: str) -> str:
    return next(r["seen"] for r in rows if r["check"].startswith(prefix))


IDENTITY = "exported fd: inode (st_dev, st_ino) across exports"
FDTYPE = "exported fd: file type (fstat S_IFMT)"


def last_line(p: subprocess.CompletedProcess) -> str:
    return p.stdout.rstrip().splitlines()[-1]


def test_default_mode_passes_with_tests_and_bench(testdriver, tmp_path):
    """Every stage runs: the probe, the daemon end to end, a behaviour test
    (stage 3 on the test driver only when asked) and the bench."""
    out = tmp_path / "out"
    first = "tests/cuda/test_testdriver.py::test_granularity_alignment_and_offset_zero"  # in tests/cuda/gpu-first.txt
    p, rows = run_check(testdriver, tmp_path, GPU_CHECK_BENCH="allocate64", GPU_CHECK_OUT=str(out),
                        GPU_CHECK_TESTS=f"tests/cuda/test_cuda_backend.py::test_close_releases_pages_the_pool_did_not {first}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert any(line.startswith("PASS: kvcached CUDA path") for line in p.stdout.splitlines()), p.stdout
    assert "FAIL" not in p.stdout, p.stdout
    if has_private_features():
        assert verdicts(rows, "DIFF") == [] and last_line(p) == "PASS", p.stdout
        assert seen(rows, IDENTITY) == "the same for every export" and seen(rows, FDTYPE).startswith("character device")
    else:  # another libcuda: only what an export is may differ from the test driver's default
        diff = verdicts(rows, "DIFF")
        assert all(c.startswith("exported fd: ") for c in diff), diff
        assert last_line(p) == (f"PASS with {len(diff)} DIFF rows" if diff else "PASS"), p.stdout
    assert "2 passed" in seen(rows, "CUDA behaviour tests"), rows
    # the last GPU run's failure among them ran first (tests/cuda/gpu-first.txt), and its row says so
    assert seen(rows, "the last GPU run's failures, run first").startswith("1 tests, 1 passed, 0 failed"), rows
    # the tests' whole record is in GPU_CHECK_OUT: log, JUnit XML, skip list, outcomes in the order they ran
    for name in ("pytest.log", "pytest.xml", "skips.txt", "outcomes.txt", "pytest-report.txt", "table.md", "figures.json"):
        assert (out / name).is_file(), (name, sorted(x.name for x in out.iterdir()))
    assert (out / "outcomes.txt").read_text().split() == ["passed", first, "passed",
                                                          "tests/cuda/test_cuda_backend.py::test_close_releases_pages_the_pool_did_not"]
    assert (out / "skips.txt").read_text().startswith("# 0 of 2 tests skipped")
    figures = json.loads((out / "figures.json").read_text())
    assert figures["tests.passed"]["value"] == 2, figures
    assert seen(rows, "bench: Allocate(64").startswith("daemon warm ")
    # the table: one markdown row per check, and the same checks the rows file has
    table = [line for line in p.stdout.splitlines() if line.startswith("| ") and not line.startswith("| #")]
    assert len(table) == len(rows) > 40


@only_on_testdriver
@pytest.mark.testdriver('its identity modes (KVCACHED_TESTDRV_FD_IDENTITY)')
def test_distinct_identity_is_a_model_difference(testdriver, tmp_path):
    """The test driver's default follows what NVIDIA's driver does (one inode
    for every export, a character device: `chardev`). A driver whose exports
    are a directory per page, one inode each (`distinct`, this driver's old
    default) is a DIFF from that model, not a FAIL (the daemon resumes from
    its page store either way), and the verdict says how many."""
    p, rows = run_check(testdriver, tmp_path, KVCACHED_TESTDRV_FD_IDENTITY="distinct")
    assert p.returncode == 0, p.stdout
    assert verdicts(rows, "FAIL") == [] and sorted(verdicts(rows, "DIFF")) == sorted([IDENTITY, FDTYPE]), p.stdout
    assert seen(rows, IDENTITY) == "distinct per page" and seen(rows, FDTYPE).startswith("directory")
    assert last_line(p) == "PASS with 2 DIFF rows", p.stdout


@only_on_testdriver
@pytest.mark.testdriver('its strictness knobs (ASYNC, DEVICES, CONTEXT_BYTES, OTHER_BYTES, COST)')
def test_every_other_strictness_at_once_passes(testdriver, tmp_path):
    """Copies that land at synchronize, two devices that are not peers,
    hidden per-context memory with another process's memory taken, and
    kvcached's A100 costs, all at once: every check still holds, the probe
    measures the context, sees the other process's memory, refuses the peer
    access and shows the costs."""
    p, rows = run_check(testdriver, tmp_path, KVCACHED_TESTDRV_ASYNC="all", KVCACHED_TESTDRV_DEVICES="2",
                        KVCACHED_TESTDRV_CONTEXT_BYTES="64M", KVCACHED_TESTDRV_OTHER_BYTES="128M",
                        KVCACHED_TESTDRV_COST="a100")
    assert p.returncode == 0, p.stdout + p.stderr
    assert verdicts(rows, "FAIL") == [] and verdicts(rows, "DIFF") == [], p.stdout
    assert seen(rows, "a context's own device memory") == "64 MiB for another process's primary context"
    assert seen(rows, "device memory in use before").startswith("192 MiB of 1024 MiB")  # our context + the other process
    assert seen(rows, "access for device 1").startswith("cuMemSetAccess: CUDA_ERROR_INVALID_DEVICE")
    costs = dict(part.rsplit(" ", 1) for part in seen(rows, "cost per 2 MiB page").split(", "))
    assert float(costs["Create"]) >= 193 and float(costs["SetAccess"]) >= 36 and float(costs["Unmap"]) >= 26, costs


@only_on_testdriver
@pytest.mark.testdriver('its lenient mode (KVCACHED_TESTDRV_STRICT=lenient)')
def test_lenient_driver_shows_as_model_differences(testdriver, tmp_path):
    """On the driver before issue 17 the project's assumptions still hold
    (exit 0), but gpu-check names where that driver differs from the model
    a strict driver follows: that is how a real GPU's differences show."""
    p, rows = run_check(testdriver, tmp_path, KVCACHED_TESTDRV_STRICT="lenient", KVCACHED_TESTDRV_DEVICES="2")
    assert p.returncode == 0, p.stdout
    assert verdicts(rows, "FAIL") == []
    assert seen(rows, "access for device 1").startswith("cuMemSetAccess: CUDA_SUCCESS")  # all devices peers
    assert sorted(verdicts(rows, "DIFF")) == sorted(["driver calls in a fork()ed child", FDTYPE, IDENTITY, "exported fd: mmap of it",
                                                     "exported fd: read of it"]), rows
    assert seen(rows, FDTYPE).startswith("regular file") and seen(rows, "exported fd: read of it") == "works"
    assert last_line(p) == "PASS with 5 DIFF rows", p.stdout
    assert "the CUDA test driver's model differs from this driver" in p.stdout
