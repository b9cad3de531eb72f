"""The offline GPU bundle's pieces (scripts/gpu-bundle/): the size check, the
rows' verdict and table, verify's stage loop (deadline, stages without
rows, missing or runaway stages, results.json after every stage), the test
programs' results as rows, and the wheel installer of a host without pip.
The whole bundle is built and verified on the test driver by
scripts/test-gpu-bundle.sh."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GB = ROOT / "scripts" / "gpu-bundle"
sys.path.insert(0, str(GB))

import pack  # noqa: E402
import prepare  # noqa: E402
import report  # noqa: E402
import testrows  # noqa: E402


def rows_of(*verdicts):
    return [report.row(f"c{i}", "e", "s", v, "code") for i, v in enumerate(verdicts)]


# ---- size


def test_size_check_refuses_an_oversize_bundle(tmp_path):
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "big.tar.xz").write_bytes(b"x" * 3000)
    (tmp_path / "verify.sh").write_bytes(b"y" * 100)
    ok, text = pack.size_check(tmp_path, max_bytes=3000)
    assert not ok and "TOO BIG" in text and "3100 bytes" in text
    ok, text = pack.size_check(tmp_path, max_bytes=3100)
    assert ok and text.endswith("ok")
    p = subprocess.run([sys.executable, str(GB / "pack.py"), "size", str(tmp_path), "--max", "3099"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "TOO BIG" in p.stdout
    assert pack.MAX_BYTES == 56 * 2**20


def test_gpu_bundle_sh_checks_the_size_last_with_the_56_mib_limit():
    text = (ROOT / "scripts" / "gpu-bundle.sh").read_text()
    assert "${GPU_BUNDLE_MAX_MB:-56}" in text
    assert text.rstrip().splitlines()[-1].startswith('"$PY" "$PACK" size "$OUT" --max "$MAX_BYTES"')


def test_tar_is_reproducible_and_keeps_modes(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "run.sh").write_text("#!/bin/sh\n")
    (src / "d" / "run.sh").chmod(0o755)
    (src / "a.txt").write_text("a")
    a, b = tmp_path / "a.tar.xz", tmp_path / "b.tar.xz"
    pack.make_tar(src, a)
    time.sleep(1.1)
    os.utime(src / "a.txt")
    pack.make_tar(src, b)
    assert a.read_bytes() == b.read_bytes()
    out = tmp_path / "out"
    prepare.extract(a, out)
    assert os.access(out / "d" / "run.sh", os.X_OK) and (out / "a.txt").read_text() == "a"


def test_repo_files_leave_out_results_and_images_but_keep_the_stages():
    files = pack.repo_files(ROOT)
    assert "scripts/gpu-check.sh" in files and "kvcached_service/server/core/daemon.py" in files
    assert "scripts/gpu-bundle/stage1.sh" in files and "clients/go/go.mod" in files
    assert not [f for f in files if f.startswith("bench/results/") or f.endswith(".svg") or f.endswith(".png")]


def test_declared_inputs(tmp_path):
    s = tmp_path / "build-x.sh"
    s.write_text("#!/bin/sh\n# gpu-bundle-inputs: clients/go protos\n# gpu-bundle-inputs: clients/c\n")
    assert pack.declared_inputs(s) == ["clients/go", "protos", "clients/c"]
    s.write_text("#!/bin/sh\n")
    assert pack.declared_inputs(s) == []


# ---- verdict and table


@pytest.mark.parametrize("verdicts,want", [
    (("pass", "info", "skip"), "PASS"),
    (("pass", "DIFF", "DIFF", "info"), "PASS with 2 DIFF rows"),
    (("pass", "DIFF", "FAIL"), "FAIL"),
    (("FAIL",), "FAIL"),
])
def test_verdict(verdicts, want):
    assert report.verdict(rows_of(*verdicts)) == want


def test_a_stage_not_run_for_the_deadline_makes_the_verdict_fail():
    rows = rows_of("pass") + report.stage_rows(3, {"status": "deadline", "deadline_s": 540, "elapsed_s": 541}, None)
    assert rows[-1]["verdict"] == "skip" and "not started" in rows[-1]["check"]
    assert report.verdict(rows) == "FAIL"


def test_table_has_one_line_per_row_and_the_verdict_last():
    rows = rows_of("pass", "DIFF") + [report.row("a | b", "x\ny", "z", "skip", "code", stage=2)]
    text = report.table_md(rows, {"gpu": "H200", "python": "3.12.1", "empty": ""})
    lines = text.strip().splitlines()
    assert lines[0] == "host: gpu H200, python 3.12.1"
    assert "| # | stage | check | expected | seen | result |" in lines
    assert "| 3 | 2 | a / b | x y | z | skip |" in lines
    assert "rows: 1 DIFF, 1 pass, 1 skip" in lines
    assert lines[-1] == "PASS with 1 DIFF rows"


def test_stage_rows_from_what_a_stage_left(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    # no rows at all: FAIL, whatever the exit status
    r = report.stage_rows(2, {"status": "ran", "rc": 0}, out)
    assert [x["verdict"] for x in r] == ["FAIL"] and "rows" in r[0]["check"]
    # rows, all pass, but a non-zero exit: one FAIL row added
    (out / "rows.jsonl").write_text(json.dumps(report.row("x", "e", "s", "pass", "code")) + "\n\nnot json\n")
    r = report.stage_rows(2, {"status": "ran", "rc": 3}, out)
    assert [x["verdict"] for x in r] == ["pass", "FAIL", "FAIL"]
    assert "rows.jsonl" in r[1]["check"] and "exit 3" in r[2]["seen"]
    assert all(x["stage"] == 2 for x in r)
    # a FAIL row explains the non-zero exit: nothing added
    (out / "rows.jsonl").write_text(json.dumps(report.row("x", "e", "s", "FAIL", "code")) + "\n")
    assert len(report.stage_rows(2, {"status": "ran", "rc": 1}, out)) == 1
    # missing and killed stages
    assert report.stage_rows(3, {"status": "missing"}, None)[0]["check"] == "stage 3: not in bundle"
    r = report.stage_rows(2, {"status": "killed", "rc": -9, "seconds": 70}, out)
    assert r[-1]["verdict"] == "FAIL" and "killed" in r[-1]["seen"]


# ---- verify's stage loop


def fake_repo(tmp_path, stages: dict[int, str]) -> pathlib.Path:
    repo = tmp_path / "repo"
    d = repo / "scripts" / "gpu-bundle"
    d.mkdir(parents=True)
    for n, body in stages.items():
        (d / f"stage{n}.sh").write_text("set -u\n" + body)
    return repo


def run_verify(tmp_path, repo, *args):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(GB / "runner.py"), "--bundle", str(tmp_path), "--repo", str(repo),
                        "--python", sys.executable, "--out", str(out), "--driver", "testdriver",
                        "--libcuda", "/nonexistent/libcuda.so.1", *args],
                       capture_output=True, text=True, timeout=120)
    return p, out


ROW = 'echo \'{"check": "%s", "expected": "e", "seen": "s", "verdict": "%s", "kind": "k"}\' >>"$STAGE_OUT/rows.jsonl"\n'


def test_deadline_skips_a_stage_and_the_ones_before_it_are_reported(tmp_path):
    repo = fake_repo(tmp_path, {
        1: ROW % ("one", "pass") + "sleep 1.5\n",
        2: "touch \"$REPO/stage2-ran\"\n" + ROW % ("two", "pass"),
    })
    p, out = run_verify(tmp_path, repo, "--stages", "1 2", "--deadline", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.rstrip().splitlines()[-1] == "FAIL"
    assert not (repo / "stage2-ran").exists()
    res = json.loads((out / "results.json").read_text())
    assert [s["status"] for s in res["stages"]] == ["ran", "deadline"]
    assert [(r["stage"], r["check"], r["verdict"]) for r in res["rows"]] == [
        (1, "one", "pass"), (2, "stage 2 (clients): not started", "skip")]


def test_stage_environment_missing_stage_and_results_after_every_stage(tmp_path):
    repo = fake_repo(tmp_path, {
        1: 'env | grep -E "^(BUNDLE|REPO|PYTHON|STAGE_OUT|STAGE_DEADLINE|KVCACHED_LIBCUDA|VERIFY_DRIVER|JOBS)=" '
           '| sort >"$STAGE_OUT/env"\npwd >"$STAGE_OUT/cwd"\n' + ROW % ("one", "pass")
           + 'echo \'{"probe.map_us": {"value": 1.5, "unit": "us"}}\' >"$STAGE_OUT/figures.json"\n',
        2: 'cp "$STAGE_OUT/../results.json" "$STAGE_OUT/seen-before.json"\n' + ROW % ("two", "DIFF"),
        4: "exit 0\n",
    })
    p, out = run_verify(tmp_path, repo, "--stages", "1 2 3 4", "--jobs", "7")
    assert p.returncode == 1  # stage 3 missing, stage 4 without rows
    env = dict(line.split("=", 1) for line in (out / "stage1" / "env").read_text().splitlines())
    assert env["REPO"] == str(repo) and env["BUNDLE"] == str(tmp_path) and env["JOBS"] == "7"
    assert env["STAGE_OUT"] == str(out / "stage1") and env["VERIFY_DRIVER"] == "testdriver"
    assert env["KVCACHED_LIBCUDA"] == "/nonexistent/libcuda.so.1" and env["PYTHON"] == sys.executable
    assert int(env["STAGE_DEADLINE"]) > time.time() + 400
    assert (out / "stage1" / "cwd").read_text().strip() == str(repo)
    before = json.loads((out / "stage2" / "seen-before.json").read_text())
    assert [r["check"] for r in before["rows"]] == ["one"]  # written after stage 1, before stage 2 ended
    res = json.loads((out / "results.json").read_text())
    assert set(res) == {"verdict", "host", "stages", "rows", "figures"}
    assert res["verdict"] == "FAIL"
    assert {"date", "python", "gpu", "verify_driver", "driver_lib"} <= set(res["host"])
    assert res["figures"] == {"probe.map_us": {"value": 1.5, "unit": "us"}}
    checks = [(r["stage"], r["check"], r["verdict"]) for r in res["rows"]]
    assert checks == [(1, "one", "pass"), (2, "two", "DIFF"), (3, "stage 3: not in bundle", "FAIL"),
                      (4, "stage 4 (figures): rows", "FAIL")]
    assert [s["stage"] for s in res["stages"]] == [1, 2, 3, 4]
    assert (out / "table.md").read_text().rstrip().endswith("FAIL")
    with tarfile.open(out / "logs.tar.gz") as tf:
        names = tf.getnames()
    assert "verify-out/results.json" in names and "verify-out/stage1/rows.jsonl" in names


def test_a_stage_past_the_deadline_and_grace_is_killed(tmp_path):
    repo = fake_repo(tmp_path, {1: ROW % ("one", "pass") + "sleep 60 & wait\n", 2: ROW % ("two", "pass")})
    t = time.time()
    p, out = run_verify(tmp_path, repo, "--stages", "1 2", "--deadline", "0.5", "--grace", "1")
    assert time.time() - t < 30
    res = json.loads((out / "results.json").read_text())
    assert [s["status"] for s in res["stages"]] == ["killed", "deadline"]
    assert [r["verdict"] for r in res["rows"]] == ["pass", "FAIL", "skip"]
    assert p.stdout.rstrip().splitlines()[-1] == "FAIL"


def test_diff_rows_pass_with_exit_0(tmp_path):
    repo = fake_repo(tmp_path, {1: ROW % ("one", "DIFF") + ROW % ("two", "skip")})
    p, out = run_verify(tmp_path, repo, "--stages", "1")
    assert p.returncode == 0 and p.stdout.rstrip().splitlines()[-1] == "PASS with 1 DIFF rows"


def test_bad_figures_are_a_fail_row(tmp_path):
    repo = fake_repo(tmp_path, {1: ROW % ("one", "pass") + 'echo \'{"x": 3}\' >"$STAGE_OUT/figures.json"\n'})
    p, out = run_verify(tmp_path, repo, "--stages", "1")
    res = json.loads((out / "results.json").read_text())
    assert res["rows"][-1]["check"] == "stage 1: figures.json" and res["verdict"] == "FAIL"


# ---- test programs' results


GO_LOG = """=== RUN   TestA
--- PASS: TestA (0.01s)
=== RUN   TestResume
=== RUN   TestResume/host
=== RUN   TestResume/cuda
    resume_test.go:88: resume refused: pages share one inode
