"""verify.sh's stage loop (docs/gpu-check.md, "The offline GPU bundle").

    python runner.py --bundle DIR --repo DIR --python PY --out VERIFY_OUT
                     [--stages "1 2 3 4"] [--deadline 540] [--grace 60]
                     [--driver real|testdriver] [--libcuda PATH] [--jobs N]
                     [--prepare-rows FILE]

Each stage is $REPO/scripts/gpu-bundle/stageN.sh, run as its own process
(own process group) with BUNDLE, REPO, PYTHON, STAGE_OUT, STAGE_DEADLINE,
KVCACHED_LIBCUDA, VERIFY_DRIVER and JOBS set; its output goes to the console
and to VERIFY_OUT/verify.log. A stage that would start after the deadline is
not started (a skip row; the verdict is then FAIL: something asked for did
not run); one still running at the deadline plus the grace is killed. After
every stage VERIFY_OUT gets table.md, results.json and logs.tar.gz anew. The
last line printed is the verdict; exit 0 for PASS (with or without DIFF rows),
1 for FAIL. Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402


def host_facts(python: str, driver: str, libcuda: str, bundle: pathlib.Path) -> dict:
    facts: dict = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   "driver_lib": libcuda, "verify_driver": driver, "kernel": platform.release()}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
            if out:
                name, drv, mem = (x.strip() for x in (out[0].split(",") + ["", "", ""])[:3])
                facts.update(gpu=name, driver_version=drv, gpu_memory=mem, gpus=len(out))
        except (OSError, subprocess.SubprocessError):
            pass
    if "gpu" not in facts:
        facts["gpu"] = "none found (no nvidia-smi answer)" if driver == "real" else "CUDA test driver (no GPU)"
    try:
        facts["python"] = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"],
                                         capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        facts["python"] = "?"
    man = bundle / "MANIFEST.json"
    if man.exists():
        try:
            m = json.loads(man.read_text())
            facts["bundle"] = f"{m.get('commit', '?')[:12]}{' (dirty)' if m.get('dirty') else ''} built {m.get('built', '?')}"
        except ValueError:
            facts["bundle"] = "MANIFEST.json unreadable"
    return facts


def run_stage(cmd: list[str], env: dict, cwd: str, log, kill_at: float) -> tuple[int | None, bool]:
    """Runs cmd, copying its output to the console and log; kills its
    process group at kill_at. Returns (rc, killed)."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)

    def pump():
        for chunk in iter(lambda: p.stdout.read1(65536), b""):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
            log.flush()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    killed = False
    try:
        rc = p.wait(timeout=max(0.0, kill_at - time.time()))
    except subprocess.TimeoutExpired:
        killed = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = p.wait()
    t.join(5)  # a child still holding the pipe (a daemon left behind) does not hold verify up
    if killed:
        log.write(b"\n[verify] the stage ran past the deadline and its grace: killed\n")
    return rc, killed


