"""Where a GPU host keeps the CUDA libraries a ggml-cuda build needs (the
offline GPU bundle's stage 3, scripts/gpu-bundle/stage3.sh).

    python tests/helpers/cuda_libs.py --lib DIR/libggml-cuda.so [--json FILE]

libggml-cuda.so needs libcudart, libcublas, libcublasLt (CUDA 13: .so.13) and
libcuda.so.1. The bundle's prebuilt carries libcudart next to it; cuBLAS
(hundreds of MiB) comes from the host, and an installed ggml's RUNPATH is only
$ORIGIN, so what the dynamic loader does not find by itself is looked for in:
$CUDA_HOME / $CUDA_PATH, the toolkit of the nvcc on PATH, /usr/local/cuda*,
and the python's nvidia wheels (torch's CUDA build brings nvidia/cu13/lib or
nvidia/cublas/lib). Prints one line (what was found where, or what is
missing) and writes {"dirs": [...], "found": {name: path}, "missing": [...]}
to --json: dirs is what to put first on LD_LIBRARY_PATH. Exit 0 when nothing
is missing, 1 otherwise. Standard library only (it runs before the venv's
extras matter).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys

NOT_FOUND = re.compile(r"^\s*(\S+) => not found", re.M)
RESOLVED = re.compile(r"^\s*(\S+) => (/\S+)", re.M)


def candidate_dirs(env: dict | None = None) -> list[str]:
    """Directories that may hold CUDA libraries on this host, most specific first."""
    env = os.environ if env is None else env
    dirs: list[str] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            dirs += [os.path.join(env[var], "lib64"), os.path.join(env[var], "lib")]
    nvcc = env.get("CUDACXX") or shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        top = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        dirs += [os.path.join(top, "lib64"), os.path.join(top, "lib"), os.path.join(top, "targets/x86_64-linux/lib")]
    dirs += ["/usr/local/cuda/lib64", *sorted(glob.glob("/usr/local/cuda-*/lib64"), reverse=True)]
    try:  # the python's nvidia wheels (torch's CUDA build depends on them)
        import nvidia  # type: ignore[import-not-found]

        for base in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(base, "*", "lib")))
    except ImportError:
        pass
    seen: set[str] = set()
    return [d for d in dirs if os.path.isdir(d) and not (d in seen or seen.add(d))]


def ldd(lib: str, extra: list[str], env: dict | None = None) -> str:
    env = dict(os.environ if env is None else env)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*extra, *filter(None, [env.get("LD_LIBRARY_PATH", "")])])
    return subprocess.run(["ldd", lib], capture_output=True, text=True, env=env, timeout=60).stdout


def resolve(lib: str, dirs: list[str] | None = None, env: dict | None = None) -> dict:
    """What `lib` lacks under the loader's own search, looked for in `dirs`
    (default: candidate_dirs()); {"dirs", "found", "missing"}."""
    if not os.path.exists(lib):
        return {"dirs": [], "found": {}, "missing": [lib], "error": f"{lib} does not exist"}
    dirs = candidate_dirs(env) if dirs is None else dirs
    chosen: list[str] = []
    for name in NOT_FOUND.findall(ldd(lib, [], env)):
        for d in dirs:
            if os.path.exists(os.path.join(d, name)):
                if d not in chosen:
                    chosen.append(d)
                break
    out = ldd(lib, chosen, env)
    found = {n: p for n, p in RESOLVED.findall(out) if re.match(r"lib(cudart|cublas|cublasLt|cuda)\.so", n)}
    return {"dirs": chosen, "found": found, "missing": NOT_FOUND.findall(out)}


def describe(res: dict) -> str:
    if res.get("error"):
        return res["error"]
    parts = [f"{n} {p}" for n, p in sorted(res["found"].items())]
    if res["missing"]:
        parts.insert(0, "MISSING " + ", ".join(res["missing"]))
    return "; ".join(parts) or "no CUDA libraries linked"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True, help="the library whose needs to resolve (libggml-cuda.so)")
    ap.add_argument("--json", default="", help="write the result here")
    a = ap.parse_args(argv)
    res = resolve(a.lib)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(describe(res))
    return 1 if res["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
