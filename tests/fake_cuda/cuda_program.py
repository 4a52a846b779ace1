"""The Python twin of cuda_program.c: reaches libcuda through ctypes (``dlopen`` + ``dlsym``)
or through ``cuGetProcAddress_v2`` as the CUDA runtime does, runs the steps it is given and
prints the same lines (see cuda_program.c for the steps)."""

from __future__ import annotations

import ctypes
import sys

CUresult = ctypes.c_int
CUdeviceptr = ctypes.c_ulonglong
INIT = ctypes.CFUNCTYPE(CUresult, ctypes.c_uint)
ALLOC = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(CUdeviceptr), ctypes.c_size_t)
FREE = ctypes.CFUNCTYPE(CUresult, CUdeviceptr)
INFO = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))


def main(mode: str, steps: list[str]) -> int:
    driver = ctypes.CDLL("libcuda.so.1")
    if mode == "procaddress":
        get = driver.cuGetProcAddress_v2
        get.restype = CUresult
        get.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_ulonglong,
            ctypes.POINTER(ctypes.c_int),
        ]

        def lookup(name: str, kind):  # type: ignore[no-untyped-def]
            pointer, status = ctypes.c_void_p(), ctypes.c_int()
            if get(name.encode(), ctypes.byref(pointer), 12000, 0, ctypes.byref(status)) != 0:
                raise SystemExit(f"cuGetProcAddress_v2({name}) failed")
            return kind(pointer.value)

        init, alloc = lookup("cuInit", INIT), lookup("cuMemAlloc", ALLOC)
        free, info = lookup("cuMemFree", FREE), lookup("cuMemGetInfo", INFO)
    else:
        init = INIT(("cuInit", driver))
        alloc = ALLOC(("cuMemAlloc_v2", driver))
        free = FREE(("cuMemFree_v2", driver))
        info = INFO(("cuMemGetInfo_v2", driver))
    last = CUdeviceptr(0)
    for step in steps:
        if step == "init":
            print("cuInit", init(0))
        elif step == "info":
            free_bytes, total_bytes = ctypes.c_size_t(), ctypes.c_size_t()
            result = info(ctypes.byref(free_bytes), ctypes.byref(total_bytes))
            print(f"cuMemGetInfo {result} free={free_bytes.value} total={total_bytes.value}")
        elif step.startswith("alloc:"):
            size = int(step[6:])
            pointer = CUdeviceptr(0)
            result = alloc(ctypes.byref(pointer), size)
            if result == 0:
                last = pointer
            print("cuMemAlloc", size, result)
        elif step == "free":
            print("cuMemFree", free(last))
        elif step == "wait":
            print("waiting", flush=True)
            if not sys.stdin.readline():
                break
        else:
            print(f"unknown step {step}", file=sys.stderr)
            return 2
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
