"""Fixtures: a real kvcached-serve process per test, on the host backend
or on the CUDA backend through the test driver (helpers live in kvtest.py).

`daemon_factory(**settings)` starts one and waits until its health service
answers SERVING; at teardown it sends SIGTERM and asserts a clean exit
(status 0, socket files removed, and on the test driver an empty leak
report).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

from kvtest import ROOT, SERVE, Daemon, backends, leak_problems, require_testdriver_features, testdriver_env, testdriver_features, wait_serving


# ---------------------------------------------------------------------------
# The CUDA test set (docs/gpu-check.md, "The CUDA test set"): every test of
# the CUDA path, whatever file it lives in, carries the `cuda` mark, so that
# `pytest -m cuda $(grep -v "^#" tests/cuda/suite.txt)` runs on another libcuda
# (KVCACHED_TEST_LIBCUDA: the public-only test driver, NVIDIA's driver) every
# test that can run there. Marked: everything under tests/cuda/, the files
# named in CUDA_FILES, a test whose `backend` parameter is "cuda", and a test
# that says so itself (@pytest.mark.cuda).

CUDA_FILES = ("test_cuda_faults.py", "test_gpu_check.py")
HERE = pathlib.Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: a test of the CUDA path: part of the CUDA test set that runs on any libcuda "
                                       "(docs/gpu-check.md, \"The CUDA test set\")")
    config.addinivalue_line("markers", "testdriver(what): what of the CUDA test driver's private features a test needs "
                                       "(the needs_testdriver fixture's skip reason on another libcuda)")


def _is_cuda(item) -> bool:
    if item.get_closest_marker("cuda") is not None:
        return True
    path = pathlib.Path(str(item.fspath)).resolve()
    if path.parent == HERE / "cuda" or path.name in CUDA_FILES and path.parent == HERE:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("backend") == "cuda"


def first_ids(path: str) -> list[str]:
    """The node ids a KVCACHED_TEST_FIRST file names, in order (one a
    line; `#` comments and blank lines ignored)."""
    ids = []
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            ids.append(line)
    return ids


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the mark must be there by then
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_cuda(item) and item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda)
    # KVCACHED_TEST_FIRST=FILE: the tests it names run first, in its order (a
    # name without parameters takes every parametrization), then the rest in
    # their usual order. The GPU bundle re-verifies a GPU run's failures first
    # this way (tests/cuda/gpu-first.txt).
    first = os.environ.get("KVCACHED_TEST_FIRST")
    if first:
        order = first_ids(first)

        def rank(item) -> int:
            for i, nid in enumerate(order):
                if item.nodeid == nid or item.nodeid.startswith(nid + "["):
                    return i
            return len(order)

        items[:] = sorted(items, key=rank)  # stable: the rest keep their order


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[Daemon] = []
    cleanup: list[pathlib.Path] = []

    def start(backend: str = "host", *, env: dict | None = None, wait: bool = True, shared_dir: bool = False,
              socket: str | None = None, wrap: list[str] | None = None, pass_fds: tuple = (),
              tree: pathlib.Path | None = None, **settings) -> Daemon:
        """shared_dir: put the sockets where other uids can reach them (the
        pytest tmp dir is private to root). wrap: a command the daemon's is
        appended to (it execs it); pass_fds: fds the daemon (or wrap) inherits;
        tree: run the kvcached_service of this directory (another revision's,
        tests/test_upgrade.py) instead of this checkout's."""
        n = len(started)
        sock_dir = tmp_path
        if shared_dir:
            sock_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvc-shared-"))
            sock_dir.chmod(0o755)
            cleanup.append(sock_dir)
        sock = socket or str(sock_dir / f"kvc{n}.sock")
        log = tmp_path / f"daemon{n}.log"
        extra_env: dict[str, str] = {}
        report = None
        if backend == "cuda":
            knobs = sorted(k for k in (env or {}) if k.startswith("KVCACHED_TESTDRV_"))
            if knobs:  # the test needs them: skipped, naming them, on another libcuda
                require_testdriver_features(*knobs)
            extra_env = testdriver_env()
            if testdriver_features():  # another libcuda writes no leak report
                report = tmp_path / f"leaks{n}.json"
        extra_env.update(env or {})
        args = ["--socket", sock, "--backend", backend]
        settings.setdefault("memory_limit", "256MiB")
        settings.setdefault("shutdown_grace", "0.5")
        for k, v in settings.items():
            if isinstance(v, bool):
                args.append(f"--{k.replace('_', '-')}" if v else f"--no-{k.replace('_', '-')}")
            else:
                args += [f"--{k.replace('_', '-')}", str(v)]
        penv = dict(os.environ)
        penv.update(extra_env)
        if report is not None:
            penv["KVCACHED_TESTDRV_REPORT"] = str(report)
        penv["PYTHONPATH"] = str(tree or ROOT)
        with open(log, "w") as logf:
            proc = subprocess.Popen((wrap or []) + SERVE + args, env=penv, stdout=logf, stderr=subprocess.STDOUT,
                                    pass_fds=pass_fds, cwd=tree)  # `-m` looks in the working directory first
        d = Daemon(proc, sock, log, extra_env, report)
        started.append(d)
        if wait:
            wait_serving(sock, proc, log)
        return d

    yield start
    problems = []
    for d in started:
        if d.proc.poll() is None:
            rc = d.stop()
            if rc != 0:
                problems.append(f"daemon exited {rc} after SIGTERM:\n{d.log_text()}")
            for path in (d.socket, d.fd_socket):
                if os.path.exists(path):
                    problems.append(f"{path} left behind after shutdown")
            if d.report is not None:
                problems.extend(leak_problems(d.report))
    for path in cleanup:
        shutil.rmtree(path, ignore_errors=True)
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture(params=backends())
def backend(request) -> str:
    return request.param


@pytest.fixture
def daemon(daemon_factory, backend):
    return daemon_factory(backend)


@pytest.fixture
def host_daemon(daemon_factory):
    return daemon_factory("host")