--- FAIL: TestResume (1.00s)
    --- PASS: TestResume/host (0.50s)
    --- FAIL: TestResume/cuda (0.50s)
=== RUN   TestSkip
    x_test.go:3: no second device
--- SKIP: TestSkip (0.00s)
FAIL
"""


def test_go_rows():
    rows = testrows.go_rows("Go", GO_LOG, 1)
    assert rows[0]["verdict"] == "FAIL"
    assert rows[0]["seen"] == "1 passed, 1 failed, 1 skipped of 3 tests (2 subtests)"
    assert [(r["check"], r["verdict"]) for r in rows[1:]] == [("Go: TestResume/cuda", "FAIL")]
    assert "one inode" in rows[1]["seen"]
    ok = testrows.go_rows("Go", "=== RUN   TestA\n--- PASS: TestA (0.01s)\nPASS\n", 0)
    assert [r["verdict"] for r in ok] == ["pass"]
    # no test ran (a crash before any): not a pass
    assert testrows.go_rows("Go", "panic: boom\n", 2)[0]["verdict"] == "FAIL"
    t = testrows.go_rows("Go", "=== RUN   TestA\npanic: test timed out after 5s\n", 2)
    assert "timed out" in t[0]["seen"] and t[0]["verdict"] == "FAIL"


def test_gtest_rows(tmp_path):
    js = tmp_path / "r.json"
    js.write_text(json.dumps({"testsuites": [{"name": "Kvc", "testsuite": [
        {"name": "A", "status": "RUN", "result": "COMPLETED"},
        {"name": "B", "status": "RUN", "result": "COMPLETED", "failures": [{"failure": "x.cc:1\nExpected 0\nsecond"}]},
        {"name": "C", "status": "RUN", "result": "SKIPPED"},
        {"name": "D", "status": "NOTRUN"},
    ]}]}))
    rows = testrows.gtest_rows("C", str(js), "", 1)
    assert rows[0]["seen"] == "1 passed, 1 failed, 1 skipped of 3 tests" and rows[0]["verdict"] == "FAIL"
    assert rows[1]["check"] == "C: Kvc.B" and rows[1]["seen"] == "x.cc:1 / Expected 0 / second"
    crash = testrows.gtest_rows("C", str(tmp_path / "none.json"),
                                "[       OK ] Kvc.A (1 ms)\n[  FAILED  ] Kvc.B (2 ms)\nSegmentation fault\n", 139)
    assert crash[0]["verdict"] == "FAIL" and "crashed" in crash[0]["seen"] and "1 passed" in crash[0]["seen"]
    assert crash[1]["check"] == "C: Kvc.B"


# ---- the host's wheel installer (no pip, no network)


def test_install_wheel_without_pip(tmp_path):
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("demo/__init__.py", "X = 1\n")
        zf.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
        zf.writestr("demo-1.0.data/purelib/demo_extra.py", "Y = 2\n")
        zf.writestr("demo-1.0.data/scripts/demo", "#!python\n")
    site = tmp_path / "site"
    site.mkdir()
    prepare.install_wheel(whl, site)
    assert (site / "demo" / "__init__.py").exists() and (site / "demo_extra.py").exists()
    assert not list(site.glob("*.data"))
    p = subprocess.run([sys.executable, "-c", "import demo, demo_extra; print(demo.X + demo_extra.Y)"],
                       env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert p.stdout.strip() == "3"


def test_stored_wheels_keep_members_and_install(tmp_path):
    """pack.py stored-wheels rewrites a wheel with its members uncompressed:
    same names, order, bytes and modes, still installed by the host's
    installer."""
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    body = "X = 1\n" + "# padding\n" * 500
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("demo/__init__.py", body)
        info = zipfile.ZipInfo("demo-1.0.data/scripts/demo")
        info.external_attr = 0o755 << 16
        zf.writestr(info, "#!python\n")
        zf.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
    before = whl.stat().st_size
    assert subprocess.run([sys.executable, str(GB / "pack.py"), "stored-wheels", str(tmp_path)]).returncode == 0
    with zipfile.ZipFile(whl) as zf:
        assert [i.filename for i in zf.infolist()] == ["demo/__init__.py", "demo-1.0.data/scripts/demo",
                                                       "demo-1.0.dist-info/METADATA"]
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        assert zf.read("demo/__init__.py").decode() == body
        assert zf.getinfo("demo-1.0.data/scripts/demo").external_attr >> 16 == 0o755
    assert whl.stat().st_size > before  # really uncompressed
    site = tmp_path / "site"
    site.mkdir()
    prepare.install_wheel(whl, site)
    assert (site / "demo" / "__init__.py").read_text() == body


# ---- stage 3's build starts early, in the background, on a real driver


def test_stage3_build_starts_in_the_background_on_a_real_driver_only(tmp_path):
    """On a real driver verify.sh starts stage 3 once more at its beginning,
    niced, with STAGE3_PREBUILD=1 (the build only: it overlaps stages 1 and
    2), then runs the stages as usual; on the test driver, or with
    STAGE3_BUILD=prebuilt:... / STAGE3_PREBUILD_EARLY=0, it does not."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gb_runner", GB / "runner.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    assert runner.wants_prebuild("1 2 3 4", "real", {})
    assert not runner.wants_prebuild("1 2 3 4", "testdriver", {})
    assert not runner.wants_prebuild("1 2 4", "real", {})
    assert not runner.wants_prebuild("3", "real", {"STAGE3_BUILD": "prebuilt:/x"})
    assert not runner.wants_prebuild("3", "real", {"STAGE3_PREBUILD_EARLY": "0"})
    assert not runner.wants_prebuild("3", "real", {"STAGE3_DEVICE": "cpu"})
    assert not runner.wants_prebuild("1 2 3 4", "real", {}, bundle_prebuilt=True)  # the part llama-cuda
    repo = fake_repo(tmp_path, {
        1: ROW % ("one", "pass") + "sleep 0.5\n",
        3: 'if [ -n "${STAGE3_PREBUILD:-}" ]; then echo "$(nice) $STAGE_OUT" >"$REPO/prebuild-ran"; exit 0; fi\n'
           + ROW % ("three", "pass"),
    })
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(GB / "runner.py"), "--bundle", str(tmp_path), "--repo", str(repo),
                        "--python", sys.executable, "--out", str(out), "--driver", "real", "--stages", "1 3",
                        "--libcuda", "/nonexistent/libcuda.so.1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    niceness, pre_out = (repo / "prebuild-ran").read_text().split()
    assert int(niceness) >= 10 and pre_out == str(out / "stage3-prebuild")
    assert "started in the background" in p.stdout
    res = json.loads((out / "results.json").read_text())
    assert [r["check"] for r in res["rows"]] == ["one", "three"]  # the background run adds no rows


