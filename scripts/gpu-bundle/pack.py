"""The CPU machine's half of the GPU bundle (scripts/gpu-bundle.sh calls it).

    python pack.py repo-files ROOT               the repository files the bundle carries
    python pack.py untracked ROOT                those of them git does not track yet
    python pack.py hash ROOT [--paths P...] [--extra S...]
                                                 an input hash (sha256 of the files' names
                                                 and contents, and of the extra strings)
    python pack.py inputs SCRIPT                 the paths a build-<part>.sh declares
                                                 ("# gpu-bundle-inputs: a b c" lines; none:
                                                 the whole repository)
    python pack.py tar SRC OUT.tar.xz [--list FILE]
                                                 SRC's files (or those listed, relative to
                                                 SRC) as a reproducible tar.xz
    python pack.py size OUTDIR [--max BYTES]     every file's size; exit 1 when the total
                                                 is over BYTES (default 56 MiB)
    python pack.py stored-wheels DIR             rewrite DIR's wheels uncompressed (ZIP_STORED),
                                                 so the part's xz compresses their contents
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

MAX_BYTES = 56 * 2**20

# What the stages never read: recorded bench results, images, the deploy
# manifests, CI files. Everything else tracked goes (the stages run the
# repository's own scripts and tests).
EXCLUDE_PREFIXES = ("bench/results/", "docs/images/", ".github/", "deploy/")
EXCLUDE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg", ".gif", ".pdf", ".webp")


def git_files(root: pathlib.Path, paths: list[str] | None = None) -> list[str]:
    """Tracked files plus untracked ones git does not ignore, that exist in
    the working tree (the bundle is what the tree holds now)."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z", "--", *(paths or [])],
                         check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def repo_files(root: pathlib.Path) -> list[str]:
    """The working tree as the other suites test it: tracked files and
    untracked ones git does not ignore (a new module an edited file imports
    is there too), less what no stage reads."""
    return [f for f in git_files(root) if not f.startswith(EXCLUDE_PREFIXES) and not f.lower().endswith(EXCLUDE_SUFFIXES)]


def untracked(root: pathlib.Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-o", "--exclude-standard", "-z"],
                         check=True, capture_output=True).stdout.decode()
    files = set(repo_files(root))
    return sorted(f for f in out.split("\0") if f and f in files)


def input_hash(root: pathlib.Path, paths: list[str] | None, extra: list[str]) -> str:
    h = hashlib.sha256()
    for s in extra:
        h.update(b"extra\0" + s.encode() + b"\0")
    for f in (git_files(root, paths) if paths else repo_files(root)):
        p = root / f
        h.update(f.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest() if not p.is_symlink() else os.readlink(p).encode())
        h.update(b"x" if os.access(p, os.X_OK) else b"-")
    return h.hexdigest()[:20]


def declared_inputs(script: pathlib.Path) -> list[str]:
    paths: list[str] = []
    for line in script.read_text(errors="replace").splitlines()[:80]:
        if line.startswith("# gpu-bundle-inputs:"):
            paths += line.split(":", 1)[1].split()
    return paths


def make_tar(src: pathlib.Path, out: pathlib.Path, names: list[str] | None = None) -> int:
    """A tar.xz of src (every file, or the names given), sorted, with fixed
    owners and times, so the same inputs give the same bytes. xz preset 1
    (GPU_BUNDLE_XZ_PRESET): on 40 MB of test programs preset 6 saves 2.9 MB
    and costs 40 s more of a 2-core CI machine; a part's build script may ask
    for another (gpu-bundle.sh reads "# gpu-bundle-xz: N" and sets it)."""
    if names is None:
        names = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() or p.is_symlink())
    tmp = out.with_name(out.name + ".tmp")
    with lzma.open(tmp, "wb", preset=int(os.environ.get("GPU_BUNDLE_XZ_PRESET", "1"))) as xz, tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for n in names:
            p = src / n
            ti = tf.gettarinfo(str(p), arcname=n)
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 0
            ti.mode = 0o755 if (ti.isfile() and os.access(p, os.X_OK)) or ti.isdir() else (0o644 if ti.isfile() else ti.mode)
            if ti.isfile():
                with open(p, "rb") as f:
                    tf.addfile(ti, f)
            else:
                tf.addfile(ti)
    os.replace(tmp, out)
    return out.stat().st_size


def stored_wheels(wdir: pathlib.Path) -> None:
    """Each wheel in wdir rewritten with its members uncompressed
    (ZIP_STORED; names, order, dates and modes kept). Still a valid wheel
    (RECORD hashes the members, not the archive), and xz over stored
    members beats deflate inside: 16.8 MB of deflated wheels were 12.1 MB
    this way against 16.8 MB as they came (xz 9, 2026-11-28)."""
    for whl in sorted(wdir.glob("*.whl")):
        tmp = whl.with_name(whl.name + ".tmp")
        with zipfile.ZipFile(whl) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zo:
            for info in zi.infolist():
                ni = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                ni.external_attr = info.external_attr
                ni.compress_type = zipfile.ZIP_STORED
                zo.writestr(ni, zi.read(info))
        os.replace(tmp, whl)


def sizes(outdir: pathlib.Path) -> tuple[int, list[tuple[str, int]]]:
    files = sorted((str(p.relative_to(outdir)), p.stat().st_size) for p in outdir.rglob("*") if p.is_file())
    return sum(s for _, s in files), files


def size_check(outdir: pathlib.Path, max_bytes: int = MAX_BYTES) -> tuple[bool, str]:
    total, files = sizes(outdir)
    lines = [f"  {s / 2**20:8.2f} MiB  {n}" for n, s in files if s >= 64 * 1024]
    small = [s for _, s in files if s < 64 * 1024]
    if small:
        lines.append(f"  {sum(small) / 2**20:8.2f} MiB  ({len(small)} small files)")
    ok = total <= max_bytes
    lines.append(f"bundle {outdir}: {total / 2**20:.2f} MiB ({total} bytes), limit {max_bytes / 2**20:.2f} MiB: "
                 + ("ok" if ok else "TOO BIG"))
    return ok, "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("repo-files")
    s.add_argument("root")
    s = sub.add_parser("untracked")
    s.add_argument("root")
    s = sub.add_parser("hash")
    s.add_argument("root")
    s.add_argument("--paths", nargs="*", default=None)
    s.add_argument("--extra", nargs="*", default=[])
    s = sub.add_parser("inputs")
    s.add_argument("script")
    s = sub.add_parser("tar")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--list", default="")
    s = sub.add_parser("size")
    s.add_argument("outdir")
    s.add_argument("--max", type=int, default=MAX_BYTES)
    s = sub.add_parser("stored-wheels")
    s.add_argument("dir")
    a = ap.parse_args(argv)
    if a.cmd == "repo-files":
        print("\n".join(repo_files(pathlib.Path(a.root))))
    elif a.cmd == "untracked":
        print("\n".join(untracked(pathlib.Path(a.root))))
    elif a.cmd == "hash":
        print(input_hash(pathlib.Path(a.root), a.paths, a.extra))
    elif a.cmd == "inputs":
        print(" ".join(declared_inputs(pathlib.Path(a.script))))
    elif a.cmd == "tar":
        names = pathlib.Path(a.list).read_text().split("\n") if a.list else None
        size = make_tar(pathlib.Path(a.src), pathlib.Path(a.out), [n for n in names if n] if names else None)
        print(size)
    elif a.cmd == "stored-wheels":
        stored_wheels(pathlib.Path(a.dir))
    elif a.cmd == "size":
        ok, text = size_check(pathlib.Path(a.outdir), a.max)
        print(text)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
