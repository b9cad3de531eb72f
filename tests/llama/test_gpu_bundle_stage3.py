"""The offline GPU bundle's stage 3 (scripts/gpu-bundle/stage3.sh and its
driver tests/helpers/gpu_llama.py, issue 24) in its CPU mode against this
suite's two builds, so that the checks a GPU host runs do not rot between
GPU runs: the same checks (greedy identity over two models, flash attention
on and off, 1 and 4 slots; KV in daemon pages; pages following the context;
a SIGKILLed server; two servers and a reclaim; an 8B model's KV row on 4
layers at a 16k context over 4 slots), with the daemon on the host
backend and 2 MiB pages as on a GPU. Only the CUDA-only rows are skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvtest import HELPERS, ROOT
from llamatest import KVC, ORIG

sys.path.insert(0, str(HELPERS))
import gpu_llama  # noqa: E402


def test_stage3_cpu_mode_every_check_passes(tmp_path):
    assert ORIG.exists() and KVC.exists(), "run scripts/test-llama.sh (it builds both llama-servers)"
    prebuilt = tmp_path / "prebuilt"  # the layout STAGE3_BUILD=prebuilt:DIR reads
    prebuilt.mkdir()
    (prebuilt / "build-orig").symlink_to(ORIG.parent.parent)
    (prebuilt / "build-kvc").symlink_to(KVC.parent.parent)
    out = tmp_path / "stage3"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAGE3_", "KVCACHED_"))}
    env.update(STAGE_OUT=str(out), PYTHON=sys.executable, BUNDLE=str(tmp_path / "bundle"), REPO=str(ROOT),
               VERIFY_DRIVER="testdriver", STAGE3_DEVICE="cpu", STAGE3_BUILD=f"prebuilt:{prebuilt}", JOBS="2")
    p = subprocess.run(["bash", str(ROOT / "scripts/gpu-bundle/stage3.sh")], env=env, capture_output=True, text=True,
                       timeout=1200, cwd=ROOT)
    print(p.stdout[-6000:])
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert not [r for r in rows if r["verdict"] == "FAIL"], rows
    passed = [r["check"] for r in rows if r["verdict"] == "pass"]
    # every check of the plan ran and passed, but device memory (CUDA only); the first check gives three
    # rows, the 8B KV shape's first three and its second two
    want = len(gpu_llama.PLAN_NAMES) - 1 + 2 + 2 + 1
    assert len(passed) == want, (passed, rows)
    assert all(c.startswith("cpu build, host pages: ") for c in passed)
    assert sum("greedy tokens identical" in c for c in passed) == 9
    kv8b = [c.removeprefix("cpu build, host pages: ") for c in passed if "8B KV shape" in c]
    label = gpu_llama.kv8b_label("cpu")
    assert kv8b == [f"greedy tokens identical: {label}", f"{label}: KV held against stock's KV buffer",
                    f"{label}: pages back after slot erase",
                    next(c for c in kv8b if c.startswith(f"{label}: two servers, one ")),
                    f"{label}: SIGKILLed server's pages back in the pool"], kv8b
    skipped = [r for r in rows if r["verdict"] == "skip"]
    assert len(skipped) == 2 and all("no CUDA runtime" in r["seen"] or "cpu mode" in r["seen"] for r in skipped), skipped
    # and stage 4 finds the builds where stage 3 recorded them
    rec = json.loads((tmp_path / "bundle/work/llama/servers.json").read_text())
    assert rec["device"] == "cpu" and rec["kvc"].endswith("build-kvc/bin/llama-server")


def test_stage4_decode_cpu_mode_reports_every_variant(tmp_path):
    """Stage 4's decode figure (tests/helpers/gpu_llama.py decode) on the CPU
    builds: the unpatched server, the patched one through the daemon, without
    it and with the whole KV mapped at start (KVCACHED_PREMAP), two run
    lengths over two rounds, and each patched server's hook counters
    (KVCACHED_HOOK_STATS) per generated token; CUDA graphs are a GPU-only
    variant. Speed is not asserted (the GPU run records it)."""
    assert ORIG.exists() and KVC.exists(), "run scripts/test-llama.sh (it builds both llama-servers)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    p = subprocess.run([sys.executable, str(HELPERS / "gpu_llama.py"), "decode", "--device", "cpu", "--orig", str(ORIG),
                        "--kvc", str(KVC), "--out", str(tmp_path / "decode"), "--tokens", "16,48", "--rounds", "2"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    figs = res["figures"]
    assert set(res["raw"]) == {"unpatched", "patched_no_daemon", "patched", "patched_premap"}
    for name in res["raw"]:
        assert {k: len(v) for k, v in res["raw"][name].items()} == {"16": 2, "48": 2}, res["raw"]
        f = figs[f"decode_tokens_per_s_{name}"]
        assert f["value"] > 0 and len(f["samples"]) == 2 and "48 tokens, median of 2" in f["note"]
        assert f"decode_us_per_token_{name}" in figs and f"decode_ms_per_request_{name}" in figs
    assert figs["decode_patched_over_unpatched"]["value"] > 0
    assert figs["decode_patched_no_daemon_over_unpatched"]["value"] > 0
    assert figs["decode_patched_premap_over_unpatched"]["value"] > 0
    assert "patched without the daemon" in res["summary"] and "graphs" not in res["summary"]
    assert "whole KV mapped at start" in res["summary"] and "in the hook per token: " in res["summary"]
    # every patched server counted its hook calls: at least one map (or active, without the daemon) per token
    for name in ("patched", "patched_no_daemon", "patched_premap"):
        st = res["hook_stats"][name]
        assert st and st["calls"] > 0, res["hook_stats"]
        assert figs[f"decode_hook_calls_per_token_{name}"]["value"] >= 1
        assert figs[f"decode_hook_us_per_token_{name}"]["value"] > 0
        assert st["entries"]["active"][0] >= res["tokens"][name], st
    assert res["hook_stats"]["patched"]["entries"]["map"][0] >= res["tokens"]["patched"]
    assert "map" not in res["hook_stats"]["patched_no_daemon"]["entries"]  # no daemon: only the pass-throughs
    # the patched servers went through the daemon (the premap one mapping all at start), the other did not
    logs = {q.name: q.read_text(errors="replace") for q in (tmp_path / "decode" / "logs").glob("server*.log")}
    through = sorted(n for n, t in logs.items() if "in daemon pages" in t)
    assert len(through) == 2 and "-patched-" in through[0] and "-patched_premap-" in through[1], sorted(logs)
    assert "KVCACHED_PREMAP: every KV buffer mapped whole" in logs[through[1]]
    assert "KVCACHED_PREMAP" not in logs[through[0]]
