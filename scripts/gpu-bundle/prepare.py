"""The GPU host's half of the bundle's preparation (verify.sh runs it with the
host's python; standard library only).

    python prepare.py unpack SRC WORK
        parts/*.tar.xz of the bundle SRC into WORK: repo.tar.xz -> WORK/repo,
        every other part NAME -> WORK/parts/NAME; MANIFEST.json -> WORK.
    python prepare.py venv REPO WHEELS ROWS [--extra-site DIR]...
        REPO/.venv: a venv of this python with the host's site-packages
        (--system-site-packages: its torch, grpcio, protobuf, numpy, pytest),
        the bundle's wheels (WHEELS/*.whl) unpacked into it (no pip, no
        network: a host without ensurepip works too), REPO itself on its path
        (a .pth), and bin/kvcached-serve, bin/kvcachedctl. Then imports what
        the daemon and the stages need and writes rows to ROWS (stage 0).
        --extra-site adds a directory to the path after everything else (the
        dry run's stand-in for a GPU host's site-packages).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import site as pysite
import subprocess
import sys
import tarfile
import zipfile

# module -> (what needs it, required?)
IMPORTS = {
    "kvcached_service.server": ("the daemon", True),
    "kvcached_service.cuda.driver": ("the CUDA backend", True),
    "grpc": ("the daemon (host: grpcio)", True),
    "grpc_health.v1.health": ("the daemon (bundle: grpcio-health-checking)", True),
    "grpc_reflection.v1alpha.reflection": ("the daemon (bundle: grpcio-reflection)", True),
    "google.protobuf": ("the daemon (host: protobuf)", True),
    "pydantic": ("the daemon (bundle)", True),
    "pydantic_settings": ("the daemon (bundle)", True),
    "prometheus_client": ("the daemon (host)", True),
    "pytest": ("the behaviour tests (host)", True),
    "numpy": ("the tests and gguf (host)", True),
    "pynvml": ("device memory checks (host: nvidia-ml-py)", False),
    "uvloop": ("the daemon's event loop (bundle; asyncio's without it)", False),
    "gguf": ("the test models (bundle)", False),
    "torch": ("tests that use torch (host)", False),
}


def extract(tar: pathlib.Path, dest: pathlib.Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar) as tf:
        try:
            tf.extractall(dest, filter="tar")
        except TypeError:  # a python without extraction filters
            tf.extractall(dest)


def unpack(src: pathlib.Path, work: pathlib.Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for tar in sorted((src / "parts").glob("*.tar.xz")):
        name = tar.name[: -len(".tar.xz")]
        dest = work / "repo" if name == "repo" else work / "parts" / name
        if dest.exists():
            shutil.rmtree(dest)
        extract(tar, dest)
        print(f"unpacked {name}: {tar.stat().st_size / 2**20:.1f} MiB -> {dest}")
    if (src / "MANIFEST.json").exists():
        shutil.copy(src / "MANIFEST.json", work / "MANIFEST.json")


def install_wheel(whl: pathlib.Path, site: pathlib.Path) -> None:
    """A wheel unpacked as an installer would (purelib/platlib data moved
    into place; scripts and headers are not needed here)."""
    with zipfile.ZipFile(whl) as zf:
        zf.extractall(site)
        names = zf.namelist()
    for data in {n.split("/")[0] for n in names if n.split("/")[0].endswith(".data")}:
        d = site / data
        for sub in ("purelib", "platlib"):
            if (d / sub).is_dir():
                for item in (d / sub).iterdir():
                    target = site / item.name
                    if target.is_dir() and item.is_dir():
                        shutil.copytree(item, target, dirs_exist_ok=True)
                    else:
                        shutil.move(str(item), str(target))
        shutil.rmtree(d, ignore_errors=True)


SCRIPT = """#!{python}
import sys
from {module} import {func}
sys.exit({func}())
"""


def make_venv(repo: pathlib.Path, wheels: pathlib.Path, rows_path: pathlib.Path, extra_sites: list[str]) -> int:
    rows: list[dict] = []

    def row(check, expected, seen, verdict, kind="prepare"):
        rows.append({"check": check, "expected": expected, "seen": seen, "verdict": verdict, "kind": kind})

    venv = repo / ".venv"
    py = venv / "bin" / "python"
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    manifest = {}
    if (repo.parent / "MANIFEST.json").exists():
        manifest = json.loads((repo.parent / "MANIFEST.json").read_text())
    want = manifest.get("python_version", ver)
    row("host python", f"python{want} (the bundle's wheels are for it)", f"{sys.executable}: {sys.version.split()[0]}",
        "pass" if want == ver else "FAIL")
    try:
        if venv.exists():
            shutil.rmtree(venv)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                       check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        row("python venv", "python -m venv works", f"failed: {(exc.stderr or '').strip()[-300:]}", "FAIL")
        write_rows(rows_path, rows)
        return 1
    site = pathlib.Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       check=True, capture_output=True, text=True).stdout.strip())
    whls = sorted(wheels.glob("*.whl"))
    for whl in whls:
        install_wheel(whl, site)
    # --system-site-packages reaches the base interpreter's packages only: a host
    # python that is itself a venv (GPU images ship torch in one, e.g.
    # /opt/torch/.venv) keeps its packages in its own site dirs, added here
    # after the bundle's wheels
    host_sites = [d for d in pysite.getsitepackages() if os.path.isdir(d)] if sys.prefix != sys.base_prefix else []
    (site / "kvcached_bundle.pth").write_text("\n".join([str(repo), *extra_sites, *host_sites]) + "\n")
    for name, module, func in (("kvcached-serve", "kvcached_service.server.ops.main", "main"),
                               ("kvcachedctl", "kvcached_service.ctl", "main")):
        p = venv / "bin" / name
        p.write_text(SCRIPT.format(python=py, module=module, func=func))
        p.chmod(0o755)
    row("bundle wheels installed into the venv", "every wheel", f"{len(whls)} wheels into {site}",
        "pass" if whls else "FAIL")
    # the control socket's relay (relay.c, no Python API): built here, with
    # this host's compiler, with setup.py's flags
    relay_c = repo / "kvcached_service" / "server" / "transports" / "relay.c"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        row("control socket relay (relay.c) built", "a C compiler (cc) on PATH", "none", "FAIL")
    else:
        r = subprocess.run([cc, "-O2", "-Wall", "-shared", "-fPIC", "-o", str(relay_c.with_name("_relay.abi3.so")),
                            str(relay_c), "-lpthread"], capture_output=True, text=True, timeout=300)
        row("control socket relay (relay.c) built", f"{cc} compiles it",
            "built" if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()[-300:]}",
            "pass" if r.returncode == 0 else "FAIL")
    probe = (
        "import importlib, importlib.metadata, json, sys\n"
        "dists = importlib.metadata.packages_distributions()\n"
        "out = {}\n"
        f"for m in {list(IMPORTS)!r}:\n"
        "    try:\n"
        "        mod = importlib.import_module(m)\n"
        "        top = m.split('.')[0]\n"
        "        try:\n"
        "            ver = importlib.metadata.version(dists.get(top, [top])[0])\n"
        "        except Exception:\n"
        "            ver = str(getattr(sys.modules[top], '__version__', ''))\n"
        "        out[m] = {'ok': True, 'version': ver, 'file': str(getattr(mod, '__file__', ''))}\n"
        "    except Exception as exc:\n"
        "        out[m] = {'ok': False, 'error': f'{type(exc).__name__}: {exc}'[:300]}\n"
        "print(json.dumps(out))\n"
    )
    p = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=str(repo), timeout=300)
    try:
        res = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        row("python imports", "the probe runs", f"exit {p.returncode}: {p.stderr.strip()[-300:]}", "FAIL")
        write_rows(rows_path, rows)
        return 1
    missing = [m for m, (_, req) in IMPORTS.items() if req and not res[m]["ok"]]
    row("python: what the daemon and the tests import", "all importable",
        "yes" if not missing else "; ".join(f"{m}: {res[m]['error']}" for m in missing),
        "FAIL" if missing else "pass")
    where = []
    for m, (why, req) in IMPORTS.items():
        r = res[m]
        if r["ok"]:
            src = "bundle" if r["file"].startswith(str(venv)) else "repo" if r["file"].startswith(str(repo)) else "host"
            where.append(f"{m.split('.')[0]} {r['version']} ({src})")
        elif not req:
            row(f"python: {m}", f"importable ({why})", r["error"], "info")
    row("python packages in use", "recorded", ", ".join(dict.fromkeys(where)), "info")
    write_rows(rows_path, rows)
    return 1 if missing else 0


def write_rows(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unpack")
    u.add_argument("src")
    u.add_argument("work")
    v = sub.add_parser("venv")
    v.add_argument("repo")
    v.add_argument("wheels")
    v.add_argument("rows")
    v.add_argument("--extra-site", action="append", default=[])
    a = ap.parse_args(argv)
    if a.cmd == "unpack":
        unpack(pathlib.Path(a.src), pathlib.Path(a.work))
        return 0
    return make_venv(pathlib.Path(a.repo), pathlib.Path(a.wheels), pathlib.Path(a.rows),
                     [os.path.abspath(s) for s in a.extra_site if s])


if __name__ == "__main__":
    sys.exit(main())
