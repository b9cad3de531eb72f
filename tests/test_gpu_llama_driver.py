"""The row and verdict logic of the GPU bundle's stages 3 and 4
(tests/helpers/gpu_llama.py, tests/helpers/gpu_figures.py,
scripts/gpu-bundle/stage3.sh), without builds or a GPU: fast. The checks
themselves run against real llama-servers in tests/llama/test_gpu_bundle_stage3.py
(CPU builds) and on a GPU host through the bundle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtest import HELPERS, ROOT

sys.path.insert(0, str(HELPERS))
import gpu_figures  # noqa: E402
import gpu_llama as gl  # noqa: E402

MiB = 1 << 20
STAGE3 = ROOT / "scripts" / "gpu-bundle" / "stage3.sh"
VERDICTS = {"pass", "FAIL", "DIFF", "info", "skip"}


def test_greedy_row_passes_only_on_identical_tokens():
    want = [[1, 2, 3], [4, 5]]
    assert gl.greedy_row("m", want, [[1, 2, 3], [4, 5]])["verdict"] == "pass"
    r = gl.greedy_row("m", want, [[1, 2, 3], [4, 6]])
    assert r["verdict"] == "FAIL" and "prompt 1: first at token 1" in r["seen"]
    assert gl.greedy_row("m", want, [[1, 2, 3]])["verdict"] == "FAIL"  # an answer missing
    assert gl.greedy_row("m", want, [[1, 2], [4, 5]])["verdict"] == "FAIL"  # shorter answer
    assert gl.greedy_row("m", [], [])["verdict"] == "FAIL"  # nothing compared is no pass
    assert gl.greedy_row("m", [[]], [[]])["verdict"] == "FAIL"
    assert gl.greedy_row("m", want, want)["kind"] == "llama.cpp"


def test_grow_trim_row():
    grow = [("short", 10, 16 * MiB, 24 * MiB), ("long", 4800, 32 * MiB, 40 * MiB)]
    assert gl.grow_trim_row(grow, 0)["verdict"] == "pass"
    assert gl.grow_trim_row(grow, 2 * MiB)["verdict"] == "FAIL"  # not trimmed on erase
    flat = [("short", 10, 16 * MiB, 24 * MiB), ("long", 4800, 16 * MiB, 40 * MiB)]
    assert gl.grow_trim_row(flat, 0)["verdict"] == "FAIL"  # did not grow
    over = [("short", 10, 16 * MiB, 24 * MiB), ("long", 4800, 48 * MiB, 40 * MiB)]
    assert gl.grow_trim_row(over, 0)["verdict"] == "FAIL"  # above its bound
    assert gl.grow_trim_row([("none", 0, 0, 0), ("long", 4800, 32 * MiB, 40 * MiB)], 0)["verdict"] == "FAIL"
    assert gl.grow_trim_row(grow[:1], 0)["verdict"] == "FAIL"


def test_memory_back_row():
    assert gl.memory_back_row(1000 * MiB, 1001 * MiB, "NVML")["verdict"] == "pass"
    assert gl.memory_back_row(1000 * MiB, 900 * MiB, "NVML")["verdict"] == "pass"  # less in use: someone else left
    r = gl.memory_back_row(1000 * MiB, 1010 * MiB, "NVML")
    assert r["verdict"] == "FAIL" and "+10.0 MiB" in r["seen"]
    assert gl.memory_back_row(None, 5, "NVML failed")["verdict"] == "skip"


def test_plan_and_deadline_rows():
    names = gl.PLAN_NAMES
    assert len(names) == len(set(names)) == 3 + 7 + 2 + 1
    assert sum(n.startswith("greedy tokens identical") for n in names) == 7  # the 8th is in the first check
    assert [n for n in names if n.startswith("8B KV shape")] == gl.KV8B_CHECKS and names[-1].startswith("device memory")
    rows = gl.deadline_rows(names[3:], "stage deadline")
    assert [r["check"] for r in rows] == names[3:]
    assert all(r["verdict"] == "skip" and r["seen"] == "skip: stage deadline" for r in rows)


def test_decode_figures_split_per_token_and_per_request_costs():
    """Two run lengths: each variant's median run time is fixed + n * per
    token. Patched here pays 2 ms per request and the same 400 us per token:
    the split says so, and the ratios name the variant they divide by."""
    def tps(fixed_s, per_token_s, n):
        return n / (fixed_s + n * per_token_s)
    samples = {
        "unpatched": {128: [tps(0.0, 400e-6, 128)] * 3, 1024: [tps(0.0, 400e-6, 1024)] * 3},
        "patched_no_daemon": {128: [tps(0.0, 400e-6, 128)] * 3, 1024: [tps(0.0, 400e-6, 1024)] * 3},
        "patched": {128: [tps(2e-3, 400e-6, 128)] * 3, 1024: [tps(2e-3, 400e-6, 1024)] * 3},
        "unpatched_graphs_off": {128: [tps(0.0, 800e-6, 128)] * 3, 1024: [tps(0.0, 800e-6, 1024)] * 3},
        "patched_graphs_off": {128: [tps(0.0, 800e-6, 128)] * 3, 1024: [tps(0.0, 800e-6, 1024)] * 3},
    }
    figs = gl.decode_figures(samples, "cuda", "A")
    assert figs["decode_us_per_token_unpatched"]["value"] == 400.0
    assert figs["decode_us_per_token_patched"]["value"] == 400.0
    assert figs["decode_ms_per_request_unpatched"]["value"] == 0.0
    assert figs["decode_ms_per_request_patched"]["value"] == 2.0
    assert figs["decode_patched_no_daemon_over_unpatched"]["value"] == 1.0
    assert figs["decode_patched_over_unpatched"]["value"] == round(0.4096 / 0.4116, 3)
    assert figs["decode_patched_over_unpatched_graphs_off"]["value"] == 1.0  # against graphs-off unpatched
    assert figs["decode_unpatched_graphs_off_over_unpatched"]["value"] == 0.5
    line = gl.decode_summary(figs)
    for part in ("patched without the daemon 2500 (1.000)", "CUDA graphs off: unpatched 1250, patched 1250 (1.000)",
                 "per token 400.0 / 400.0 us, per request 0.00 / 2.00 ms"):
        assert part in line, line


def test_kv8b_shape_is_an_8b_models_kv_on_the_gpu_and_scaled_on_the_cpu():
    import q4_gguf

    gpu, cpu = gl.KV8B_SHAPES["cuda"], gl.KV8B_SHAPES["cpu"]
    real = q4_gguf.SHAPES["llama3.1-8b"]
    for k in ("n_layer", "n_head", "n_head_kv", "n_embd"):
        assert gpu[k] == real[k], k  # the KV (and attention) geometry exactly
    assert q4_gguf.kv_row_bytes(gpu) == q4_gguf.kv_row_bytes(real) == 2048
    assert q4_gguf.kv_bytes_per_token(gpu) == 128 * 1024
    assert q4_gguf.weight_bytes(gpu) < q4_gguf.weight_bytes(real) / 4  # FFN and vocabulary cut
    # on the CPU: the same row (as many cells per 2 MiB page), fewer layers, a shorter context
    assert q4_gguf.kv_row_bytes(cpu) == 2048 and cpu["n_layer"] < gpu["n_layer"]
    assert gl.KV8B_CTX == {"cuda": 32768, "cpu": 16384} and gl.KV8B_SLOTS == 4
    # the longest prompt needs a second page per K/V tensor, and fits its slot on the CPU
    assert 1024 < max(gl.KV8B_PROMPT_CHARS) < gl.KV8B_CTX["cpu"] // gl.KV8B_SLOTS
    assert gl.kv8b_label("cuda") == "8B KV shape (32 layers, 8 KV heads of 128), 32k context, 4 slots"
    assert gl.kv8b_label("cpu") == "8B KV shape (4 layers, 8 KV heads of 128), 16k context, 4 slots"


def test_kv_against_stock_row():
    bound = 700 * MiB
    r = gl.kv_against_stock_row("8B", 640 * MiB, 4096.0, bound, 640.0)
    assert r["verdict"] == "pass" and "15.6 % of stock's 4096 MiB" in r["seen"] and "last KV line 640 MiB" in r["seen"]
    assert gl.kv_against_stock_row("8B", 0, 4096.0, bound, None)["verdict"] == "FAIL"  # nothing held
    assert gl.kv_against_stock_row("8B", 800 * MiB, 4096.0, bound, None)["verdict"] == "FAIL"  # above the bound
    assert gl.kv_against_stock_row("8B", 640 * MiB, 512.0, bound, None)["verdict"] == "FAIL"  # above stock's buffer
    assert gl.kv_against_stock_row("8B", 640 * MiB, None, bound, None)["verdict"] == "FAIL"  # no stock line
    assert gl.kv_against_stock_row("8B", 1, 4096.0, bound, None)["check"] == "8B: KV held against stock's KV buffer"


def test_hook_stats_line_and_per_token_figures():
    log = ("srv  log line\n"
           "kvcached: hook stats: calls 3090 in 1545.0 us; active 1030 / 103.0 us, map 1030 / 1236.0 us, "
           "lock 1000 / 150.0 us, poll 30 / 56.0 us\nmore\n")
    st = gl.parse_hook_stats(log)
    assert st == {"calls": 3090, "us": 1545.0, "entries": {"active": [1030, 103.0], "map": [1030, 1236.0],
                                                            "lock": [1000, 150.0], "poll": [30, 56.0]}}
    assert gl.parse_hook_stats("no line") is None
    empty = gl.parse_hook_stats("kvcached: hook stats: calls 0 in 0.0 us; \n")
    assert empty == {"calls": 0, "us": 0.0, "entries": {}}
    # what a server calls while it loads and exits is left out of the per-token figures
    loaded = dict(st, entries={**st["entries"], "alloc_kv": [1, 6000.0], "buf_clear": [4, 30000.0], "buf_free": [1, 700.0]})
    figs = gl.hook_figures({"patched": loaded, "patched_no_daemon": None, "patched_premap": st}, {"patched": 1000,
                           "patched_premap": 0}, "cuda", "A")
    assert set(figs) == {"decode_hook_calls_per_token_patched", "decode_hook_us_per_token_patched"}
    assert figs["decode_hook_us_per_token_patched"]["value"] == 1.545
    assert figs["decode_hook_us_per_token_patched"]["calls"] == 3090
    assert figs["decode_hook_us_per_token_patched"]["load_us"] == 36700.0
    assert "alloc_kv" not in figs["decode_hook_calls_per_token_patched"]["entries"]
    assert figs["decode_hook_calls_per_token_patched"]["value"] == 3.09
    assert figs["decode_hook_calls_per_token_patched"]["entries"]["map"] == {"calls_per_token": 1.03,
                                                                             "us_per_token": 1.236}
    assert all(isinstance(v["value"], float) and v["unit"] in ("us", "calls") for v in figs.values())
    figs.update(gl.decode_figures({"unpatched": {1024: [2500.0]}, "patched": {1024: [2400.0]},
                                   "patched_premap": {1024: [2475.0]}}, "cuda", "A"))
    assert figs["decode_patched_premap_over_unpatched"]["value"] == 0.99
    line = gl.decode_summary(figs)
    assert "patched, whole KV mapped at start 2475 (0.990)" in line, line
    assert "in the hook per token: patched 1.54 us (3.1 calls)" in line, line


def test_decode_variants_premap_and_counters():
    assert gl.DECODE_VARIANTS["patched_premap"] == ("kvc", True, True)
    assert gl.DECODE_ENV["patched_premap"] == {"KVCACHED_PREMAP": "1"}
    assert gl.HOOK_STATS_ENV == {"KVCACHED_HOOK_STATS": "1"}
    assert gl.DECODE_RATIOS["patched_premap"] == ("decode_patched_premap_over_unpatched", "unpatched")


def test_skip_mode_names_every_check(tmp_path):
    assert gl.main(["skip", "--out", str(tmp_path), "--reason", "no CUDA runtime"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["check"] for r in rows] == gl.PLAN_NAMES
    assert {r["verdict"] for r in rows} == {"skip"}
    assert {r["seen"] for r in rows} == {"skip: no CUDA runtime"}


def test_decode_and_bench_figures_have_the_figures_json_shape():
    figs = gl.decode_figures({"unpatched": {1000: [100.0, 120.0, 110.0]}, "patched": {1000: [90.0, 108.0, 99.0]}}, "cuda", "A")
    assert figs["decode_tokens_per_s_unpatched"]["value"] == 110.0
    assert figs["decode_tokens_per_s_patched"]["value"] == 99.0
    assert figs["decode_tokens_per_s_patched"]["samples"] == [90.0, 108.0, 99.0]
    assert figs["decode_patched_over_unpatched"]["value"] == 0.9
    assert gl.decode_figures({}, "cuda", "A") == {}
    assert "0.900" in gl.decode_summary(figs) and "1000 tokens, median of 3" in gl.decode_summary(figs)
    s = lambda p50, p99: {"n": 10, "p50_us": p50, "p99_us": p99, "mean_us": p50}  # noqa: E731
    res = {"scenarios": {
        "allocate64": {"daemon_warm": s(300, 500), "baseline_inproc_create_map": s(9000, 12000), "daemon_cold": s(8000, 9000)},
        "roundtrip": {"rtt_1_daemon": s(40, 90), "rtt_16_daemon": s(200, 900), "cclient": {"rtt_1": s(20, 30)}},
        "reclaim": {"daemon_reclaim": s(25000, 26000), "baseline_unload_reload": s(400000, 410000),
                    "moved_bytes": 3686 * MiB, "budget_bytes": 4096 * MiB, "reps": 3,
                    "large": {"daemon_reclaim": s(9000, 9500), "baseline_unload_reload": s(20000, 21000),
                              "moved_bytes": 3680 * MiB, "budget_bytes": 4096 * MiB, "page_size": 32 * MiB, "reps": 3}}},
        "errors": {"scale": "Traceback\nRuntimeError: boom"}}
    figs2, rows = gpu_figures.bench_figures(res, "testdriver")
    for f in (figs, figs2):
        assert all(isinstance(v["value"], (int, float)) and isinstance(v["unit"], str) for v in f.values())
    assert figs2["stage4.reclaim_p50_ms"]["value"] == 25.0
    assert all(v["driver"] == "testdriver" and "says nothing about a GPU" in v["note"] for v in figs2.values())
    assert figs2["stage4.reclaim_32mib_pages_p50_ms"]["value"] == 9.0
    assert figs2["stage4.reclaim_32mib_pages_unload_reload_p50_ms"]["value"] == 20.0
    assert [r["verdict"] for r in rows] == ["FAIL", "info", "info", "info", "info"]
    assert "32 MiB pages" in rows[-1]["check"] and "p50 9.0 ms over 3 runs" in rows[-1]["seen"]
    assert "RuntimeError: boom" in rows[0]["seen"] and all(r["kind"] == "figures" for r in rows)
    assert all("[CUDA test driver]" in r["seen"] for r in rows[1:])
    calls, r = gpu_figures.driver_call_figures({"cuMemCreate": [1e-4] * 99 + [1e-2], "cuMemMap": [2e-6] * 100}, 2 * MiB, "real")
    assert calls["stage4.cuMemCreate_p50_us"]["value"] == 100.0 and calls["stage4.cuMemCreate_p99_us"]["value"] == 10000.0
    assert "stage4.cuMemUnmap_p50_us" not in calls and r["verdict"] == "info" and "[CUDA test driver]" not in r["seen"]
    # export/import per page, and one call over a run of pages against one per page
    calls, r = gpu_figures.driver_call_figures({"cuMemSetAccess": [25e-6] * 10, "cuMemSetAccess_run": [64e-6] * 4,
                                                "cuMemImportFromShareableHandle": [30e-6] * 10}, 2 * MiB, "real", batch=32)
    assert calls["stage4.cuMemSetAccess_run_32_pages_p50_us"]["value"] == 64.0
    assert calls["stage4.cuMemSetAccess_run_32_pages_p50_us"]["per_page_us"] == 2.0
    assert calls["stage4.cuMemImportFromShareableHandle_p50_us"]["value"] == 30.0
    assert "SetAccess over 32 pages in one call 64 us p50 (2.00 per page against 25.0 one by one)" in r["seen"], r["seen"]
    assert "Import 30.0/30.0" in r["seen"]
    _, r = gpu_figures.driver_call_figures({"cuMemMap": [2e-6]}, 2 * MiB, "real", run_error="CudaDriverError: NOT_SUPPORTED")
    assert "one call over 32 mapped pages refused: CudaDriverError: NOT_SUPPORTED" in r["seen"]


def stage3(tmp_path, **env) -> tuple[int, list[dict], str]:
    out = tmp_path / "stage3"
    e = {k: v for k, v in os.environ.items() if not k.startswith("STAGE3_")}
    e.update(STAGE_OUT=str(out), PYTHON=sys.executable, BUNDLE=str(tmp_path / "bundle"), REPO=str(ROOT), **env)
    p = subprocess.run(["bash", str(STAGE3)], env=e, capture_output=True, text=True, timeout=120, cwd=ROOT)
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()] if (out / "rows.jsonl").exists() else []
    return p.returncode, rows, p.stdout + p.stderr


def test_stage3_on_the_test_driver_skips_every_check_with_the_reason(tmp_path):
    rc, rows, log = stage3(tmp_path, VERIFY_DRIVER="testdriver")
    assert rc == 0, log
    assert [r["check"] for r in rows][1:] == gl.PLAN_NAMES, log
    assert all(r["verdict"] == "skip" and r["seen"] == "skip: no CUDA runtime" and r["kind"] == "llama.cpp" for r in rows)
    assert all(set(r) == {"check", "expected", "seen", "verdict", "kind"} for r in rows)


@pytest.mark.parametrize("build,want", [("prebuilt:/nonexistent", "missing"), ("other", "other")])
def test_stage3_with_no_builds_fails_with_a_row(tmp_path, build, want):
    rc, rows, log = stage3(tmp_path, VERIFY_DRIVER="testdriver", STAGE3_DEVICE="cpu", STAGE3_BUILD=build)
    assert rc == 1, log
    fails = [r for r in rows if r["verdict"] == "FAIL"]
    assert len(fails) == 1 and want in fails[0]["seen"], rows
    assert all(r["verdict"] in VERDICTS for r in rows)


def test_stage3_host_build_without_the_part_fails_with_a_row(tmp_path):
    rc, rows, log = stage3(tmp_path, VERIFY_DRIVER="testdriver", STAGE3_DEVICE="cpu", STAGE3_BUILD="host",
                           STAGE3_PART=str(tmp_path / "nopart"))
    assert rc == 1, log
    fails = [r for r in rows if r["verdict"] == "FAIL"]
    assert len(fails) == 1 and "the bundle's part llama" in fails[0]["seen"], rows
    assert [r["check"] for r in rows if r["verdict"] == "skip"][-len(gl.PLAN_NAMES):] == gl.PLAN_NAMES