def test_stage3_waits_for_the_background_build_and_reuses_it(tmp_path):
    """stage3.sh with a build in progress elsewhere (the lock of its cache dir
    held): it waits for it, then reuses the finished build instead of
    building; a build that does not finish in time is a skip row, not a
    second build. (CPU device, a fake part and a fake finished build: no
    compiler runs.)"""
    import fcntl
    import hashlib
    import threading

    part = tmp_path / "part"
    part.mkdir()
    (part / "llama.cpp.tar.xz").write_bytes(b"")
    (part / "MANIFEST.json").write_text("{}")
    cache = tmp_path / "cache"
    env = dict(os.environ, REPO=str(ROOT), PYTHON=sys.executable, STAGE3_DEVICE="cpu", STAGE3_BUILD="host",
               STAGE3_PART=str(part), STAGE3_CACHE=str(cache), VERIFY_DRIVER="testdriver", JOBS="1",
               STAGE3_LEAVE="0", STAGE3_CHECK_RESERVE="0")
    key_src = b"".join(pathlib.Path(x).read_bytes() for x in (
        part / "MANIFEST.json", ROOT / "integrations/llama.cpp/apply.py",
        *sorted((ROOT / "integrations/llama.cpp").glob("kvcached_kv*")), GB / "llama-build.sh"))
    c = cache / f"llama-cpu-{hashlib.sha256(key_src).hexdigest()[:16]}"
    c.mkdir(parents=True)
    lock = open(c / "lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # "the background build" is running

    def stage(out, seconds):
        return subprocess.run(["bash", str(GB / "stage3.sh")], env=dict(env, STAGE_OUT=str(out),
                              STAGE_DEADLINE=str(int(time.time() + seconds))), capture_output=True, text=True, timeout=120)

    p = stage(tmp_path / "short", 3)  # the build never finishes in time
    rows = [json.loads(x) for x in (tmp_path / "short" / "rows.jsonl").read_text().splitlines()]
    assert "waiting up to" in p.stdout, p.stdout + p.stderr
    assert any(r["verdict"] == "skip" and "the background build (started by verify.sh) had not finished" in r["seen"]
               for r in rows), rows
    assert not (c / "runs.txt").exists()  # it did not start a build of its own

    def finish():  # the background build ends with a finished tree
        time.sleep(2)
        (c / ".done").write_text("123")
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()

    threading.Thread(target=finish).start()
    p = stage(tmp_path / "long", 8)
    rows = [json.loads(x) for x in (tmp_path / "long" / "rows.jsonl").read_text().splitlines()]
    assert any("reused from" in r["seen"] and "built earlier in 123 s" in r["seen"] for r in rows), p.stdout + p.stderr
    assert not (c / "runs.txt").exists()


# ---- stage 3 on a GPU host: the bundle's prebuilt part, the host's CUDA libraries


def _so(path: pathlib.Path, soname: str, needs: list[pathlib.Path] = ()) -> pathlib.Path:
    """A tiny shared library named `soname` that needs the given libraries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.parent / (path.name + ".c")
    src.write_text("int kvc_test_fn(void) { return 1; }\n")
    cmd = ["cc", "-shared", "-fPIC", "-o", str(path), str(src), f"-Wl,-soname,{soname}", "-Wl,--no-as-needed"]
    for lib in needs:
        cmd += [f"-L{lib.parent}", f"-l:{lib.name}"]
    subprocess.run(cmd, check=True)
    src.unlink()
    return path


def test_cuda_libs_finds_what_the_loader_does_not(tmp_path):
    """tests/helpers/cuda_libs.py: a libggml-cuda.so whose cuBLAS is not on
    the loader's path is resolved from the candidate dirs (the dir goes
    first on LD_LIBRARY_PATH); with no candidate it is reported missing."""
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    import cuda_libs

    cublas = _so(tmp_path / "cu13" / "lib" / "libcublas.so.13", "libcublas.so.13")
    ggml = _so(tmp_path / "ggml" / "libggml-cuda.so", "libggml-cuda.so", [cublas])
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    res = cuda_libs.resolve(str(ggml), dirs=[str(tmp_path / "empty"), str(cublas.parent)], env=env)
    assert res["dirs"] == [str(cublas.parent)] and res["missing"] == [], res
    assert res["found"] == {"libcublas.so.13": str(cublas)}, res
    assert cuda_libs.describe(res) == f"libcublas.so.13 {cublas}"
    res = cuda_libs.resolve(str(ggml), dirs=[], env=env)
    assert res["missing"] == ["libcublas.so.13"] and res["dirs"] == []
    assert cuda_libs.describe(res).startswith("MISSING libcublas.so.13")
    assert cuda_libs.resolve(str(tmp_path / "nope.so"), dirs=[], env=env)["missing"]
    p = subprocess.run([sys.executable, str(ROOT / "tests/helpers/cuda_libs.py"), "--lib", str(ggml), "--json",
                        str(tmp_path / "r.json")], capture_output=True, text=True, env=dict(env, CUDA_HOME=str(tmp_path / "cu13")))
    assert p.returncode == 0 and "libcublas.so.13" in p.stdout, p.stdout + p.stderr  # $CUDA_HOME/lib is a candidate
    assert json.loads((tmp_path / "r.json").read_text())["dirs"] == [str(cublas.parent)]


def _prebuilt_part(tmp_path, arch: str, listing: str) -> pathlib.Path:
    """A stand-in for the part llama-cuda: its layout, a libggml-cuda.so that
    needs a cuBLAS found only under $CUDA_HOME, servers that print `listing`
    for --list-devices."""
    part = tmp_path / "llama-cuda"
    cublas = _so(tmp_path / "cuda" / "lib64" / "libcublas.so.13", "libcublas.so.13")
    _so(part / "ggml" / "lib" / "libggml-cuda.so", "libggml-cuda.so", [cublas])
    for n in ("orig", "kvc"):
        srv = part / f"build-{n}" / "bin" / "llama-server"
        srv.parent.mkdir(parents=True)
        srv.write_text(f"#!/bin/sh\n[ \"$1\" = --list-devices ] && printf '{listing}'\nexit 0\n")
        srv.chmod(0o755)
    (part / "MANIFEST.json").write_text(json.dumps({"cuda_arch": arch, "cuda": "13.0", "llama_cpp": "b11076",
                                                    "built": "2026-11-28 05:00 UTC"}))
    return part


def _stage3_choice(tmp_path, part, arch="90"):
    """stage3.sh on a 'real driver' as verify.sh's background build runs it
    (STAGE3_PREBUILD=1: it chooses the build, builds if it must, runs no
    checks): the rows it writes."""
    out = tmp_path / f"out-{arch}-{len(list(tmp_path.iterdir()))}"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env.update(REPO=str(ROOT), PYTHON=sys.executable, STAGE_OUT=str(out), VERIFY_DRIVER="real", STAGE3_PREBUILD="1",
               STAGE3_CUDA_ARCH=arch, STAGE3_PREBUILT_PART=str(part), STAGE3_PART=str(tmp_path / "no-llama-part"),
               STAGE3_CACHE=str(tmp_path / "cache"), CUDA_HOME=str(tmp_path / "cuda"), CUDACXX="", JOBS="1",
               STAGE_DEADLINE=str(int(time.time() + 300)))
    env["PATH"] = ":".join(d for d in env["PATH"].split(":") if not os.path.exists(os.path.join(d, "nvcc")))
    p = subprocess.run(["bash", str(GB / "stage3.sh")], env=env, capture_output=True, text=True, timeout=120)
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()] if (out / "rows.jsonl").exists() else []
    return p, rows


def test_stage3_uses_the_bundles_prebuilt_part_when_it_fits_the_device(tmp_path):
    """A bundle made with --with llama-cuda: stage 3 on a device of that
    architecture resolves the host's cuBLAS for it, checks that its
    llama-server lists CUDA0, and uses it (no host build: with
    STAGE3_PREBUILD=1 it then stops, having nothing to build)."""
    part = _prebuilt_part(tmp_path, "90", r"Available devices:\n  CUDA0: NVIDIA H200 (143000 MiB, 142000 MiB free)\n")
    p, rows = _stage3_choice(tmp_path, part, "90")
    assert p.returncode == 0, p.stdout + p.stderr
    by = {r["check"]: r for r in rows}
    libs = by["CUDA libraries of ggml-cuda"]
    assert libs["verdict"] == "info" and str(tmp_path / "cuda" / "lib64") in libs["seen"], rows
    pre = by["the bundle's prebuilt llama.cpp (part llama-cuda)"]
    assert pre["verdict"] == "pass" and "CUDA0: NVIDIA H200" in pre["seen"] and "sm_90" in pre["seen"], rows
    assert not any("host build" in r["check"] for r in rows), rows


@pytest.mark.parametrize("case", ["other-arch", "no-cuda0"])
def test_stage3_builds_on_the_host_when_the_prebuilt_part_does_not_fit(tmp_path, case):
    """Built for another architecture (an info row), or its server does not
    see CUDA0 (a FAIL row: it should have run): stage 3 goes on to the host
    build, which here lacks nvcc (its FAIL row proves it was tried)."""
    listing = r"Available devices:\n" if case == "no-cuda0" else r"Available devices:\n  CUDA0: X\n"
    part = _prebuilt_part(tmp_path, "90", listing)
    p, rows = _stage3_choice(tmp_path, part, "80" if case == "other-arch" else "90")
    by = {r["check"]: r for r in rows}
    pre = by["the bundle's prebuilt llama.cpp (part llama-cuda)"]
    if case == "other-arch":
        assert pre["verdict"] == "info" and "for sm_90: not usable on this device" in pre["seen"], rows
    else:
        assert pre["verdict"] == "FAIL" and "building on this host" in pre["seen"], rows
    tools = by["llama.cpp host build: tools"]
    assert tools["verdict"] == "FAIL" and "nvcc" in tools["seen"], rows
    assert p.returncode == 1


def test_gpu_bundle_refuses_an_unknown_optional_part(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-bundle.sh"), str(tmp_path / "b"), "--with", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--with nope: no optional part" in p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "b").exists()


# ---- stage 4's design figures (issue 42 item 7): rows and figures.json from each group's result


def _helpers():
    h = str(ROOT / "tests" / "helpers")
    if h not in sys.path:
        sys.path.insert(0, h)
    import gpu_design_probe
    import gpu_figures

    return gpu_figures, gpu_design_probe


def _st(p50, p99=None, n=10):
    return {"p50_us": p50, "p99_us": p99 if p99 is not None else p50, "n": n}


def test_design_figures_name_units_repetitions_and_the_driver():
    gf, _ = _helpers()
    cases = {
        "handles": {"calls": {"import_original_fd": _st(30), "import_dup_fd": _st(31), "close_last_fd": _st(5)},
                    "facts": {"pages": 10, "close_last_fd_freed_at_once_pages": 10.0}},
        "runs": {"calls": {"set_access_1": _st(25), "set_access_32": _st(64, n=4), "unmap_32": _st(40, n=4)},
                 "lengths": [1, 2, 8, 32, 64], "reps": 4, "errors": {"64": "CudaError: NOT_SUPPORTED"}},
        "sizes": {"sizes": {"2": {"create": _st(11)}, "128": {"create": _st(400)}}, "pages": 8, "errors": {}},
        "memset": {"calls": {"async_32_complete": _st(90, 120), "async_32_issue": _st(5), "sync_32_complete": _st(150)},
                   "pages": [32], "reps": 20},
        "concurrency": {"levels": {"threads_1": {"workers": 1, "calls": 800, "wall_s": 0.5, "calls_per_s": 1600.0,
                                                 "latency": {"create": _st(12)}, "errors": []},
                                   "threads_8": {"workers": 8, "calls": 2400, "wall_s": 0.5, "calls_per_s": 4800.0,
                                                 "latency": {"create": _st(40)}, "errors": []},
                                   "processes_2": {"workers": 2, "errors": ["RuntimeError: worker not ready"]}},
                        "seconds_per_level": 0.5},
        "fdmem": {"steps": {"start": {"Slab": 1000, "SUnreclaim": 500, "fds": 5},
                            "pages_created": {"Slab": 3000, "SUnreclaim": 1500, "fds": 5},
                            "pages_exported": {"Slab": 13000, "SUnreclaim": 6500, "fds": 15},
                            "fds_closed": {"Slab": 4000, "SUnreclaim": 2000, "fds": 5}},
                  "facts": {"n": 10, "fold": "stat_refresh", "rlimit_nofile": 1024}},
    }
    want = {"handles": ("stage4.handle.import_dup_fd_p50_us", "us per call (2 MiB page)", 31.0),
            "runs": ("stage4.run.cuMemSetAccess_32_pages_p50_us", "us per call over 32 pages", 64.0),
            "sizes": ("stage4.size_128mib.create_p99_us", "us per call (128 MiB page)", 400.0),
            "memset": ("stage4.memset.async_32_pages_complete_p99_us", "us (32 x 2 MiB in one reservation)", 120.0),
            "concurrency": ("stage4.concurrency.threads_8_over_1_thread", "x (calls/s against 1 thread)", 3.0),
            "fdmem": ("stage4.fdmem.slab_per_fd_bytes", "bytes per held exported fd", 1000.0)}
    for group, res in cases.items():
        for driver in ("real", "testdriver"):
            figs, r = gf.DESIGN_FIGURES[group](res, driver)
            name, unit, value = want[group]
            assert figs[name]["value"] == value and figs[name]["unit"] == unit, (group, figs)
            assert all(isinstance(f["value"], (int, float)) and f["driver"] == driver for f in figs.values()), group
            assert r["verdict"] == "info" and r["kind"] == "figures" and r["check"] == gf.DESIGN[group][0], r
            assert r["seen"].endswith("[CUDA test driver]") == (driver == "testdriver"), r
            if driver == "testdriver":
                assert all("says nothing about a GPU" in f["note"] for f in figs.values()), group
    figs, r = gf.runs_figures(cases["runs"], "real")
    assert figs["stage4.run.cuMemSetAccess_32_pages_p50_us"]["per_page_p50_us"] == 2.0
    assert figs["stage4.run.cuMemSetAccess_32_pages_p50_us"]["n"] == 4
    assert "one call over 64 pages refused: CudaError: NOT_SUPPORTED" in r["seen"]
    figs, r = gf.concurrency_figures(cases["concurrency"], "real")
    assert "8 threads 4,800 (3.00x)" in r["seen"] and "2 processes: RuntimeError" in r["seen"], r
    figs, r = gf.fdmem_figures(cases["fdmem"], "real")
    assert figs["stage4.fdmem.sunreclaim_per_fd_bytes"]["value"] == 500.0
    assert figs["stage4.fdmem.slab_per_created_page_bytes"]["value"] == 200.0
    assert figs["stage4.fdmem.fds_held"]["value"] == 10 and "fds 5 -> 15 -> 5" in r["seen"]


def test_decode_under_zeroing_alternates_and_turns_the_zeroer_off():
    gf, dp = _helpers()
    log = []
    samples = dp.decode_rounds(lambda k, i: (log.append(("decode", k, i)), 100.0 - 10 * (log[-2] == ("zero", True)))[1],
                               lambda on: log.append(("zero", on)), 3, 64)
    assert samples == {"quiet": [100.0] * 3, "zeroing": [90.0] * 3}
    decodes = [(e, log[i - 1]) for i, e in enumerate(log) if e[0] == "decode"]
    assert [d[1] for d in decodes] == [("zero", False), ("zero", True), ("zero", True), ("zero", False),
                                       ("zero", False), ("zero", True)]
    assert log[-1] == ("zero", False)
    figs, r = gf.decode_zeroing_figures({"samples": samples, "zeroer": {"loops": 10, "bytes": 10 << 30, "running_s": 2.0,
                                                                        "pages": 256}, "tokens": 64, "rounds": 3}, "real")
    assert figs["stage4.decode_zeroing.zeroing_over_quiet"]["value"] == 0.9
    assert "the zeroer: 10 loops over 256 pages" in r["seen"] and r["verdict"] == "info"


def test_the_zeroer_zeroes_while_told_and_reports_at_eof(tmp_path):
    """decode_zeroing's load process, on the CUDA test driver (the dry run
    has no llama-server, so this is what runs it without a GPU)."""
    lib = ROOT / "build" / "testdriver" / "libcuda.so.1"
    if not lib.exists():
        pytest.skip("the CUDA test driver is not built (scripts/build-testdriver.sh)")
    env = dict(os.environ, KVCACHED_LIBCUDA=str(lib), KVCACHED_TESTDRV_STATE=str(tmp_path / "state"),
               KVCACHED_TESTDRV_MEMORY=str(1 << 30), PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "gpu_design_probe.py"), "zeroer", "--scale",
                          "small"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.poll() is not None else ""
        p.stdin.write("run\n")
        p.stdin.flush()
        time.sleep(0.5)
        p.stdin.write("pause\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=60)  # closes stdin: EOF ends the zeroer
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["loops"] >= 1 and res["bytes"] == res["loops"] * 32 * (2 << 20) and res["pages"] == 32, res


# ---- stage 1: gpu-check.sh with its whole record in STAGE_OUT

def test_stage1_runs_gpu_check_into_stage_out_with_the_last_failures_first(tmp_path):
    """stage1.sh runs the repository's scripts/gpu-check.sh (here a stand-in
    that records what it was given) with GPU_CHECK_OUT=$STAGE_OUT, so the
    pytest log, JUnit XML, skip list and outcomes (docs/gpu-check.md, "The
    CUDA test set") land in $VERIFY_OUT/stage1; its dry run selects a test
    of tests/cuda/gpu-first.txt, so the path that runs those first is taken
    there too; on a real driver gpu-check.sh's own defaults apply."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    fake = repo / "scripts" / "gpu-check.sh"
    fake.write_text('#!/usr/bin/env bash\nenv | grep -E "^(GPU_CHECK_|KVCACHED_TESTDRV_STATE)" | sort > "$GPU_CHECK_OUT/env"\n')
    fake.chmod(0o755)
    first = [ln for ln in (ROOT / "tests" / "cuda" / "gpu-first.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    for driver in ("testdriver", "real"):
        out = tmp_path / driver
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "KVCACHED_"))}
        env.update(REPO=str(repo), PYTHON=sys.executable, STAGE_OUT=str(out), KVCACHED_LIBCUDA="libcuda.so.1",
                   VERIFY_DRIVER=driver)
        p = subprocess.run(["bash", str(GB / "stage1.sh")], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        got = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines())
        assert got["GPU_CHECK_OUT"] == str(out)
        if driver == "testdriver":
            assert any(t in got["GPU_CHECK_TESTS"].split() for t in first), got
            assert "KVCACHED_TESTDRV_STATE" in got
        else:
            assert "GPU_CHECK_TESTS" not in got and "GPU_CHECK_FIRST" not in got, got  # gpu-check.sh's defaults


def test_stage5_capacity_runs_before_the_figures_by_default():
    """Stage 5 (issue 44) is in verify.sh's default run, after the
    re-verification and before stage 4's long figures, and has a name."""
    text = (GB / "verify.sh").read_text()
    assert 'VERIFY_STAGES="${VERIFY_STAGES:-1 2 3 5 4}"' in text and "--stages)" in text
    assert report.STAGE_NAMES[5] == "capacity" and (GB / "stage5.sh").exists()
