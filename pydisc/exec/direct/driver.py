"""The few CUDA driver calls the direct launcher needs, through ctypes (no extra dependency).

libcuda is the driver torch itself runs on, so its primary context per device is the one torch uses:
kernels loaded here can read and write torch's allocations and run on torch's streams. A launch from
Python through ctypes costs about 8.5 us of host time on the H200 (measured there: cuda-python 7.1 us,
the driver's own floor 4.3 us).
"""
from __future__ import annotations

import ctypes
import threading

__all__ = ["Driver", "driver", "CudaError"]

_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_LOCK = threading.Lock()
_DRIVER: "Driver | None" = None

_p = ctypes.c_void_p
_u = ctypes.c_uint
_size = ctypes.c_size_t


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__("%s failed: %s (%d): %s" % (call, name, code, text))
        self.code = code


class Driver:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError("pydisc's direct launcher could not load the CUDA driver (libcuda.so.1): %s; "
                               "set PYDISC_GPU_EXECUTOR=iree to run compiled clusters through IREE's runtime"
                               % e) from e
        self.lib = lib
        signatures = {
            "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
            "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
            "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
            "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_p), ctypes.c_int),
            "cuCtxGetCurrent": (ctypes.POINTER(_p),),
            "cuCtxSetCurrent": (_p,),
            "cuCtxPushCurrent_v2": (_p,),
            "cuCtxPopCurrent_v2": (ctypes.POINTER(_p),),
            "cuModuleLoadData": (ctypes.POINTER(_p), ctypes.c_char_p),
            "cuModuleGetFunction": (ctypes.POINTER(_p), _p, ctypes.c_char_p),
            "cuFuncSetAttribute": (_p, ctypes.c_int, ctypes.c_int),
            "cuLaunchKernel": (_p, _u, _u, _u, _u, _u, _u, _u, _p, _p, _p),
            "cuMemcpyDtoDAsync_v2": (ctypes.c_uint64, ctypes.c_uint64, _size, _p),
            "cuMemsetD8Async": (ctypes.c_uint64, ctypes.c_ubyte, _size, _p),
            "cuMemsetD16Async": (ctypes.c_uint64, ctypes.c_ushort, _size, _p),
            "cuMemsetD32Async": (ctypes.c_uint64, ctypes.c_uint, _size, _p),
        }
        for name, args in signatures.items():
            function = getattr(lib, name)
            function.argtypes = list(args)
            function.restype = ctypes.c_int
        self.launch_kernel = lib.cuLaunchKernel
        self.memcpy = lib.cuMemcpyDtoDAsync_v2
        self.memset = {1: lib.cuMemsetD8Async, 2: lib.cuMemsetD16Async, 4: lib.cuMemsetD32Async}
        self.ctx_get_current = lib.cuCtxGetCurrent
        self.ctx_set_current = lib.cuCtxSetCurrent

    def check(self, code: int, call: str) -> None:
        if code:
            name, text = ctypes.c_char_p(), ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise CudaError(call, code, (name.value or b"?").decode(), (text.value or b"?").decode())

    def primary_context(self, index: int) -> int:
        device = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
        context = _p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        return context.value

    def current_context(self) -> int | None:
        context = _p()
        self.check(self.ctx_get_current(ctypes.byref(context)), "cuCtxGetCurrent")
        return context.value

    def load(self, context: int, ptx: bytes, kernels: list[tuple[str, int]]) -> dict[str, int]:
        """Load a PTX module into `context` (the driver JIT-compiles it for this GPU); function handles by
        kernel name, each allowed its dynamic shared memory."""
        self.check(self.lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            module = _p()
            self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ptx + b"\0"), "cuModuleLoadData")
            functions = {}
            for name, shared in kernels:
                function = _p()
                self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
                           "cuModuleGetFunction(%s)" % name)
                if shared:
                    self.check(self.lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                               "cuFuncSetAttribute(%s)" % name)
                functions[name] = function.value
            return functions
        finally:
            popped = _p()
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped))


def driver() -> Driver:
    global _DRIVER
    if _DRIVER is None:
        with _LOCK:
            if _DRIVER is None:
                _DRIVER = Driver()
    return _DRIVER
