"""A fresh Debian root, as a newcomer's machine: the tarball
scripts/test-packaging.sh makes with mmdebstrap (--variant=minbase: what
the debian:12 image has), unpacked into a directory and used with chroot
(no container starts on these machines: imagerun.py says why).

What the root gets besides the tarball:
- a copy of this checkout's tracked files at /root/kvcached-service, as
  `git clone` would leave them (the working tree's contents: what is being
  tested), owned by root;
- this machine's network settings: /etc/resolv.conf, and its CA bundle at
  /etc/kvc-host-ca.pem given to pip as PIP_CERT (PyPI is reached through a
  TLS-intercepting proxy here; a newcomer's machine has its own CAs). The
  pip settings of this machine (its local wheel directory) are not carried:
  pip in the root fetches from the index.

Each command runs in a private mount namespace (`unshare --mount`) with
/proc mounted and /dev bound in, then `chroot` into the root as root, with
an empty environment but PATH, HOME, LANG, TERM and PIP_CERT: a login
shell's, not this test's. `start` runs one in its own process group
(os.killpg reaches it and everything it started, as Ctrl-C would)."""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import signal
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKOUT = "/root/kvcached-service"
HOST_CA = pathlib.Path(os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


class FreshRoot:
    def __init__(self, tarball: pathlib.Path, where: pathlib.Path):
        self.path = where
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-C", str(where), "--numeric-owner", "-xpf", str(tarball)], check=True)
        shutil.copy("/etc/resolv.conf", where / "etc/resolv.conf")
        self.env = dict(ENV)
        if HOST_CA.is_file():
            shutil.copy(HOST_CA, where / "etc/kvc-host-ca.pem")
            self.env["PIP_CERT"] = "/etc/kvc-host-ca.pem"
        # the checkout, as a clone has it (tracked files, their modes)
        dest = where / CHECKOUT.lstrip("/")
        dest.mkdir(parents=True)
        files = tracked_files()
        pack = subprocess.run(["tar", "-C", str(ROOT), "--owner=0", "--group=0", "--null", "-T", "-", "-cf", "-"],
                              input="\0".join(files).encode(), capture_output=True, check=True).stdout
        subprocess.run(["tar", "-C", str(dest), "-xf", "-"], input=pack, check=True)

    def _argv(self, command: str, env: dict[str, str] | None, cwd: str) -> list[str]:
        r = shlex.quote(str(self.path))
        envargs = " ".join(shlex.quote(f"{k}={v}") for k, v in {**self.env, **(env or {})}.items())
        inner = shlex.quote(f"cd {shlex.quote(cwd)} && {command}")
        script = "\n".join([
            "set -e",
            f"mount -t proc proc {r}/proc",
            f"mount --rbind /dev {r}/dev",
            f"exec chroot {r} /usr/bin/env -i {envargs} /bin/bash -c {inner}",
        ])
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script]

    def run(self, command: str, *, timeout: float, env: dict[str, str] | None = None,
            cwd: str = CHECKOUT) -> subprocess.CompletedProcess:
        """`command` (bash) in the root; stdout and stderr together in .stdout."""
        return subprocess.run(self._argv(command, env, cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)

    def start(self, command: str, log: pathlib.Path, *, env: dict[str, str] | None = None,
              cwd: str = CHECKOUT) -> subprocess.Popen:
        with open(log, "w") as lf:
            return subprocess.Popen(self._argv(command, env, cwd), stdout=lf, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    @staticmethod
    def interrupt(p: subprocess.Popen, sig: int = signal.SIGINT) -> None:
        """What Ctrl-C in the terminal does: the signal to the whole process group."""
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    def file(self, path: str) -> pathlib.Path:
        return self.path / path.lstrip("/")

    def remove(self) -> None:
        # rm, not shutil.rmtree: a root with a .venv is ~30,000 files (rmtree took 70 s here under load)
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.path)], check=False)
