"""The one module that owns every CUDA driver call made from Python.

Everything the daemon (backends/cuda.py) and the Python client
(client/cuda_mapper.py) call in libcuda is declared in `_FUNCTIONS` below:
the C prototype from cuda.h as a comment above each entry, argtypes and
restype always set. Where cuda.h redirects a name to a versioned symbol
(`#define cuMemGetInfo cuMemGetInfo_v2`) the versioned symbol is asked for:
the unversioned exports are the old 32-bit ABI.

Every call's CUresult goes through one checker (`_errcheck`), which raises a
typed error carrying the enumerator name: `CudaOutOfMemory`
(errors.ResourceExhausted) for CUDA_ERROR_OUT_OF_MEMORY, `CudaError`
(errors.Internal) for everything else. Both derive from `CudaDriverError`,
which has `.function`, `.result` and `.name`.

The library is `$KVCACHED_LIBCUDA` (default `libcuda.so.1`), loaded on first
use by `load()`; a library that cannot be loaded, or lacks a symbol, raises
`DriverLoadError` saying which and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from ctypes import POINTER, Structure, byref, c_char_p, c_int, c_size_t, c_ubyte, c_uint, c_ulonglong, c_ushort, c_void_p

from .. import errors

ENV_LIBCUDA = "KVCACHED_LIBCUDA"
DEFAULT_LIBCUDA = "libcuda.so.1"

# --------------------------------------------------------------------------
# types and constants (values from cuda.h, CUDA 13.0; tests/cuda checks the
# struct layouts against the header with a C compiler)

CUresult = c_int
CUdevice = c_int  # typedef int CUdevice_v1; typedef CUdevice_v1 CUdevice;
CUcontext = c_void_p  # typedef struct CUctx_st *CUcontext;
CUdeviceptr = c_ulonglong  # typedef unsigned long long CUdeviceptr_v2; (64-bit hosts)
CUmemGenericAllocationHandle = c_ulonglong  # typedef unsigned long long CUmemGenericAllocationHandle_v1;
CUstream = c_void_p  # typedef struct CUstream_st *CUstream;
CUevent = c_void_p  # typedef struct CUevent_st *CUevent;

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_SUPPORTED = 801

CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103

CU_MEM_HANDLE_TYPE_NONE = 0x0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0
CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
CU_STREAM_NON_BLOCKING = 0x1
CU_EVENT_BLOCKING_SYNC = 0x1
CU_EVENT_DISABLE_TIMING = 0x2


class CUuuid(Structure):
    # typedef struct CUuuid_st { char bytes[16]; } CUuuid;
    _fields_ = [("bytes", c_ubyte * 16)]


class CUmemLocation(Structure):
    # typedef struct CUmemLocation_st { CUmemLocationType type; int id; } CUmemLocation;   (8 bytes)
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemAllocationPropAllocFlags(Structure):
    # struct { unsigned char compressionType; unsigned char gpuDirectRDMACapable;
    #          unsigned short usage; unsigned char reserved[4]; } allocFlags;
    _fields_ = [
        ("compressionType", c_ubyte),
        ("gpuDirectRDMACapable", c_ubyte),
        ("usage", c_ushort),
        ("reserved", c_ubyte * 4),
    ]


class CUmemAllocationProp(Structure):
    # typedef struct CUmemAllocationProp_st {
    #     CUmemAllocationType type; CUmemAllocationHandleType requestedHandleTypes;
    #     CUmemLocation location; void *win32HandleMetaData; struct {...} allocFlags;
    # } CUmemAllocationProp;   (32 bytes)
    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", CUmemAllocationPropAllocFlags),
    ]


class CUmemAccessDesc(Structure):
    # typedef struct CUmemAccessDesc_st { CUmemLocation location; CUmemAccess_flags flags; } CUmemAccessDesc;  (12 bytes)
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


def allocation_prop(ordinal: int, handle_types: int = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) -> CUmemAllocationProp:
    """Pinned device memory on `ordinal`, exportable as `handle_types`."""
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = handle_types
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def access_desc(ordinal: int, flags: int = CU_MEM_ACCESS_FLAGS_PROT_READWRITE) -> CUmemAccessDesc:
    desc = CUmemAccessDesc()
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = flags
    return desc


def format_uuid(uuid: CUuuid) -> str:
    """nvidia-smi's spelling: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# --------------------------------------------------------------------------
