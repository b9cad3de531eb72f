"""Torch views of mapped daemon memory, without a copy.

    from kvcached_service.client.torch_views import as_tensor

    region = session.region(1 << 30)
    region.map(0, 64 << 20)
    k = as_tensor(region, (4096, 8, 128), "float16")           # offset 0
    v = as_tensor(region, (4096, 8, 128), "float16", offset=32 << 20)
    k[0] = 1.0                                                 # writes the page itself

A view is a tensor whose storage *is* the mapped range: a Region range
(every page of it must be mapped) or one Page. Which kind of view is the
mapper's to say (Mapper.view_device: "cpu", "cuda:N" or none):
- host pages: `torch.frombuffer` over a ctypes array at the mapped address
  (a CPU tensor).
- CUDA pages: an object exposing `__cuda_array_interface__` (version 3) for
  the device address, handed to `torch.as_tensor(obj, device="cuda:N")`,
  where N is this process's ordinal of the daemon's device (the mapper
  found it by UUID). `cuda_array_interface()` returns that object on its
  own, for CuPy, Numba or anything else that speaks the protocol.

The view does not keep the range mapped: unmapping or trimming the region,
freeing the page or closing the session while a view is alive leaves a
tensor over unmapped memory (host: SIGSEGV on access; CUDA: an illegal
address). Drop views before giving their pages back.

torch is an optional dependency (`pip install kvcached-service[torch]`, in a
checkout `pip install -e .[torch]`); it is imported on first use.
"""

from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING, Any, Sequence, Union

from .. import errors

if TYPE_CHECKING:
    from .client import Page
    from .region import Region

# dtype name -> (itemsize, __cuda_array_interface__ typestr or None)
# typestr is numpy's array-interface notation; bfloat16 has none, so it can
# be viewed on host pages but not handed over as a CUDA array interface.
DTYPES: dict[str, tuple[int, str | None]] = {
    "float16": (2, "<f2"),
    "bfloat16": (2, None),
    "float32": (4, "<f4"),
    "float64": (8, "<f8"),
    "int8": (1, "|i1"),
    "uint8": (1, "|u1"),
    "int16": (2, "<i2"),
    "int32": (4, "<i4"),
    "int64": (8, "<i8"),
    "bool": (1, "|b1"),
}

_INSTALL_HINT = "pip install -e .[torch] (or: pip install kvcached-service[torch])"


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise ImportError(f"torch views need PyTorch, which is not installed: {_INSTALL_HINT}") from exc
    return torch


def dtype_name(dtype: Any) -> str:
    """'float16' for "float16", torch.float16 or "torch.float16"."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    aliases = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32", "short": "int16"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise errors.InvalidArgument(f"dtype {dtype!r} is not supported for views (supported: {', '.join(DTYPES)})")
    return name


def _shape(shape: Union[int, Sequence[int]]) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise errors.InvalidArgument(f"shape must be a sequence of integers, got {shape!r}") from None
    if any(d < 0 for d in dims) or any(int(d) != d for d in shape):
        raise errors.InvalidArgument(f"shape {tuple(shape)} has a negative or non-integer dimension")
    return dims


def _locate(obj: "Region | Page", offset: int, nbytes: int) -> tuple[int, Any]:
    """Checked (address, mapper) of [offset, offset + nbytes) of a Region or Page."""
    from .client import Page
    from .region import Region

    if isinstance(obj, Region):
        obj._check_open()
        obj._check_mapped(offset, nbytes)  # InvalidArgument outside, FailedPrecondition where unmapped
        return obj.base + offset, obj._mapper
    if isinstance(obj, Page):
        obj._check(offset, nbytes)
        return obj.addr + offset, obj._mapper
    raise errors.InvalidArgument(f"a view needs a Region or a Page, got {type(obj).__name__}")


def _plan(obj, shape, dtype, offset: int) -> tuple[int, tuple[int, ...], str, int, Any]:
    name = dtype_name(dtype)
    itemsize = DTYPES[name][0]
    dims = _shape(shape)
    if offset < 0 or offset % itemsize:
        raise errors.InvalidArgument(f"offset {offset} must be a non-negative multiple of {name}'s size {itemsize}")
    nbytes = math.prod(dims) * itemsize
    addr, mapper = _locate(obj, offset, nbytes)
    return addr, dims, name, nbytes, mapper


def _view_device(mapper: Any) -> str | None:
    """What views of this mapper's bytes are: the mapper says
    (Mapper.view_device: "cpu", "cuda:N" or None)."""
    view_device = getattr(mapper, "view_device", None)
    return view_device() if view_device is not None else None


class CudaArrayView:
    """Device memory described by the CUDA Array Interface (version 3):
    C-contiguous (`strides` None), writable, no stream (the daemon's and the
    client's copies are synchronous). Keeps `owner` (the Region or Page)
    referenced, not mapped."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: Any = None):
        self.ptr = ptr
        self.shape = shape
        self.typestr = typestr
        self.owner = owner

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": self.typestr,
            "data": (self.ptr, False),  # (device pointer, read-only?)
            "strides": None,  # C-contiguous
            "version": 3,
        }

    def __repr__(self) -> str:
        return f"CudaArrayView(ptr=0x{self.ptr:x}, shape={self.shape}, typestr={self.typestr!r})"


