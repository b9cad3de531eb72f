"""Torch views of mapped memory (kvcached_service/client/torch_views.py).

Host pages: real CPU tensors over the mapped bytes; writes through the tensor
are read back through Region.read and by a second client process.

CUDA pages: torch.cuda is not available on machines without a GPU, so the
CUDA tensor itself cannot be made here. What is tested on the CUDA test
driver is the `__cuda_array_interface__` handed to torch (pointer, shape,
typestr, strides, version) against the region's real mapping; the step
`torch.as_tensor(view, device="cuda:N")` is verified only on a GPU host.

torch is an optional extra. These tests need it and FAIL (not skip) when it
is missing: install it with `pip install -e .[torch]`.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest

from kvtest import PY, assert_books
from kvcached_service import errors
from kvcached_service.client import torch_views as tv

MiB = 1 << 20
PAGE = 2 * MiB


def need_torch():
    """torch, or a test FAILURE (not an error, not a skip) saying how to get it."""
    try:
        import torch
    except ImportError:
        pytest.fail("torch is not installed, so the torch views cannot be tested: pip install -e .[torch]")
    return torch


def test_host_region_view_shares_memory_both_ways(host_daemon):
    torch = need_torch()
    with host_daemon.client() as c, c.open_session("tv") as s, s.region(16 * MiB) as r:
        r.map(0, 8 * MiB)
        t = tv.as_tensor(r, (2, PAGE // 4), torch.float32, offset=2 * PAGE)  # pages 2 and 3
        assert t.shape == (2, PAGE // 4) and t.dtype == torch.float32 and t.device.type == "cpu"
        assert t.data_ptr() == r.base + 2 * PAGE, "the view must be the mapped memory, not a copy"
        assert torch.count_nonzero(t) == 0
        t[1, 7] = 42.5
        t[0].fill_(1.25)
        assert r.read(2 * PAGE + PAGE + 7 * 4, 4) == struct.pack("<f", 42.5)
        assert r.read(2 * PAGE, 8) == struct.pack("<ff", 1.25, 1.25)
        r.write(3 * PAGE - 4, struct.pack("<f", -3.0))  # and the other way
        assert t[0, -1].item() == -3.0
        h = tv.region_tensor(r, (4, 4), "bfloat16")  # host views take any torch dtype
        h[0, 0] = 2.0
        assert r.read(0, 2) == torch.tensor([2.0], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()


def test_host_page_view(host_daemon):
    torch = need_torch()
    with host_daemon.client() as c, c.open_session("tvp") as s:
        pages = s.allocate(2)
        t = tv.page_tensor(pages[1], (PAGE // 8,), "int64")
        t[:] = torch.arange(PAGE // 8)
        assert pages[1].read(8 * 1000, 8) == struct.pack("<q", 1000)
        assert pages[0].read(0, 8) == bytes(8)
        u = tv.as_tensor(pages[0], (16,), torch.uint8, offset=PAGE - 16)
        u.fill_(7)
        assert pages[0].read(PAGE - 16, 16) == bytes([7]) * 16
        del t, u
        s.free(pages)
        assert_books(s.stats())


READER = textwrap.dedent(
    """
    import json, struct, sys
    from kvcached_service.client import Client
    n = int(sys.argv[1])
    with Client.from_env() as c, c.open_session("reader") as s, s.region(n * %d) as r:
        r.map(0, r.size)
        out = [struct.unpack("<qq", r.read(i * %d, 8) + r.read((i + 1) * %d - 8, 8)) for i in range(n)]
    print(json.dumps(out))
    """ % (PAGE, PAGE, PAGE)
)


def test_host_tensor_writes_are_read_by_another_client_process(daemon_factory, tmp_path):
    torch = need_torch()
    """zero_pages off (single-user mode): pages a session frees go to the next
    session of the same uid as they are, so a second client process reads
    what this one wrote through the tensor."""
    d = daemon_factory("host", zero_pages=False)
    n = 4
    with d.client() as c, c.open_session("writer") as s:
        r = s.region(n * PAGE)
        r.map(0, r.size)
        t = tv.as_tensor(r, (n, PAGE // 8), torch.int64)
        for i in range(n):
            t[i].fill_(0x1111 * (i + 1))
            t[i, 0] = 1000 + i
        del t
        r.close()  # unmaps and frees every page
        script = tmp_path / "reader.py"
        script.write_text(READER)
        proc = subprocess.run([PY, str(script), str(n)], env=d.client_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        got = sorted(tuple(x) for x in json.loads(proc.stdout.splitlines()[-1]))
        assert got == [(1000 + i, 0x1111 * (i + 1)) for i in range(n)], got
        assert_books(c.stats())


def test_view_errors(host_daemon):
    torch = need_torch()
    with host_daemon.client() as c, c.open_session("tve") as s, s.region(8 * MiB) as r:
        r.map(0, PAGE)
        with pytest.raises(errors.FailedPrecondition, match="not mapped"):
            tv.as_tensor(r, (PAGE // 4 + 1,), torch.float32)  # runs into the unmapped second page
        with pytest.raises(errors.InvalidArgument, match="outside the region"):
            tv.as_tensor(r, (8 * MiB,), torch.uint8, offset=4)
        with pytest.raises(errors.InvalidArgument, match="multiple of float32's size 4"):
            tv.as_tensor(r, (4,), torch.float32, offset=2)
        with pytest.raises(errors.InvalidArgument, match="negative"):
            tv.as_tensor(r, (4, -1), torch.float32)
        with pytest.raises(errors.InvalidArgument, match="not supported"):
            tv.as_tensor(r, (4,), torch.complex64)
        with pytest.raises(errors.InvalidArgument, match="Region or a Page"):
            tv.as_tensor(b"bytes", (4,), torch.uint8)
        pages = s.allocate(1)
        with pytest.raises(errors.InvalidArgument, match="outside page"):
            tv.page_tensor(pages[0], (PAGE + 1,), torch.uint8)
        with pytest.raises(errors.FailedPrecondition, match="CUDA pages"):
            tv.cuda_array_interface(r, (4,), "float16")
        s.free(pages)
        with pytest.raises(errors.FailedPrecondition, match="not mapped any more"):
            tv.page_tensor(pages[0], (4,), torch.uint8)
        assert tv.as_tensor(r, (0, 3), torch.float16).shape == (0, 3)


def test_missing_torch_says_how_to_install(host_daemon, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with host_daemon.client() as c, c.open_session("nt") as s, s.region(PAGE) as r:
        r.map(0, PAGE)
        with pytest.raises(ImportError, match=r"pip install -e \.\[torch\]"):
            tv.as_tensor(r, (4,), "float32")


def test_cuda_array_interface_on_the_test_driver(daemon_factory):
    torch = need_torch()
    d = daemon_factory("cuda")
    with d.client() as c, c.open_session("cai") as s, s.region(16 * MiB) as r:
        r.map(0, 3 * PAGE)
        view = tv.cuda_array_interface(r, (2, 1024, 128), torch.float16, offset=PAGE)
        cai = view.__cuda_array_interface__
        assert cai == {
            "shape": (2, 1024, 128),
            "typestr": "<f2",
            "data": (r.base + PAGE, False),
            "strides": None,
            "version": 3,
        }
        # the pointer is the region's device mapping: bytes written through the
        # region are what the driver reads at that address
        r.write(PAGE + 10, b"kvcached")
        mapper = s.mapper(r.device.uuid)
        assert mapper.read(cai["data"][0] + 10, 8) == b"kvcached"
        for name, typestr in [("float32", "<f4"), ("int8", "|i1"), ("uint8", "|u1"), ("int64", "<i8"), ("bool", "|b1")]:
            assert tv.cuda_array_interface(r, (16,), name).__cuda_array_interface__["typestr"] == typestr
        with pytest.raises(errors.InvalidArgument, match="bfloat16"):
            tv.cuda_array_interface(r, (16,), torch.bfloat16)
        with pytest.raises(errors.FailedPrecondition, match="not mapped"):
            tv.cuda_array_interface(r, (PAGE,), "float16", offset=2 * PAGE)
        pages = s.allocate(1)
        pv = tv.cuda_array_interface(pages[0], (PAGE // 4,), "int32")
        assert pv.__cuda_array_interface__["data"] == (pages[0].addr, False)
        s.free(pages)
        if not torch.cuda.is_available():
            # this machine: the CUDA tensor cannot be made; the error says why
            with pytest.raises(errors.FailedPrecondition, match="torch.cuda is not available"):
                tv.as_tensor(r, (16,), "float16")
        # (on a GPU host the test driver's addresses mean nothing to torch's
        # real driver: scripts/gpu-check.sh covers the real path)