# errors


class DriverLoadError(errors.FailedPrecondition):
    """The driver library cannot be loaded or lacks a function."""


class CudaDriverError(errors.KVCachedError):
    """A driver call returned something other than CUDA_SUCCESS."""

    def __init__(self, function: str, result: int, name: str, context: str = ""):
        self.function = function
        self.result = result
        self.name = name
        self.context = context
        prefix = f"{context}: " if context else ""
        super().__init__(f"{prefix}{function} failed: {name} ({result})")

    def with_context(self, context: str) -> "CudaDriverError":
        """The same error, its message prefixed with what was being done."""
        ctx = f"{context}: {self.context}" if self.context else context
        return type(self)(self.function, self.result, self.name, ctx)


class CudaError(CudaDriverError, errors.Internal):
    pass


class CudaOutOfMemory(CudaDriverError, errors.ResourceExhausted):
    pass


_FALLBACK_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE",
    600: "CUDA_ERROR_NOT_READY",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    999: "CUDA_ERROR_UNKNOWN",
}


def make_error(function: str, result: int, name: str) -> CudaDriverError:
    """The one place a CUresult becomes an exception class."""
    cls = CudaOutOfMemory if result == CUDA_ERROR_OUT_OF_MEMORY else CudaError
    return cls(function, result, name)


# --------------------------------------------------------------------------
# the function table: (name, argtypes); restype is always CUresult.

_PCHAR = POINTER(c_char_p)

