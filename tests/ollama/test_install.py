"""Ollama as users install it (issue 29 item 2): a release tarball laid out
as Ollama's own Linux tarball (integrations/ollama/dist.sh) and an installer
(integrations/ollama/install.sh) that does what Ollama's install script does
plus this project's units, tried in a scratch root (--root: users in its
/etc/passwd, no systemd), over a stock install it keeps aside, then run with
the daemon, and removed again with nothing left behind."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import tarfile

import pytest

from ollamatest import LAYOUTS
from test_ollama import PAGE, observer, sessions_of

REPO = pathlib.Path(__file__).resolve().parents[2]
DIST = REPO / "integrations" / "ollama" / "dist.sh"
INSTALL = REPO / "integrations" / "ollama" / "install.sh"
# what shadow-utils itself leaves in /etc when it edits the user files (a
# real /etc has them already): not ours
TOOL_ARTEFACTS = {"etc/.pwd.lock", "etc/passwd-", "etc/group-", "etc/shadow-", "etc/gshadow-"}


def tree(root: pathlib.Path) -> dict[str, str]:
    """Every path under root: a file's sha256, "dir" or "link -> target"."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = pathlib.Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel in TOOL_ARTEFACTS:
                continue
            if p.is_symlink():
                out[rel] = "link -> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def scratch_root(tmp: pathlib.Path) -> pathlib.Path:
    """A root with the user files useradd --root needs and a stock Ollama
    installed the way Ollama's script installs it."""
    r = tmp / "root"
    (r / "etc/systemd/system").mkdir(parents=True)
    (r / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (r / "etc/group").write_text("root:x:0:\nvideo:x:44:\n")
    (r / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    (r / "etc/gshadow").write_text("root:*::\nvideo:*::\n")
    (r / "usr/local/bin").mkdir(parents=True)
    (r / "usr/local/lib/ollama").mkdir(parents=True)
    (r / "usr/local/bin/ollama").write_text("#!/bin/sh\necho stock ollama\n")
    (r / "usr/local/lib/ollama/libggml-base.so").write_text("stock library\n")
    (r / "etc/systemd/system/ollama.service").write_text("[Service]\nExecStart=/usr/local/bin/ollama serve\n")
    return r


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tarball of the suite's patched build (build/ollama/kvc)."""
    out = tmp_path_factory.mktemp("release")
    r = subprocess.run([str(DIST), "--from", str(LAYOUTS["kvc"]), "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (tgz,) = out.glob("ollama-kvcached-*-linux-amd64.tgz")
    return tgz


def test_the_tarball_is_laid_out_as_ollamas_with_a_checksum(release, tmp_path):
    """./bin/ollama and ./lib/ollama/ with llama-server, llama-quantize and
    the ggml CPU backend as files (the build's symlinks packed as what they
    point to), owner root; the .sha256 file checks; packing again gives the
    same bytes; a layout that is not a build is refused naming what is
    missing."""
    assert release.name.startswith("ollama-kvcached-0.34.4+kvcached-linux-amd64")
    with tarfile.open(release) as t:
        members = {m.name: m for m in t.getmembers()}
    for need in ("./bin/ollama", "./lib/ollama/llama-server", "./lib/ollama/llama-quantize", "./lib/ollama/libggml-cpu.so"):
        assert need in members and (members[need].isfile() or members[need].islnk()), need
    assert not any(m.issym() for m in members.values()), "symlinks into the build tree were packed"
    assert all(m.uid == 0 and m.gid == 0 for m in members.values())
    assert all(name.startswith(("./bin/", "./lib/ollama")) for name in members), sorted(members)
    ok = subprocess.run(["sha256sum", "-c", release.name + ".sha256"], cwd=release.parent, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    again = tmp_path / "again"
    subprocess.run([str(DIST), "--from", str(LAYOUTS["kvc"]), "--out", str(again)], check=True, capture_output=True)
    assert (again / release.name).read_bytes() == release.read_bytes(), "the tarball is not reproducible"
    bad = subprocess.run([str(DIST), "--from", str(tmp_path), "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode != 0 and "bin/ollama is missing" in bad.stderr, bad.stderr


def test_install_run_uninstall_in_a_scratch_root(release, tmp_path, daemon_factory, ollamas, digests):
    """install.sh --root over a stock install: the stock files are kept
    aside, bin/ollama and lib/ollama are the release's, the ollama and
    kvcached users exist, ollama.service, kvcached.service (ExecStart at the
    prefix) and the drop-in are written. That `ollama serve` with the daemon
    answers as stock Ollama does, `ollama run` and `ollama ps` work, and its
    runner holds daemon pages in a session named by the model. --uninstall
    then leaves the root exactly as it was, stock Ollama back. A damaged
    tarball is refused before anything changes."""
    root = scratch_root(tmp_path)
    before = tree(root)
    damaged = tmp_path / release.name
    damaged.write_bytes(release.read_bytes()[:-100] + b"\0" * 100)
    (tmp_path / (release.name + ".sha256")).write_text((release.parent / (release.name + ".sha256")).read_text())
    r = subprocess.run([str(INSTALL), "--root", str(root), str(damaged)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "does not match" in r.stderr, r.stdout + r.stderr
    assert tree(root) == before

    r = subprocess.run([str(INSTALL), "--root", str(root), str(release)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kept the existing /usr/local/bin/ollama for --uninstall" in r.stdout
    prefix = root / "usr/local"
    assert (prefix / "bin/ollama").read_bytes() == (LAYOUTS["kvc"] / "bin/ollama").read_bytes()
    assert (prefix / "lib/ollama/llama-server").is_file()
    passwd = (root / "etc/passwd").read_text()
    assert "\nollama:" in passwd and "\nkvcached:" in passwd, passwd
    assert "video:x:44:ollama" in (root / "etc/group").read_text()
    units = root / "etc/systemd/system"
    assert "ExecStart=/usr/local/bin/ollama serve" in (units / "ollama.service").read_text()
    assert "ExecStart=/usr/local/bin/kvcached-serve" in (units / "kvcached.service").read_text()
    assert (units / "ollama.service.d/kvcached.conf").read_text() == \
        (REPO / "deploy/systemd/ollama.service.d/kvcached.conf").read_text()
    again = subprocess.run([str(INSTALL), "--root", str(root), str(release)], capture_output=True, text=True)
    assert again.returncode != 0 and "already installed" in again.stderr

    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    stock = ollamas("stock")
    want = stock.generate("tiny0", "Hello", 16)["response"]
    stock.stop()
    o = ollamas(str(prefix), name="installed", OLLAMA_KVCACHED_SOCKET=d.socket)
    assert o.generate("tiny0", "Hello", 16)["response"] == want
    run = subprocess.run([str(o.exe), "run", "tiny1", "Hi"], env=o.env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip(), run.stdout + run.stderr
    ps = subprocess.run([str(o.exe), "ps"], env=o.env, capture_output=True, text=True, timeout=60)
    assert ps.returncode == 0 and "tiny0" in ps.stdout and "tiny1" in ps.stdout, ps.stdout + ps.stderr
    with observer(d) as obs:
        pid = o.runner_of(digests["tiny0"])
        (s,) = sessions_of(obs, pid)
        assert s.name == digests["tiny0"] and s.held_bytes > 0, s
    o.stop()

    r = subprocess.run([str(INSTALL), "--root", str(root), "--uninstall"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    after = tree(root)
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
