"""scripts/gpu-check.sh (the one command for a GPU host) run against the CUDA
test driver, so it keeps working until someone runs it on a real GPU. Each
run gets its own simulated machine (state directory). With
KVCACHED_TEST_LIBCUDA naming another libcuda (the public-only build of the
test driver, a real driver) the same checks run on that library, less what
needs the test driver's private features (its leak report, NO_VMM); stages
3 and 4 are not asked for here (GPU_CHECK_TESTS / GPU_CHECK_BENCH empty):
this file is itself one of stage 3's suites."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvtest import ROOT, libcuda, require_testdriver_features
from kvtest import testdriver_features as has_private_features

SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def run_check(tmp_path, **extra: str) -> subprocess.CompletedProcess:
    lib = libcuda()
    if not lib.exists():
        pytest.fail(f"CUDA driver library {lib} is missing (run scripts/build-testdriver.sh)")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    state = tmp_path / "gpu" if base == str(tmp_path) else __import__("pathlib").Path(base) / f"kvc-gpucheck-{os.getpid()}-{tmp_path.name}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "CUDA_VISIBLE"))}
    env = {k: v for k, v in env.items() if not k.startswith("GPU_CHECK_")}
    env.update(KVCACHED_LIBCUDA=str(lib), KVCACHED_TESTDRV_STATE=str(state), KVCACHED_TESTDRV_MEMORY="1G", TMPDIR=str(tmp_path),
               GPU_CHECK_TESTS="", GPU_CHECK_BENCH="")
    env.update(extra)
    try:
        return subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=180)
    finally:
        subprocess.run(["rm", "-rf", str(state)])


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, "os.PathLike"]:
    """One run on an unchanged driver, shared by the tests that read it:
    its output and its GPU_CHECK_OUT directory."""
    tmp = tmp_path_factory.mktemp("gpucheck")
    res = tmp / "results" / "here"  # GPU_CHECK_OUT: created if missing
    return run_check(tmp, GPU_CHECK_OUT=str(res), GPU_CHECK_PAGES="4"), res


def test_gpu_check_passes_on_the_test_driver(clean_run):
    p, res = clean_run
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert out.rstrip().splitlines()[-1] == expected_verdict(res), out
    assert out.rstrip().splitlines()[-2].startswith("PASS: kvcached CUDA path"), out
    assert "FAIL" not in out, out
    for needle in [
        "another process's pages, imported from their fds, hold its bytes",
        "pages freed by another session read as zeros",
        "region: trimmed to 2 pages",
        "daemon books: pooled + in use + free = budget",
        "device memory back to where it started",
        "daemon exited 0 after SIGTERM",
        *(["test driver leak report: nothing left"] if has_private_features() else []),
    ]:
        assert needle in out, f"{needle!r} missing:\n{out}"


def expected_verdict(res) -> str:
    """PASS on the test driver's default model; elsewhere the DIFF rows may
    only be the export-semantics rows (what an exported fd is), e.g. on
    the public-only build: a character device, one inode for every export."""
    if has_private_features():
        return "PASS"
    rows = [json.loads(line) for line in (res / "rows.jsonl").read_text().splitlines() if line.strip()]
    diff = [r["check"] for r in rows if r["verdict"] == "DIFF"]
    assert all(c.startswith("exported fd: ") for c in diff), diff
    return f"PASS with {len(diff)} DIFF rows" if diff else "PASS"


def test_gpu_check_fails_when_pages_are_not_zeroed(tmp_path):
    """The check must be able to fail: with zeroing off (KVCACHED_ZERO_PAGES
    reaches the daemon's settings) freed pages keep the writer's bytes."""
    p = run_check(tmp_path, KVCACHED_ZERO_PAGES="false")
    assert p.returncode == 1, p.stdout
    assert "FAIL reader: pages freed by another session read as zeros" in p.stdout
    assert any(line.startswith("FAIL: see the FAIL lines") for line in p.stdout.splitlines()), p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == "FAIL", p.stdout


def test_gpu_check_fails_when_the_driver_is_unusable(tmp_path):
    """The daemon cannot start: FAIL, and the stages that were asked for
    (here the behaviour tests, named) are reported as not run."""
    require_testdriver_features("KVCACHED_TESTDRV_NO_VMM")
    res = tmp_path / "out"
    p = run_check(tmp_path, KVCACHED_TESTDRV_NO_VMM="1", GPU_CHECK_OUT=str(res),
                  GPU_CHECK_TESTS="tests/cuda/test_struct_layout.py")
    assert p.returncode == 1, p.stdout
    assert "did not start" in p.stdout and "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0" in p.stdout, p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == "FAIL", p.stdout
    assert (res / "verdict.txt").read_text() == "FAIL\n"
    rows = [json.loads(line) for line in (res / "rows.jsonl").read_text().splitlines() if line.strip()]
    skipped = {r["check"]: r.get("asked", False) for r in rows if r["verdict"] == "skip" and r["kind"] != "model"}
    assert skipped == {"CUDA behaviour tests": True, "CUDA bench": False}, rows


def test_gpu_check_fails_when_the_driver_shows_no_device(tmp_path):
    """Any libcuda with no device visible (CUDA_VISIBLE_DEVICES empty): a
    FAIL that names the driver's answer, and the verdict FAIL."""
    res = tmp_path / "out"
    p = run_check(tmp_path, CUDA_VISIBLE_DEVICES="", GPU_CHECK_OUT=str(res))
    assert p.returncode == 1, p.stdout
    assert "CUDA_ERROR_NO_DEVICE" in p.stdout, p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == "FAIL", p.stdout
    assert (res / "verdict.txt").read_text() == "FAIL\n"


def test_gpu_check_out_holds_rows_table_figures_and_logs(clean_run):
    """GPU_CHECK_OUT=DIR (what the GPU bundle's verify.sh reads): the rows,
    the table with one line per row, the verdict, the logs, and every number
    the probe measured with its unit."""
    p, res = clean_run
    assert p.returncode == 0, p.stdout + p.stderr
    for name in ("rows.jsonl", "table.md", "verdict.txt", "figures.json", "daemon.log", "probe.jsonl", "probe.err",
                 "reader.out", *(["leaks-daemon.json"] if has_private_features() else [])):
        assert (res / name).is_file(), (name, sorted(x.name for x in res.iterdir()))
    rows = [json.loads(line) for line in (res / "rows.jsonl").read_text().splitlines() if line.strip()]
    table = (res / "table.md").read_text().splitlines()
    assert table[0] == "| # | check | expected | seen | result |"
    assert len([line for line in table if line.startswith("| ") and not line.startswith("| #")]) == len(rows) > 40
    assert (res / "verdict.txt").read_text() == expected_verdict(res) + "\n"
    assert "stopped: every page released" in (res / "daemon.log").read_text()
    probe = [json.loads(line) for line in (res / "probe.jsonl").read_text().splitlines() if line.strip()]
    assert rows[:len(probe)] == probe and len(probe) > 15  # the probe's rows come first
    figs = json.loads((res / "figures.json").read_text())
    for name, unit in [("probe.cuMemCreate_p50", "us per 2 MiB page"), ("probe.cuMemSetAccess_p99", "us per 2 MiB page"),
                       ("probe.granularity_minimum", "B"), ("probe.free_drop_after_pages", "MiB"),
                       ("probe.pages_created", "count"), ("daemon.device_free_before", "MiB"), ("stage.probe.wall", "s")]:
        assert figs[name]["unit"] == unit, (name, figs.get(name))
        assert isinstance(figs[name]["value"], (int, float)), figs[name]
    assert figs["probe.granularity_minimum"]["value"] == 2 << 20
    assert figs["probe.pages_created"]["value"] == 4
    assert figs["probe.free_drop_after_pages"]["value"] >= 8  # 4 pages of 2 MiB
    assert figs["probe.cuMemCreate_p50"]["value"] > 0


def test_gpu_check_probe_reports_the_export_semantics(clean_run):
    """Stage 1 says what an exported fd is: its file type, whether its inode
    differs per export, and whether read and mmap of it work (the test
    driver's default and its public-only build, like NVIDIA's driver: a
    character device, one inode for every export, neither works)."""
    p, res = clean_run
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["check"]: r for r in map(json.loads, (res / "probe.jsonl").read_text().splitlines())}
    if not has_private_features():
        assert rows["exported fd: read of it"]["verdict"] == rows["exported fd: mmap of it"]["verdict"] == "pass", rows
        if "public" in str(libcuda()):  # the public-only build of the test driver (scripts/build-testdriver.sh --public-only)
            assert rows["exported fd: file type (fstat S_IFMT)"]["seen"].startswith("character device (")
            assert rows["exported fd: inode (st_dev, st_ino) across exports"]["seen"] == "the same for every export"
            assert p.stdout.rstrip().splitlines()[-1] == "PASS", p.stdout
        return
    assert rows["exported fd: file type (fstat S_IFMT)"]["seen"].startswith("character device (")
    assert rows["exported fd: inode (st_dev, st_ino) across exports"]["seen"] == "the same for every export"
    assert rows["exported fd: read of it"]["seen"].startswith("fails: ")
    assert rows["exported fd: mmap of it"]["seen"].startswith("fails: ")
    assert all(rows[k]["verdict"] == "pass" and rows[k]["kind"] == "model" for k in rows if k.startswith("exported fd:"))