def cuda_array_interface(obj: "Region | Page", shape, dtype, offset: int = 0) -> CudaArrayView:
    """A `__cuda_array_interface__` object for [offset, offset + size) of a
    mapped CUDA Region or Page. Needs no torch."""
    addr, dims, name, _, mapper = _plan(obj, shape, dtype, offset)
    if _view_device(mapper) in (None, "cpu"):
        raise errors.FailedPrecondition(f"the CUDA array interface needs CUDA pages; these are {mapper.kind!r} pages")
    typestr = DTYPES[name][1]
    if typestr is None:
        raise errors.InvalidArgument(f"{name} has no CUDA array interface type string; view it as int16/uint8 and reinterpret")
    return CudaArrayView(addr, dims, typestr, obj)


def as_tensor(obj: "Region | Page", shape, dtype, offset: int = 0):
    """A torch tensor of `shape` and `dtype` over the mapped bytes at
    `offset` of a Region or Page, sharing the memory (no copy)."""
    torch = _torch()
    addr, dims, name, nbytes, mapper = _plan(obj, shape, dtype, offset)
    tdtype = getattr(torch, name)
    device = _view_device(mapper)
    if device == "cpu":
        if nbytes == 0:
            return torch.empty(dims, dtype=tdtype)
        buf = (ctypes.c_char * nbytes).from_address(addr)
        return torch.frombuffer(buf, dtype=tdtype, count=math.prod(dims)).view(dims)
    if device is not None:
        view = cuda_array_interface(obj, dims, name, offset)
        if not torch.cuda.is_available():
            raise errors.FailedPrecondition(
                "these are CUDA pages but torch.cuda is not available in this process "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})"
            )
        return torch.as_tensor(view, device=torch.device(device))
    raise errors.FailedPrecondition(f"no torch view for {getattr(mapper, 'kind', None)!r} pages")


def region_tensor(region: "Region", shape, dtype, offset: int = 0):
    """as_tensor for a Region range (every page of it must be mapped)."""
    from .region import Region

    if not isinstance(region, Region):
        raise errors.InvalidArgument(f"region_tensor needs a Region, got {type(region).__name__}")
    return as_tensor(region, shape, dtype, offset)


def page_tensor(page: "Page", shape, dtype, offset: int = 0):
    """as_tensor for one Page."""
    from .client import Page

    if not isinstance(page, Page):
        raise errors.InvalidArgument(f"page_tensor needs a Page, got {type(page).__name__}")
    return as_tensor(page, shape, dtype, offset)
