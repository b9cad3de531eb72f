"""The CUDA test set itself (docs/gpu-check.md, "The CUDA test set"): the
files tests/cuda/suite.txt names, the ids tests/cuda/gpu-first.txt runs
first, the `cuda` mark and the order (tests/conftest.py), and the skip list
and outcomes tests/helpers/pytest_report.py makes of a run. No driver is
needed: these keep the lists from rotting."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

from kvtest import HELPERS, ROOT

SUITE = ROOT / "tests" / "cuda" / "suite.txt"
FIRST = ROOT / "tests" / "cuda" / "gpu-first.txt"


def entries(path: pathlib.Path) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines() if ln.split("#", 1)[0].strip()]


def test_every_file_of_the_set_exists_and_imports_with_what_a_gpu_host_has():
    for e in entries(SUITE):
        path = ROOT / e
        assert path.exists(), e
        for f in [path] if path.is_file() else sorted(path.glob("test_*.py")):
            mods = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Import)}
            mods |= {(n.module or "").split(".")[0] for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ImportFrom)}
            assert "hypothesis" not in mods, f"{f}: the GPU bundle carries no hypothesis"


def test_every_test_to_run_first_exists():
    for nid in entries(FIRST):
        file, _, name = nid.partition("::")
        src = (ROOT / file).read_text()
        assert f"def {name.split('[')[0]}(" in src, f"{nid}: no such test (tests/cuda/gpu-first.txt)"


def test_the_mark_the_selection_and_the_order(tmp_path):
    """-m cuda takes the tests of tests/cuda, those whose backend is cuda
    and those marked so, nothing else; KVCACHED_TEST_FIRST puts the tests it
    names first, in its order, every parametrization of a bare name."""
    tests = tmp_path / "tests"
    (tests / "cuda").mkdir(parents=True)
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tests / "cuda" / "test_in_cuda.py").write_text("def test_a():\n    pass\n")
    (tests / "test_mixed.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture(params=["host", "cuda"])
        def backend(request):
            return request.param

        def test_host_only():
            pass

        def test_both(backend):
            pass

        @pytest.mark.cuda
        def test_marked():
            pass

        @pytest.mark.parametrize("n", [1, 2])
        def test_first(n):
            pass
    """))
    first = tmp_path / "first.txt"
    first.write_text("# comment\ntests/test_mixed.py::test_marked\n\ntests/test_mixed.py::test_both[cuda]  # one parametrization\n")
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_TEST_FIRST"}
    env.update(KVCACHED_TEST_FIRST=str(first), PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-m", "cuda",
                        "tests/cuda", "tests/test_mixed.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    ids = [ln for ln in p.stdout.splitlines() if "::" in ln]
    assert ids == ["tests/test_mixed.py::test_marked", "tests/test_mixed.py::test_both[cuda]", "tests/cuda/test_in_cuda.py::test_a"], \
        p.stdout + p.stderr


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.cuda.test_x" name="test_one" time="0.1"/>
<testcase classname="tests.test_y" name="test_two[cuda]" time="0.1"><skipped type="pytest.skip" message="needs 2 CUDA devices; one here">tests/test_y.py:9: needs 2 CUDA devices; one here</skipped></testcase>
<testcase classname="tests.test_y" name="test_three" time="0.1"><skipped type="pytest.skip" message="needs 2 CUDA devices; one here">x</skipped></testcase>
<testcase classname="tests.test_y.TestK" name="test_four" time="0.1"><failure message="assert 1 == 2">tb</failure></testcase>
</testsuite></testsuites>"""


def test_the_report_lists_every_skip_by_reason_and_fails_on_a_failure(tmp_path):
    xml = tmp_path / "run.xml"
    xml.write_text(JUNIT)
    skips, outcomes = tmp_path / "skips.txt", tmp_path / "outcomes.txt"
    p = subprocess.run([sys.executable, str(HELPERS / "pytest_report.py"), str(xml), "--skips", str(skips), "--outcomes",
                        str(outcomes), "--label", "t"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stdout  # a failure
    assert p.stdout.splitlines()[0] == "t: 1 passed, 1 failed, 0 errors, 2 skipped of 4", p.stdout
    assert "FAILED tests/test_y.py::TestK::test_four: assert 1 == 2" in p.stdout
    assert skips.read_text().splitlines()[:5] == [
        "# 2 of 4 tests skipped, by reason (1 reasons)", "",
        "## 2: needs 2 CUDA devices; one here", "- tests/test_y.py::test_two[cuda]", "- tests/test_y.py::test_three"]
    assert outcomes.read_text().split() == ["passed", "tests/cuda/test_x.py::test_one", "skipped", "tests/test_y.py::test_two[cuda]",
                                            "skipped", "tests/test_y.py::test_three", "failed", "tests/test_y.py::TestK::test_four"]
    xml.write_text(JUNIT.replace('<failure message="assert 1 == 2">tb</failure>', "")
                   .replace('message="needs 2 CUDA devices; one here">x<', 'message="">x<'))
    p = subprocess.run([sys.executable, str(HELPERS / "pytest_report.py"), str(xml), "--min-passed", "3"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "SKIPPED WITHOUT A REASON" not in p.stdout, p.stdout  # "x" is the text: a reason still
    assert "fewer than the 3 required" in p.stdout, p.stdout
