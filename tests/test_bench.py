"""The benchmark harness runs (quick mode) and produces every figure with its
baseline and ratio, on the host backend and on the CUDA test driver. No
timing assertions: this only keeps the harness from rotting."""

from __future__ import annotations

import json
import math
import subprocess

from kvtest import PY, ROOT, TESTDRIVER

# scenario prefix -> figures each backend must report
EXPECTED = {
    "1 Allocate 64 pages": ["warm pool p50", "warm pool p99", "cold (pages created) p50", "cold (pages created) p99"],
    "2 Allocate+Free 1 page": ["1 client p50", "1 client p99", "16 clients p50", "16 clients p99", "64 clients pairs/s", "fd channel requests vs gRPC calls",
                               "C client (bench/loadc.c), 1 client p50", "C client (bench/loadc.c), 16 clients p99",
                               "C client, 64 clients pairs/s", "C client, daemon CPU per pair, 1 client",
                               "C client, daemon CPU per pair, 64 clients", "C client vs transport floor"],
    "3 Reclaim": ["move "],
    "4 Scale": ["daemon RSS", "Allocate+map 1 page p50", "Allocate+map 1 page p99", "GetStats p50", "GetStats p99"],
    "5 Ollama-shaped load (Go)": ["ops/s", "grow p50", "grow p99", "trim p50", "trim p99"],
    "6 Capacity": ["requests served", "queueing delay p50", "queueing delay p90", "queueing delay p99",
                   "models resident", "model loads"],
    "8 gRPC relay (control socket)": ["GetStats p50", "GetStats p99", "GetStats daemon CPU per call",
                                      "OpenSession+CloseSession p50", "OpenSession+CloseSession p99",
                                      "OpenSession+CloseSession daemon CPU per call"],
}


def test_quick_bench_produces_every_figure(tmp_path):
    assert TESTDRIVER.exists(), f"CUDA test driver not built: {TESTDRIVER}"
    out = tmp_path / "bench"
    proc = subprocess.run([str(ROOT / "scripts" / "bench.sh"), "--quick", "--backend", "all", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"bench.sh exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    result = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert "CUDA (test driver: timings say nothing about a GPU)" in md
    for key in ("nproc", "cpu", "ram_bytes"):
        assert key in result["machine"]
    assert set(result["backends"]) >= {"host", "cuda-testdriver", "cuda-gpu"}
    gpu = result["backends"]["cuda-gpu"]
    if not result["gpu"]["gpu"]:
        assert "no GPU" in gpu["skipped"] and "Not run: no GPU" in md
    backends = ["host", "cuda-testdriver"] + ([] if gpu.get("skipped") else ["cuda-gpu"])
    for be in backends:
        res = result["backends"][be]
        assert not res.get("errors"), (be, res.get("errors"))
        rows = res["figures"]
        for scenario, figs in EXPECTED.items():
            got = [r for r in rows if r["scenario"] == scenario]
            for fig in figs:
                match = [r for r in got if fig in r["figure"]]
                assert match, f"{be}: no figure {fig!r} in scenario {scenario!r}: {[r['figure'] for r in got]}"
                for r in match:
                    for k in ("value", "baseline", "ratio"):
                        assert isinstance(r[k], (int, float)) and not math.isnan(r[k]), (be, r)
                    assert r["baseline_is"], r
                    assert f"| {scenario} | {r['figure']}" in md
        scale = res["scenarios"]["scale"]
        assert "1000" in scale["levels"], scale["levels"].keys()
        # 100k pages: measured, or the limit that stopped it is reported
        assert "100000" in scale["levels"] or scale["limit"]["error"], scale
        if be == "cuda-testdriver":
            # the test driver keeps no fd per page (KVCACHED_TESTDRV_REFS=table): 100k is reached, fds stay flat
            top, ref = scale["levels"].get("100000"), scale["levels"]["1000"]
            assert top is not None, scale.get("limit")
            assert top["daemon_fds"] <= ref["daemon_fds"] + 64 and top["daemon_page_fds"] <= 1100, (ref, top)
        cap = res["scenarios"]["capacity"]
        assert cap["static"]["requests"] == cap["elastic"]["requests"] > 0
        # the elastic run really went through the daemon's reclaim
        assert cap["elastic"]["reclaim_callbacks"] > 0, cap["elastic"]
        lg = res["scenarios"]["loadgen"]["loadgen"]
        assert lg["pages_bad"] == 0 and lg["errors"] == 0, lg


def test_request_path_harness_runs_with_and_without_metrics():
    """bench/requestpath.py (the daemon's request path in one process): it
    serves real pairs (it checks every answer) and prints its figure."""
    for extra in ([], ["--metrics"]):
        proc = subprocess.run([str(PY), "-m", "bench.requestpath", "--pairs", "300", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "us CPU per one-page Allocate+Free pair" in proc.stdout, proc.stdout
        assert ("metrics on" in proc.stdout) == bool(extra), proc.stdout