def logs_tarball(out: pathlib.Path) -> None:
    tmp = out / "logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tf:
        for p in sorted(out.iterdir()):
            if p.name.startswith("logs.tar.gz"):
                continue
            tf.add(p, arcname=f"verify-out/{p.name}")
    os.replace(tmp, out / "logs.tar.gz")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="1 2 3 4")
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--grace", type=float, default=60)
    ap.add_argument("--driver", default="real", choices=("real", "testdriver"))
    ap.add_argument("--libcuda", default="libcuda.so.1")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prepare-rows", default="")
    ap.add_argument("--start", type=float, default=0, help="epoch seconds the deadline counts from (default: now)")
    a = ap.parse_args(argv)
    t0 = a.start or time.time()
    bundle, repo, out = pathlib.Path(a.bundle), pathlib.Path(a.repo), pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    host = host_facts(a.python, a.driver, a.libcuda, bundle)
    rows: list[dict] = []
    figures: dict = {}
    stages: list[dict] = []
    if a.prepare_rows:
        prep, bad = report.read_rows(pathlib.Path(a.prepare_rows))
        for r in prep:
            r["stage"] = 0
        rows += prep
        rows += [report.row("stage 0 (prepare): rows", "one JSON row per line", b, "FAIL", "verify", stage=0) for b in bad]
    deadline = t0 + a.deadline
    prebuild = start_prebuild(a, bundle, repo, out, deadline)
    try:
        return run_stages(a, t0, deadline, bundle, repo, out, host, rows, figures, stages)
    finally:
        if prebuild is not None and prebuild.poll() is None:  # still building at the end: its cache resumes next run
            try:
                os.killpg(prebuild.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def wants_prebuild(stages: str, driver: str, env: dict, bundle_prebuilt: bool = False) -> bool:
    """Stage 3 builds llama.cpp with ggml-cuda on the host (minutes on 16
    cores): on a real driver that build starts with verify.sh, in the
    background and niced, so that it overlaps stages 1 and 2 instead of
    eating stage 3's share of the deadline. STAGE3_PREBUILD_EARLY=0 turns it
    off; a prebuilt or CPU stage 3 needs none, and neither does a bundle
    that carries the prebuilt part llama-cuda (`bundle_prebuilt`: stage 3
    tries it first, and a process of its own on the GPU during stage 1 would
    disturb stage 1's free-memory rows)."""
    return ("3" in stages.split() and driver == "real" and env.get("STAGE3_PREBUILD_EARLY", "1") != "0"
            and not bundle_prebuilt and not env.get("STAGE3_BUILD", "host").startswith("prebuilt:") and env.get("STAGE3_DEVICE", "cuda") == "cuda")


def start_prebuild(a, bundle: pathlib.Path, repo: pathlib.Path, out: pathlib.Path, deadline: float):
    script = repo / "scripts" / "gpu-bundle" / "stage3.sh"
    if not script.exists() or not wants_prebuild(a.stages, a.driver, os.environ,
                                                 (bundle / "parts" / "llama-cuda" / "MANIFEST.json").exists()):
        return None
    pre_out = out / "stage3-prebuild"
    pre_out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, BUNDLE=str(bundle), REPO=str(repo), PYTHON=a.python, STAGE_OUT=str(pre_out),
               STAGE_DEADLINE=str(int(deadline)), KVCACHED_LIBCUDA=a.libcuda, VERIFY_DRIVER=a.driver, JOBS=str(a.jobs),
               STAGE3_PREBUILD="1")
    with open(pre_out / "prebuild.log", "wb") as logf:
        p = subprocess.Popen(["nice", "-n", "10", "bash", str(script)], env=env, cwd=str(repo), stdout=logf,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"[verify] stage 3's llama.cpp build started in the background (pid {p.pid}, log {pre_out / 'prebuild.log'})")
    return p


def run_stages(a, t0, deadline, bundle, repo, out, host, rows, figures, stages) -> int:
    with open(out / "verify.log", "ab") as log:
        report.write(out, rows, figures, host, stages)
        for tok in a.stages.split():
            n = int(tok)
            script = repo / "scripts" / "gpu-bundle" / f"stage{n}.sh"
            stage_out = out / f"stage{n}"
            now = time.time()
            head = f"\n==== stage {n} ({report.STAGE_NAMES.get(n, '?')}) at {now - t0:.0f} s ====\n"
            sys.stdout.write(head)
            sys.stdout.flush()
            log.write(head.encode())
            if not script.exists():
                outcome = {"status": "missing"}
            elif now > deadline:
                outcome = {"status": "deadline", "deadline_s": a.deadline, "elapsed_s": now - t0}
            else:
                stage_out.mkdir(parents=True, exist_ok=True)
                env = dict(os.environ, BUNDLE=str(bundle), REPO=str(repo), PYTHON=a.python,
                           STAGE_OUT=str(stage_out), STAGE_DEADLINE=str(int(deadline)),
                           KVCACHED_LIBCUDA=a.libcuda, VERIFY_DRIVER=a.driver, JOBS=str(a.jobs))
                rc, killed = run_stage(["bash", str(script)], env, str(repo), log, deadline + a.grace)
                outcome = {"status": "killed" if killed else "ran", "rc": rc}
            outcome["seconds"] = round(time.time() - now, 1)
            stage_rows = report.stage_rows(n, outcome, stage_out if stage_out.exists() else None)
            rows += stage_rows
            figs, bad = report.read_figures(stage_out if stage_out.exists() else None)
            figures.update(figs)
            if bad:
                rows.append(report.row(f"stage {n}: figures.json", "{name: {value, unit}}", bad, "FAIL", "verify", stage=n))
            stages.append({"stage": n, "name": report.STAGE_NAMES.get(n, ""), **outcome,
                           "rows": len(stage_rows), "fail": sum(r["verdict"] == "FAIL" for r in stage_rows)})
            v = report.write(out, rows, figures, host, stages)
            msg = f"[verify] stage {n}: {outcome['status']}" + (f", exit {outcome.get('rc')}" if "rc" in outcome else "") + \
                  f", {outcome['seconds']:.0f} s; so far: {v}\n"
            sys.stdout.write(msg)
            log.write(msg.encode())
            log.flush()
            logs_tarball(out)
    v = report.write(out, rows, figures, host, stages)
    logs_tarball(out)
    print()
    print((out / "table.md").read_text(), end="")
    print(f"results: {out} (table.md, results.json, verify.log, logs.tar.gz)")
    print(v)
    return 0 if v.startswith("PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
