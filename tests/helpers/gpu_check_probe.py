"""The driver half of scripts/gpu-check.sh: every assumption the project's
code makes about the CUDA driver, checked directly against the library in
$KVCACHED_LIBCUDA (default libcuda.so.1) through the project's own bindings
(kvcached_service.cuda.driver), one row each.

    python tests/helpers/gpu_check_probe.py [--pages N] > rows.jsonl

Every row is one JSON line {"check", "expected", "seen", "verdict", "kind"}:
  kind "code":  an assumption the daemon or a client relies on; verdict
                "pass" or "FAIL" (the code is wrong on this driver);
  kind "model": what the CUDA test driver (tests/cudadriver) assumes about
                a real driver; verdict "pass" or "DIFF" (the test driver's
                model must change; the project is not known to be wrong);
  kind "info":  a number or fact recorded for the docs (verdict "info"),
  and "skip" when a check cannot run here (one device, say).
A row may carry "figures": {name: {"value": number, "unit": str}}, the
numbers it measured (scripts/gpu-check.sh gathers them into figures.json).
The process exits 0 unless the probe itself crashed. Nothing here needs the
test driver's private features; on the test driver it runs the same way.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from ctypes import byref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from kvcached_service.cuda import driver as cu  # noqa: E402

MiB = 1 << 20
A100 = {"cuMemCreate": 193.0, "cuMemMap": 1.5, "cuMemSetAccess": 36.0, "cuMemUnmap": 26.0}  # kvcached bench_vmm, us per 2 MiB


def row(check: str, expected: str, seen: str, verdict: str, kind: str, figures: dict | None = None) -> None:
    r = {"check": check, "expected": expected, "seen": seen, "verdict": verdict, "kind": kind}
    if figures:
        r["figures"] = {k: {"value": v, "unit": u} for k, (v, u) in figures.items()}
    print(json.dumps(r), flush=True)


def code_row(check, expected, seen, ok, figures=None):
    row(check, expected, seen, "pass" if ok else "FAIL", "code", figures)


def model_row(check, expected, seen, ok, figures=None):
    row(check, expected, seen, "pass" if ok else "DIFF", "model", figures)


# What the CUDA test driver models by default for an exported fd
# (tests/cudadriver/README.md, KVCACHED_TESTDRV_FD_IDENTITY=chardev). The
# export-semantics rows compare the driver under test with it: a DIFF there
# says the test driver's default should follow this driver. Public sources
# predicted, and an H200 showed (2026-11-26), that a real driver's export is
# an fd of its device node (/dev/nvidiactl): a character device, one inode
# for every export, no read or mmap (docs/gpu-check.md, "Export semantics").
# The daemon resumes from its page store there (docs/cuda.md, "Page identity").
EXPORT_MODEL = {"type": "character device", "inode": "the same for every export", "read": "fails", "mmap": "fails"}


class Probe:
    def __init__(self, pages: int):
        self.d = cu.load()
        self.pages = pages
        self.d.cuInit(0)
        n = ctypes.c_int()
        self.d.cuDeviceGetCount(byref(n))
        self.ndev = n.value
        self.ctx = cu.CUcontext()
        self.d.cuDevicePrimaryCtxRetain(byref(self.ctx), 0)
        self.d.cuCtxSetCurrent(self.ctx)
        g = ctypes.c_size_t()
        self.d.cuMemGetAllocationGranularity(byref(g), byref(cu.allocation_prop(0)), cu.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.gran = g.value
        self.page = max(2 * MiB, self.gran)  # the daemon's default page size
        self.page = -(-self.page // self.gran) * self.gran

    def close(self) -> None:
        self.d.cuCtxSetCurrent(None)
        self.d.cuDevicePrimaryCtxRelease_v2(0)

    # -- small wrappers --------------------------------------------------------------
    def code(self, fn, *args) -> str:
        try:
            fn(*args)
            return "CUDA_SUCCESS"
        except cu.CudaDriverError as exc:
            return exc.name

    def create(self, size=None, ordinal=0) -> int:
        h = cu.CUmemGenericAllocationHandle()
        self.d.cuMemCreate(byref(h), size or self.page, byref(cu.allocation_prop(ordinal)), 0)
        return h.value

    def export(self, h) -> int:
        fd = ctypes.c_int(-1)
        self.d.cuMemExportToShareableHandle(byref(fd), h, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        return fd.value

    def import_fd(self, fd) -> int:
        h = cu.CUmemGenericAllocationHandle()
        self.d.cuMemImportFromShareableHandle(byref(h), ctypes.c_void_p(fd), cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return h.value

    def reserve(self, size) -> int:
        p = cu.CUdeviceptr()
        self.d.cuMemAddressReserve(byref(p), size, self.gran, 0, 0)
        return p.value

    def access(self, addr, size, ordinal=0, flags=cu.CU_MEM_ACCESS_FLAGS_PROT_READWRITE):
        self.d.cuMemSetAccess(addr, size, byref(cu.access_desc(ordinal, flags)), 1)

    def write(self, addr, data: bytes):
        b = ctypes.create_string_buffer(data, len(data))
        self.d.cuMemcpyHtoD_v2(addr, b, len(data))

    def read(self, addr, n) -> bytes:
        b = ctypes.create_string_buffer(n)
        self.d.cuMemcpyDtoH_v2(b, addr, n)
        return b.raw

    def free_mem(self) -> tuple[int, int]:
        f, t = ctypes.c_size_t(), ctypes.c_size_t()
        self.d.cuMemGetInfo_v2(byref(f), byref(t))
        return f.value, t.value

    def child(self, body: str, pass_fds=(), timeout=120) -> dict:
        """A fresh process (not a fork) on the same driver; its last JSON line."""
        src = "import sys; sys.path.insert(0, %r)\nfrom gpu_check_probe import *\n" % os.path.dirname(os.path.abspath(__file__)) + textwrap.dedent(body)
        p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=timeout, pass_fds=pass_fds,
                           env=dict(os.environ))
        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"probe child exited {p.returncode}: {p.stderr.strip()[-400:]}")
        return json.loads(lines[-1])

    # -- checks -----------------------------------------------------------------------
    def devices(self):
        descr = []
        ok = True
        for o in range(self.ndev):
            dev = cu.CUdevice()
            self.d.cuDeviceGet(byref(dev), o)
            name = ctypes.create_string_buffer(256)
            self.d.cuDeviceGetName(name, 256, dev)
            v = ctypes.c_int()
            self.d.cuDeviceGetAttribute(byref(v), cu.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)
            vmm = v.value
            self.d.cuDeviceGetAttribute(byref(v), cu.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev)
            ok &= bool(vmm and v.value)
            descr.append(f"{o}: {name.value.decode(errors='replace')} (VMM {vmm}, POSIX fd {v.value})")
        ver = ctypes.c_int()
        self.d.cuDriverGetVersion(byref(ver))
        code_row("devices with the VMM API and POSIX-fd export", ">= 1 device, attributes 102 and 103 = 1",
                 f"driver {ver.value}; " + "; ".join(descr), ok and self.ndev > 0,
                 {"driver_version": (ver.value, "cuDriverGetVersion"), "devices": (self.ndev, "count")})

    def granularity(self):
        rec = ctypes.c_size_t()
        self.d.cuMemGetAllocationGranularity(byref(rec), byref(cu.allocation_prop(0)), cu.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        code_row("allocation granularity divides the 2 MiB default page", "2 MiB % minimum == 0, minimum % host page == 0",
                 f"minimum {self.gran} B, recommended {rec.value} B",
                 (2 * MiB) % self.gran == 0 and self.gran % os.sysconf("SC_PAGE_SIZE") == 0,
                 {"granularity_minimum": (self.gran, "B"), "granularity_recommended": (rec.value, "B")})

    def identity(self):
        """What an exported fd is (one row per property): its file type, its
        inode across exports, read and mmap of it."""
        import mmap

        hs = [self.create(), self.create()]
        fds = [self.export(hs[0]), self.export(hs[1]), self.export(hs[0])]
        try:
            sts = [os.fstat(fd) for fd in fds]
            ids = [(s.st_dev, s.st_ino) for s in sts]
            kind = {stat.S_IFREG: "regular file", stat.S_IFDIR: "directory", stat.S_IFCHR: "character device",
                    stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket", stat.S_IFIFO: "pipe",
                    stat.S_IFLNK: "symlink"}.get(stat.S_IFMT(sts[0].st_mode), "other")
            kinds = {stat.S_IFMT(st.st_mode) for st in sts}
            try:
                target = os.readlink(f"/proc/self/fd/{fds[0]}")
            except OSError:
                target = "?"
            if ids[0] == ids[1]:
                ident = "the same for every export"
            elif ids[0] == ids[2]:
                ident = "distinct per page"
            else:
                ident = "distinct per export"
            model_row("exported fd: file type (fstat S_IFMT)", f"{EXPORT_MODEL['type']} (the test driver's default)",
                      f"{kind}{'' if len(kinds) == 1 else ' (not the same for every export)'} ({target})",
                      kind == EXPORT_MODEL["type"])
            model_row("exported fd: inode (st_dev, st_ino) across exports",
                      f"{EXPORT_MODEL['inode']} (the test driver's default; then the daemon resumes pages only from "
                      "its page store, docs/cuda.md, \"Page identity\")",
                      ident, ident == EXPORT_MODEL["inode"])
            for name, fn in (("read", lambda: os.pread(fds[0], 16, 0)),
                             ("mmap", lambda: mmap.mmap(fds[0], self.page, mmap.MAP_SHARED, mmap.PROT_READ).close())):
                try:
                    fn()
                    got = "works"
                except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
                    got = f"fails: {os.strerror(exc.errno) if getattr(exc, 'errno', None) else exc}"
                model_row(f"exported fd: {name} of it", f"{EXPORT_MODEL[name]} (no page bytes through an export)", got,
                          got.startswith(EXPORT_MODEL[name]))
        finally:
            for fd in fds:
                os.close(fd)
            for h in hs:
                self.d.cuMemRelease(h)

    def import_twice(self):
        h = self.create()
        fd = self.export(h)
        try:
            hs, errs = [], []
            for _ in range(2):
                try:
                    hs.append(self.import_fd(fd))
                except cu.CudaDriverError as exc:
                    errs.append(exc.name)
            rel = [self.code(self.d.cuMemRelease, x) for x in hs]
            h1, h2 = (hs + [None, None])[:2]
            seen = (f"imports: {len(hs)} ok{' ' + ', '.join(errs) if errs else ''}; "
                    f"handles {'equal' if h1 == h2 else 'different'}; releases: {', '.join(rel)}")
            code_row("importing one fd twice (each import released once)", "both imports succeed, both releases succeed",
                     seen, h2 is not None and rel == ["CUDA_SUCCESS"] * 2)
        finally:
            os.close(fd)
            self.d.cuMemRelease(h)

    def adjacent(self):
        n = 2 * self.page
        hs = [self.create(), self.create()]
        base = self.reserve(n)
        try:
            for i, h in enumerate(hs):
                self.d.cuMemMap(base + i * self.page, self.page, 0, h, 0)
            self.access(base, n)  # one call over two mappings, as the daemon's zeroing does
            self.d.cuMemsetD8_v2(base, 0x5A, n)
            self.d.cuCtxSynchronize()
            mid = base + self.page - 8
            self.write(mid, b"ACROSS-THE-BORDER")
            got = self.read(mid - 4, 25)
            ok = got == b"\x5a" * 4 + b"ACROSS-THE-BORDER" + b"\x5a" * 4 and self.read(base + n - 4, 4) == b"\x5a" * 4
            code_row("memset and copy across adjacent mappings (one cuMemSetAccess over both)",
                     "bytes land on both pages", "as expected" if ok else f"read {got!r}", ok)
        finally:
            for i in range(2):
                self.code(self.d.cuMemUnmap, base + i * self.page, self.page)
            self.d.cuMemAddressFree(base, n)
            for h in hs:
                self.d.cuMemRelease(h)

    def access_rules(self):
        h = self.create()
        base = self.reserve(self.page)
        try:
            self.d.cuMemMap(base, self.page, 0, h, 0)
            before = self.code(self.read, base, 4)
            self.access(base, self.page)
            self.write(base, b"kept")
            self.d.cuCtxSynchronize()
            self.d.cuMemUnmap(base, self.page)
            self.d.cuMemMap(base, self.page, 0, h, 0)
            after_remap = self.code(self.read, base, 4)
            sub = self.code(self.access, base, self.gran) if self.page > self.gran else "n/a (page = granularity)"
            self.access(base, self.page)
            kept = self.read(base, 4) == b"kept"
            model_row("access starts at none after every cuMemMap", "a copy before cuMemSetAccess fails, also after a remap",
                      f"before: {before}; after remap: {after_remap}", before != "CUDA_SUCCESS" and after_remap != "CUDA_SUCCESS")
            code_row("a page's bytes survive unmap and map again", "the bytes written before", "kept" if kept else "lost", kept)
            row("cuMemSetAccess on part of one mapping", "not used by the project", sub, "info", "info")
        finally:
            self.code(self.d.cuMemUnmap, base, self.page)
            self.d.cuMemAddressFree(base, self.page)
            self.d.cuMemRelease(h)

    def peers(self):
        if self.ndev < 2:
            row("access for another device (peers)", "only between peer-capable devices", "one device: not checked", "skip", "model")
            return
        can = "n/a"
        fn = getattr(self.d._lib, "cuDeviceCanAccessPeer", None)
        if fn is not None:
            v = ctypes.c_int(-1)
            fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
            r = fn(byref(v), 1, 0)
            can = str(v.value) if r == 0 else f"error {r}"
        h = self.create()
        base = self.reserve(self.page)
        try:
            self.d.cuMemMap(base, self.page, 0, h, 0)
            got = self.code(self.access, base, self.page, 1)
            seen = f"cuMemSetAccess: {got}; cuDeviceCanAccessPeer: {can}"
            expected = "granted only if cuDeviceCanAccessPeer(1, 0) = 1 (test driver: PEERS)"
            if can in ("0", "1"):
                model_row("access for device 1 to device 0's memory", expected, seen, (got == "CUDA_SUCCESS") == (can == "1"))
            else:  # a driver without cuDeviceCanAccessPeer (the test driver): nothing to compare with
                row("access for device 1 to device 0's memory", expected, seen, "info", "info")
        finally:
            self.code(self.d.cuMemUnmap, base, self.page)
            self.d.cuMemAddressFree(base, self.page)
            self.d.cuMemRelease(h)

    def fork(self):
        h = self.create()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                res = [self.code(self.d.cuInit, 0), self.code(self.d.cuDeviceGetCount, byref(ctypes.c_int())),
                       self.code(self.create)]
            except BaseException as exc:  # noqa: BLE001
                res = [repr(exc)]
            os.write(w, json.dumps(res).encode())
            os._exit(0)
        os.close(w)
        res = json.loads(os.read(r, 4096) or b"[]")
        os.close(r)
        os.waitpid(pid, 0)
        self.d.cuMemRelease(h)
        model_row("driver calls in a fork()ed child", "refused: CUDA_ERROR_NOT_INITIALIZED (cuInit, cuDeviceGetCount, cuMemCreate)",
                  ", ".join(res), res == ["CUDA_ERROR_NOT_INITIALIZED"] * 3)

    def fresh_and_stream(self):
        h = self.create()
        base = self.reserve(self.page)
        try:
            self.d.cuMemMap(base, self.page, 0, h, 0)
            self.access(base, self.page)
            fresh = self.read(base, self.page)
            row("fresh cuMemCreate memory", "anything (the daemon zeroes)",
                "all zero" if fresh.count(0) == len(fresh) else f"{len(fresh) - fresh.count(0)} of {len(fresh)} bytes not zero", "info", "info")
            self.d.cuMemsetD8_v2(base, 0x33, self.page)
            got = self.read(base + self.page // 2, 4)  # no synchronize: stream order
            code_row("a copy after a memset (no synchronize) sees it", "stream order: 33333333", got.hex(), got == b"\x33" * 4)
            self.d.cuCtxSynchronize()
        finally:
            self.code(self.d.cuMemUnmap, base, self.page)
            self.d.cuMemAddressFree(base, self.page)
            self.d.cuMemRelease(h)

    def export_outlives(self):
        h = self.create()
        base = self.reserve(self.page)
        self.d.cuMemMap(base, self.page, 0, h, 0)
        self.access(base, self.page)
        self.write(base, b"only the fd holds me")
        self.d.cuCtxSynchronize()
        fd = self.export(h)
        self.d.cuMemUnmap(base, self.page)
        self.d.cuMemRelease(h)
        try:
            h2 = self.import_fd(fd)
            self.d.cuMemMap(base, self.page, 0, h2, 0)
            self.d.cuMemRelease(h2)
            self.access(base, self.page)
            got = self.read(base, 20)
            self.d.cuMemUnmap(base, self.page)
            code_row("an exported fd alone keeps the page (handle released, unmapped)", "import works, bytes intact",
                     "intact" if got == b"only the fd holds me" else repr(got), got == b"only the fd holds me")
        finally:
            os.close(fd)
            self.d.cuMemAddressFree(base, self.page)
        # the exporter dies; its fd (held by another process) still names the page: resume re-sends such fds
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            out = self.child(f"""
                p = Probe(1)
                h = p.create(); base = p.reserve(p.page); p.d.cuMemMap(base, p.page, 0, h, 0); p.access(base, p.page)
                p.write(base, b"from a dead exporter"); p.d.cuCtxSynchronize()
                fd = p.export(h)
                socket.send_fds(socket.socket(fileno={a.fileno()}), [b"fd"], [fd])
                print(json.dumps({{"sent": True}}), flush=True)
                os._exit(0)   # no cleanup at all
            """, pass_fds=(a.fileno(),))
            _, fds, _, _ = socket.recv_fds(b, 16, 1)
            h2 = self.import_fd(fds[0])
            os.close(fds[0])
            base = self.reserve(self.page)
            self.d.cuMemMap(base, self.page, 0, h2, 0)
            self.d.cuMemRelease(h2)
            self.access(base, self.page)
            got = self.read(base, 20)
            self.d.cuMemUnmap(base, self.page)
            self.d.cuMemAddressFree(base, self.page)
            code_row("an exported fd still imports after its exporter exited", "import works, bytes intact",
                     "intact" if out.get("sent") and got == b"from a dead exporter" else repr(got), got == b"from a dead exporter")
        finally:
            a.close()
            b.close()

    def memory(self):
        n = self.pages
        free0, total = self.free_mem()
        row("device memory in use before the probe's pages", "anything (contexts, other processes)",
            f"{(total - free0) / MiB:.0f} MiB of {total / MiB:.0f} MiB", "info", "info",
            {"device_used_before": ((total - free0) / MiB, "MiB"), "device_total": (total / MiB, "MiB")})
        hs = []
        t = {k: [] for k in ("cuMemCreate", "cuMemExportToShareableHandle", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease")}
        base = self.reserve(n * self.page)
        fds = []
        try:
            for i in range(n):
                t0 = time.perf_counter()
                h = self.create()
                t["cuMemCreate"].append(time.perf_counter() - t0)
                hs.append(h)
                t0 = time.perf_counter()
                fds.append(self.export(h))
                t["cuMemExportToShareableHandle"].append(time.perf_counter() - t0)
            free1, _ = self.free_mem()
            for i, h in enumerate(hs):
                a = base + i * self.page
                t0 = time.perf_counter()
                self.d.cuMemMap(a, self.page, 0, h, 0)
                t["cuMemMap"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                self.access(a, self.page)
                t["cuMemSetAccess"].append(time.perf_counter() - t0)
            for i in range(n):
                t0 = time.perf_counter()
                self.d.cuMemUnmap(base + i * self.page, self.page)
                t["cuMemUnmap"].append(time.perf_counter() - t0)
            # another process sees our pages in its cuMemGetInfo (device-wide numbers)
            other = self.child("p = Probe(1); print(json.dumps({'free': p.free_mem()[0]})); p.close()")
        finally:
            for fd in fds:
                os.close(fd)
            for h in hs:
                t0 = time.perf_counter()
                self.d.cuMemRelease(h)
                t["cuMemRelease"].append(time.perf_counter() - t0)
            self.d.cuMemAddressFree(base, n * self.page)
        free2, _ = self.free_mem()
        want = n * self.page
        code_row(f"free memory after {n} pages of {self.page // MiB} MiB", f"drops by at least {want // MiB} MiB",
                 f"dropped {(free0 - free1) / MiB:.1f} MiB", free0 - free1 >= want,
                 {"free_drop_after_pages": ((free0 - free1) / MiB, "MiB"), "pages_created": (n, "count"),
                  "page_size": (self.page, "B")})
        code_row("cuMemGetInfo is device-wide (another process sees our pages)", f"its free <= ours + 1 page",
                 f"other process: {other['free'] / MiB:.1f} MiB free, ours {free1 / MiB:.1f} MiB (it has its own context too)",
                 other["free"] <= free1 + self.page,
                 {"free_seen_by_other_process": (other["free"] / MiB, "MiB"), "free_seen_by_probe": (free1 / MiB, "MiB")})
        code_row("free memory back after release", "within 1 page of the start", f"{(free0 - free2) / MiB:.1f} MiB short",
                 free0 - free2 <= self.page, {"free_short_after_release": ((free0 - free2) / MiB, "MiB")})
        per = {k: sorted(v)[len(v) // 2] * 1e6 / (self.page / (2 * MiB)) for k, v in t.items() if v}
        seen = ", ".join(f"{k.replace('cuMem', '').replace('ToShareableHandle', '')} {v:.1f}" for k, v in per.items())
        code_row("cost per 2 MiB page, p50 (us)", "each under 10 ms (A100: create 193, map 1.5, set-access 36, unmap 26)", seen,
                 all(v < 10000 for v in per.values()),
                 {f"{k}_{q}": (sorted(v)[min(len(v) - 1, int(len(v) * f))] * 1e6 / (self.page / (2 * MiB)), "us per 2 MiB page")
                  for k, v in t.items() if v for q, f in (("p50", 0.5), ("p99", 0.99))})
        # a context's own device memory: another process's context, seen from here while it lives
        src = "import sys; sys.path.insert(0, %r)\nfrom gpu_check_probe import *\n" % os.path.dirname(os.path.abspath(__file__))
        src += "p = Probe(1)\nprint('ready', flush=True)\nsys.stdin.readline()\np.close()\n"
        c = subprocess.Popen([sys.executable, "-c", src], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ))
        try:
            ready = c.stdout.readline().strip() == "ready"
            free3, _ = self.free_mem()
        finally:
            c.communicate("\n", timeout=60)
        if ready:
            row("a context's own device memory", "anything (KVCACHED_TESTDRV_CONTEXT_BYTES models it)",
                f"{(free2 - free3) / MiB:.0f} MiB for another process's primary context", "info", "info",
                {"context_memory": ((free2 - free3) / MiB, "MiB")})

    def run(self):
        steps = [self.devices, self.granularity, self.identity, self.import_twice, self.adjacent, self.access_rules,
                 self.peers, self.fork, self.fresh_and_stream, self.export_outlives, self.memory]
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the check is a failure with its reason
                row(f"probe step {step.__name__}", "runs", f"{type(exc).__name__}: {exc}", "FAIL", "code")


def main() -> int:
    pages = 32
    if "--pages" in sys.argv:
        pages = int(sys.argv[sys.argv.index("--pages") + 1])
    try:
        p = Probe(pages)
    except Exception as exc:  # noqa: BLE001
        row("the driver loads and initialises", "cuInit and a context on device 0", f"{type(exc).__name__}: {exc}", "FAIL", "code")
        return 0
    p.run()
    p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
