"""The ctypes structs in driver.py match NVIDIA's cuda.h, byte for byte."""

from __future__ import annotations

import ctypes
import json
import subprocess

from kvcached_service.cuda import driver as cu

C_PROGRAM = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
#define F(T, f) printf("\"%s.%s\": [%zu, %zu],", #T, #f, offsetof(T, f), sizeof(((T *)0)->f))
int main(void) {
    printf("{");
    printf("\"CUmemAllocationProp\": %zu, \"CUmemLocation\": %zu, \"CUmemAccessDesc\": %zu, \"CUuuid\": %zu,",
           sizeof(CUmemAllocationProp), sizeof(CUmemLocation), sizeof(CUmemAccessDesc), sizeof(CUuuid));
    F(CUmemLocation, type); F(CUmemLocation, id);
    F(CUmemAccessDesc, location); F(CUmemAccessDesc, flags);
    F(CUmemAllocationProp, type); F(CUmemAllocationProp, requestedHandleTypes);
    F(CUmemAllocationProp, location); F(CUmemAllocationProp, win32HandleMetaData);
    F(CUmemAllocationProp, allocFlags);
    F(CUmemAllocationProp, allocFlags.compressionType); F(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable);
    F(CUmemAllocationProp, allocFlags.usage); F(CUmemAllocationProp, allocFlags.reserved);
    F(CUuuid, bytes);
    printf("\"CUdeviceptr\": %zu, \"CUmemGenericAllocationHandle\": %zu, \"CUdevice\": %zu, \"CUresult\": %zu,",
           sizeof(CUdeviceptr), sizeof(CUmemGenericAllocationHandle), sizeof(CUdevice), sizeof(CUresult));
    printf("\"enums\": [%d, %d, %d, %d, %d, %d, %d, %d, %d]}\n",
           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE,
           CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ALLOC_GRANULARITY_MINIMUM,
           CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
           CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY);
    return 0;
}
"""


def c_layout(cuda_include, tmp_path) -> dict:
    src = tmp_path / "layout.c"
    src.write_text(C_PROGRAM)
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", f"-I{cuda_include}", "-o", str(exe), str(src)], check=True)
    return json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)


def test_struct_sizes_and_offsets_match_cuda_h(cuda_include, tmp_path):
    c = c_layout(cuda_include, tmp_path)
    assert c["CUmemAllocationProp"] == ctypes.sizeof(cu.CUmemAllocationProp) == 32
    assert c["CUmemLocation"] == ctypes.sizeof(cu.CUmemLocation) == 8
    assert c["CUmemAccessDesc"] == ctypes.sizeof(cu.CUmemAccessDesc) == 12
    assert c["CUuuid"] == ctypes.sizeof(cu.CUuuid) == 16

    structs = {
        "CUmemLocation": cu.CUmemLocation,
        "CUmemAccessDesc": cu.CUmemAccessDesc,
        "CUmemAllocationProp": cu.CUmemAllocationProp,
        "CUuuid": cu.CUuuid,
    }
    checked = 0
    for key, value in c.items():
        if "." not in key:
            continue
        offset, size = value
        sname, path = key.split(".", 1)
        st, off = structs[sname], 0
        for part in path.split("."):
            desc = getattr(st, part)
            off += desc.offset
            st = dict(st._fields_)[part]
        assert (off, ctypes.sizeof(st)) == (offset, size), f"{key}: ctypes {(off, ctypes.sizeof(st))} != C {(offset, size)}"
        checked += 1
    assert checked == 14


def test_scalar_types_and_enum_values_match_cuda_h(cuda_include, tmp_path):
    c = c_layout(cuda_include, tmp_path)
    assert c["CUdeviceptr"] == ctypes.sizeof(cu.CUdeviceptr)
    assert c["CUmemGenericAllocationHandle"] == ctypes.sizeof(cu.CUmemGenericAllocationHandle)
    assert c["CUdevice"] == ctypes.sizeof(cu.CUdevice)
    assert c["CUresult"] == ctypes.sizeof(cu.CUresult)
    assert c["enums"] == [
        cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        cu.CU_MEM_ALLOCATION_TYPE_PINNED,
        cu.CU_MEM_LOCATION_TYPE_DEVICE,
        cu.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        cu.CU_MEM_ACCESS_FLAGS_PROT_READ,
        cu.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        cu.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        cu.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        cu.CUDA_ERROR_OUT_OF_MEMORY,
    ]


def test_every_table_entry_has_argtypes_restype_and_prototype_comment():
    import inspect

    src = inspect.getsource(cu)
    for name, argtypes in cu._FUNCTIONS:
        assert isinstance(argtypes, list), name
        assert f"CUresult {name}(" in src, f"{name}: no C prototype comment above its table entry"
    # versioned symbols where cuda.h redirects
    for legacy in ("cuMemGetInfo", "cuMemsetD8", "cuMemcpyHtoD", "cuMemcpyDtoH", "cuDevicePrimaryCtxRelease", "cuDeviceGetUuid"):
        assert legacy not in cu.FUNCTION_NAMES
        assert legacy + "_v2" in cu.FUNCTION_NAMES