_FUNCTIONS: list[tuple[str, list]] = [
    # CUresult cuGetErrorName(CUresult error, const char **pStr);
    ("cuGetErrorName", [CUresult, _PCHAR]),
    # CUresult cuGetErrorString(CUresult error, const char **pStr);
    ("cuGetErrorString", [CUresult, _PCHAR]),
    # CUresult cuInit(unsigned int Flags);
    ("cuInit", [c_uint]),
    # CUresult cuDriverGetVersion(int *driverVersion);
    ("cuDriverGetVersion", [POINTER(c_int)]),
    # CUresult cuDeviceGetCount(int *count);
    ("cuDeviceGetCount", [POINTER(c_int)]),
    # CUresult cuDeviceGet(CUdevice *device, int ordinal);
    ("cuDeviceGet", [POINTER(CUdevice), c_int]),
    # CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
    ("cuDeviceGetName", [c_char_p, c_int, CUdevice]),
    # CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
    ("cuDeviceGetUuid_v2", [POINTER(CUuuid), CUdevice]),
    # CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
    ("cuDeviceGetAttribute", [POINTER(c_int), c_int, CUdevice]),
    # CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
    ("cuDeviceTotalMem_v2", [POINTER(c_size_t), CUdevice]),
    # CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
    ("cuDevicePrimaryCtxRetain", [POINTER(CUcontext), CUdevice]),
    # CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
    ("cuDevicePrimaryCtxRelease_v2", [CUdevice]),
    # CUresult cuCtxSetCurrent(CUcontext ctx);
    ("cuCtxSetCurrent", [CUcontext]),
    # CUresult cuCtxGetCurrent(CUcontext *pctx);
    ("cuCtxGetCurrent", [POINTER(CUcontext)]),
    # CUresult cuCtxSynchronize(void);
    ("cuCtxSynchronize", []),
    # CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
    ("cuMemGetInfo_v2", [POINTER(c_size_t), POINTER(c_size_t)]),
    # CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
    #                                        CUmemAllocationGranularity_flags option);
    ("cuMemGetAllocationGranularity", [POINTER(c_size_t), POINTER(CUmemAllocationProp), c_int]),
    # CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
    #                      unsigned long long flags);
    ("cuMemCreate", [POINTER(CUmemGenericAllocationHandle), c_size_t, POINTER(CUmemAllocationProp), c_ulonglong]),
    # CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
    ("cuMemRelease", [CUmemGenericAllocationHandle]),
    # CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
    #                                       CUmemAllocationHandleType handleType, unsigned long long flags);
    ("cuMemExportToShareableHandle", [c_void_p, CUmemGenericAllocationHandle, c_int, c_ulonglong]),
    # CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
    #                                         CUmemAllocationHandleType shHandleType);
    # (for POSIX fds, osHandle is the fd itself cast to a pointer: pass c_void_p(fd))
    ("cuMemImportFromShareableHandle", [POINTER(CUmemGenericAllocationHandle), c_void_p, c_int]),
    # CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
    #                              unsigned long long flags);
    ("cuMemAddressReserve", [POINTER(CUdeviceptr), c_size_t, c_size_t, CUdeviceptr, c_ulonglong]),
    # CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
    ("cuMemAddressFree", [CUdeviceptr, c_size_t]),
    # CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
    #                   unsigned long long flags);
    ("cuMemMap", [CUdeviceptr, c_size_t, c_size_t, CUmemGenericAllocationHandle, c_ulonglong]),
    # CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
    ("cuMemUnmap", [CUdeviceptr, c_size_t]),
    # CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
    ("cuMemSetAccess", [CUdeviceptr, c_size_t, POINTER(CUmemAccessDesc), c_size_t]),
    # CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
    ("cuMemsetD8_v2", [CUdeviceptr, c_ubyte, c_size_t]),
    # CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
    ("cuMemcpyHtoD_v2", [CUdeviceptr, c_void_p, c_size_t]),
    # CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
    ("cuMemcpyDtoH_v2", [c_void_p, CUdeviceptr, c_size_t]),
    # CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
    ("cuStreamCreate", [POINTER(CUstream), c_uint]),
    # CUresult cuStreamDestroy_v2(CUstream hStream);   (#define cuStreamDestroy cuStreamDestroy_v2)
    ("cuStreamDestroy_v2", [CUstream]),
    # CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
    ("cuMemsetD8Async", [CUdeviceptr, c_ubyte, c_size_t, CUstream]),
    # CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
    ("cuEventCreate", [POINTER(CUevent), c_uint]),
    # CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
    ("cuEventRecord", [CUevent, CUstream]),
    # CUresult cuEventQuery(CUevent hEvent);   (CUDA_ERROR_NOT_READY is an answer, not an error: unchecked)
    ("cuEventQuery", [CUevent]),
    # CUresult cuEventSynchronize(CUevent hEvent);
    ("cuEventSynchronize", [CUevent]),
    # CUresult cuEventDestroy_v2(CUevent hEvent);   (#define cuEventDestroy cuEventDestroy_v2)
    ("cuEventDestroy_v2", [CUevent]),
]

# These report errors themselves; checking them would recurse. cuEventQuery
# answers CUDA_ERROR_NOT_READY for work still running: its caller reads it.
_UNCHECKED = {"cuGetErrorName", "cuGetErrorString", "cuEventQuery"}

FUNCTION_NAMES: tuple[str, ...] = tuple(name for name, _ in _FUNCTIONS)


