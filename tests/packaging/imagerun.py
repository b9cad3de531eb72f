"""Run an image built by podman from its filesystem, as a container runtime
would, where no container can start (podman/crun fail with setrlimit EPERM
on these machines).

What a `docker run -v SOCKDIR:/run/kvcached -e K=V IMAGE` does, done by hand:
- the image's filesystem: `podman create` + `podman mount` (the overlay a
  container would get; nothing is copied), mounted read-only as the
  DaemonSet's readOnlyRootFilesystem asks;
- its own mount and network namespaces (`unshare --mount --net`), loopback
  up, a fresh /proc, a minimal /dev (null, zero, full, random, urandom and a
  tmpfs /dev/shm), a tmpfs /tmp;
- the volume: SOCKDIR bind-mounted at /run/kvcached (the socket directory
  host clients use, as in the docs);
- optionally a libcuda.so.1 bind-mounted where the NVIDIA container runtime
  puts the host's driver (/usr/lib/x86_64-linux-gnu/libcuda.so.1);
- the image's User (uid:gid, supplementary group = gid), Env (plus -e
  overrides), WorkingDir, Entrypoint + Cmd, read from `podman image inspect`;
- `exec` all the way, so the daemon is the process the test holds (SIGTERM
  reaches it; its exit status is the test's).
`exec_in` runs a command inside it like `docker exec` / the HEALTHCHECK
(nsenter into its mount and network namespaces and its root, as the image's
user with the image's environment).
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import uuid

LIBCUDA_IN_IMAGE = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
DEV_NODES = ("null", "zero", "full", "random", "urandom")


class ImageRun:
    def __init__(self, podman: list[str], image: str):
        self.podman = podman
        self.image = image
        self.name = f"kvc-pkg-{uuid.uuid4().hex[:12]}"
        self.rootfs: str | None = None
        self.proc: subprocess.Popen | None = None
        info = self.inspect()
        self.config = info["Config"]
        # podman shows a docker-format image's HEALTHCHECK beside Config
        self.config.setdefault("Healthcheck", info.get("Healthcheck"))

    def _podman(self, *args: str, timeout: float = 120) -> str:
        r = subprocess.run([*self.podman, *args], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def inspect(self) -> dict:
        return json.loads(self._podman("image", "inspect", self.image))[0]

    def user(self) -> tuple[int, int]:
        u, _, g = (self.config.get("User") or "0:0").partition(":")
        return int(u), int(g or 0)

    def env(self, overrides: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(e.split("=", 1) for e in self.config.get("Env") or [])
        env.update(overrides or {})
        return env

    def start(self, sockdir: pathlib.Path, log: pathlib.Path, *, env: dict[str, str] | None = None,
              args: list[str] | None = None, entrypoint: list[str] | None = None,
              libcuda: pathlib.Path | None = None) -> subprocess.Popen:
        """The image's Entrypoint (or `entrypoint`) with its Cmd (or `args`),
        as its user."""
        self._podman("create", "--name", self.name, self.image)
        self.rootfs = self._podman("mount", self.name).strip()
        r = self.rootfs
        uid, gid = self.user()
        ep = entrypoint if entrypoint is not None else self.config.get("Entrypoint") or []
        argv = [*ep, *(args if args is not None else [] if entrypoint is not None else self.config.get("Cmd") or [])]
        envargs = [f"{k}={v}" for k, v in self.env(env).items()]
        q = shlex.quote
        script = ["set -e", "ip link set lo up",
                  # mount points the image lacks, made before the root turns read-only
                  f"mkdir -p {q(r)}/proc {q(r)}/dev {q(r)}/tmp {q(r)}/run/kvcached"]
        if libcuda is not None:
            script += [f"mkdir -p {q(r + os.path.dirname(LIBCUDA_IN_IMAGE))}", f"touch {q(r + LIBCUDA_IN_IMAGE)}"]
        script += [f"mount --bind {q(r)} {q(r)}", f"mount -o remount,bind,ro {q(r)}",
                   f"mount -t proc proc {q(r)}/proc",
                   f"mount -t tmpfs -o mode=0755,nosuid tmpfs {q(r)}/dev"]
        for n in DEV_NODES:
            script += [f"touch {q(r)}/dev/{n}", f"mount --bind /dev/{n} {q(r)}/dev/{n}"]
        script += [f"mkdir {q(r)}/dev/shm", f"mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {q(r)}/dev/shm",
                   f"ln -s /proc/self/fd {q(r)}/dev/fd",
                   f"mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {q(r)}/tmp",
                   f"mount --bind {q(str(sockdir))} {q(r)}/run/kvcached"]
        if libcuda is not None:
            script.append(f"mount --bind -o ro {q(str(libcuda))} {q(r + LIBCUDA_IN_IMAGE)}")
        workdir = self.config.get("WorkingDir") or "/"
        # chroot --userspec sets uid and gid and the supplementary groups to the gid
        script.append(" ".join(["exec chroot", f"--userspec={uid}:{gid}", f"--groups={gid}", q(r),
                                "/usr/bin/env", "-i", *map(q, envargs), "/bin/sh", "-c",
                                q(f"cd {q(workdir)} && exec \"$@\""), "sh", *map(q, argv)]))
        with open(log, "w") as lf:
            self.proc = subprocess.Popen(["unshare", "--mount", "--net", "--propagation", "private", "--", "/bin/sh", "-c",
                                          "\n".join(script)], stdout=lf, stderr=subprocess.STDOUT)
        return self.proc

    def exec_in(self, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """Like `docker exec`: in the running container's namespaces and root,
        as the image's user with the image's environment."""
        assert self.proc is not None and self.proc.poll() is None, "the container is not running"
        uid, gid = self.user()
        cmd = ["nsenter", f"--target={self.proc.pid}", "--mount", "--net", "--root", "--wd",
               f"--setuid={uid}", f"--setgid={gid}", "--", "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in self.env(env).items()), *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def in_netns(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """A host command in the container's network namespace (what a
        published port -p 127.0.0.1:9461:9461 would reach)."""
        assert self.proc is not None and self.proc.poll() is None
        return subprocess.run(["nsenter", f"--target={self.proc.pid}", "--net", "--", *argv],
                              capture_output=True, text=True, timeout=timeout)

    def healthcheck(self, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """The image's HEALTHCHECK command (docker format: Test = ["CMD", ...])."""
        test = self.config["Healthcheck"]["Test"]
        assert test[0] == "CMD", test
        return self.exec_in(test[1:], env=env)

    def remove(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.rootfs is not None:
            subprocess.run([*self.podman, "umount", self.name], capture_output=True, timeout=60)
            self.rootfs = None
        subprocess.run([*self.podman, "rm", "-f", self.name], capture_output=True, timeout=60)
