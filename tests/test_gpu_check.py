"""scripts/gpu-check.sh (the one command for a GPU host) run against the CUDA
test driver, so it keeps working until someone runs it on a real GPU. Each
run gets its own simulated machine (state directory)."""

from __future__ import annotations

import os
import subprocess

import pytest

from kvtest import ROOT, TESTDRIVER

SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def run_check(tmp_path, **extra: str) -> subprocess.CompletedProcess:
    if not TESTDRIVER.exists():
        pytest.fail(f"CUDA test driver not built: {TESTDRIVER} is missing (run scripts/build-testdriver.sh)")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    state = tmp_path / "gpu" if base == str(tmp_path) else __import__("pathlib").Path(base) / f"kvc-gpucheck-{os.getpid()}-{tmp_path.name}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "CUDA_VISIBLE"))}
    env.update(KVCACHED_LIBCUDA=str(TESTDRIVER), KVCACHED_TESTDRV_STATE=str(state), KVCACHED_TESTDRV_MEMORY="1G", TMPDIR=str(tmp_path))
    env.update(extra)
    try:
        return subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=180)
    finally:
        subprocess.run(["rm", "-rf", str(state)])


def test_gpu_check_passes_on_the_test_driver(tmp_path):
    p = run_check(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert out.rstrip().splitlines()[-1].startswith("PASS:"), out
    assert "FAIL" not in out, out
    for needle in [
        "another process's pages, imported from their fds, hold its bytes",
        "pages freed by another session read as zeros",
        "region: trimmed to 2 pages",
        "daemon books: pooled + in use + free = budget",
        "device memory back to where it started",
        "daemon exited 0 after SIGTERM",
        "test driver leak report: nothing left",
    ]:
        assert needle in out, f"{needle!r} missing:\n{out}"


def test_gpu_check_fails_when_pages_are_not_zeroed(tmp_path):
    """The check must be able to fail: with zeroing off (KVCACHED_ZERO_PAGES
    reaches the daemon's settings) freed pages keep the writer's bytes."""
    p = run_check(tmp_path, KVCACHED_ZERO_PAGES="false")
    assert p.returncode == 1, p.stdout
    assert "FAIL reader: pages freed by another session read as zeros" in p.stdout
    assert any(line.startswith("FAIL: see the FAIL lines") for line in p.stdout.splitlines()), p.stdout


def test_gpu_check_fails_when_the_driver_is_unusable(tmp_path):
    p = run_check(tmp_path, KVCACHED_TESTDRV_NO_VMM="1")
    assert p.returncode == 1, p.stdout
    assert "did not start" in p.stdout and "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0" in p.stdout, p.stdout