class Driver:
    """The loaded library: one attribute per entry of `_FUNCTIONS`, each a
    ctypes function whose non-zero result raises a CudaDriverError."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as exc:
            raise DriverLoadError(
                f"cannot load the CUDA driver library {path!r} (set {ENV_LIBCUDA} to its path): {exc}"
            ) from exc
        for name, argtypes in _FUNCTIONS:
            try:
                fn = getattr(self._lib, name)
            except AttributeError as exc:
                raise DriverLoadError(f"the CUDA driver library {path!r} has no function {name}") from exc
            fn.argtypes = argtypes
            fn.restype = CUresult
            if name not in _UNCHECKED:
                fn.errcheck = self._errcheck
            setattr(self, name, fn)

    def error_name(self, result: int) -> str:
        s = c_char_p()
        if self.cuGetErrorName(result, byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode()
        return _FALLBACK_NAMES.get(result, f"CUresult {result}")

    def error_string(self, result: int) -> str:
        s = c_char_p()
        if self.cuGetErrorString(result, byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode()
        return self.error_name(result)

    @contextlib.contextmanager
    def current(self, ctx: int) -> Iterator[None]:
        """`ctx` current on this thread for the block, the thread's previous
        context restored after (no call when it is current already)."""
        prev = CUcontext()
        self.cuCtxGetCurrent(byref(prev))
        if prev.value == ctx:
            yield
            return
        self.cuCtxSetCurrent(ctx)
        try:
            yield
        finally:
            self.cuCtxSetCurrent(prev)

    def map_run(self, ctx: int, ordinal: int, addr: int, size: int, fds: list[int],
                kept: list[int | None]) -> list[int]:
        """A client's driver work for a run of adjacent pages, in one call:
        with `ctx` current, each page mapped at `addr + i * size` from
        `kept[i]` (a handle imported before) or else imported from `fds[i]`,
        then one cuMemSetAccess READWRITE for `ordinal` over the run. Every
        fd is closed, in every case. Returns the handles imported (at the
        pages that had no kept one; 0 at the others), which the caller
        keeps or releases (`release`). All or nothing: on a failure what was
        mapped is unmapped, what was imported released, and the error
        raised."""
        imported = [0] * len(fds)
        closed = mapped = 0
        with self.current(ctx):
            try:
                for i, fd in enumerate(fds):
                    handle = kept[i]
                    if handle is None:
                        h = CUmemGenericAllocationHandle()
                        try:
                            # the fd travels by value in the void* argument
                            self.cuMemImportFromShareableHandle(byref(h), c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
                        finally:
                            closed += 1
                            os.close(fd)
                        handle = imported[i] = h.value
                    else:
                        closed += 1
                        os.close(fd)
                    self.cuMemMap(addr + mapped * size, size, 0, handle, 0)
                    mapped += 1
                desc = access_desc(ordinal)
                self.cuMemSetAccess(addr, size * len(fds), byref(desc), 1)
            except BaseException:
                for fd in fds[closed:]:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                for i in range(mapped):
                    with contextlib.suppress(CudaDriverError):
                        self.cuMemUnmap(addr + i * size, size)
                for h in imported:
                    if h:
                        with contextlib.suppress(CudaDriverError):
                            self.cuMemRelease(h)
                raise
        return imported

    def release(self, ctx: int, handles: list[int]) -> None:
        """cuMemRelease each handle with `ctx` current; tries them all, then
        raises the first error."""
        first: CudaDriverError | None = None
        with self.current(ctx):
            for h in handles:
                try:
                    self.cuMemRelease(h)
                except CudaDriverError as exc:
                    first = first or exc
        if first is not None:
            raise first

    def _errcheck(self, result, func, args):
        if result != CUDA_SUCCESS:
            raise make_error(func.__name__, result, self.error_name(result))
        return result


_lock = threading.Lock()
_drivers: dict[str, Driver] = {}


def library_path() -> str:
    return os.environ.get(ENV_LIBCUDA) or DEFAULT_LIBCUDA


def load(path: str | None = None) -> Driver:
    """The driver at `path` (default: $KVCACHED_LIBCUDA or libcuda.so.1),
    loaded once per process."""
    path = path or library_path()
    with _lock:
        drv = _drivers.get(path)
        if drv is None:
            drv = _drivers[path] = Driver(path)
        return drv
