"""Whether this machine can run cuflash's GPU functions and, if not, exactly why.

CuPy's own answer on a machine without a driver is "driver version is
insufficient", which reads as if an old driver were installed; this module
tells apart a missing CuPy, a missing driver, a driver older than CuPy's CUDA
runtime and a driver that sees no GPU.
"""

from __future__ import annotations

import ctypes
import os
import sys

# A command that works on any machine with pip: the packages of cuflash's extras cuda12 and
# cuda13 (pyproject.toml; a test holds the two together).
CUPY_INSTALL = (
    "pip install 'cupy-cuda12x>=14' 'cuda-toolkit[cudart,nvrtc,cublas,curand]>=12.9,<13' 'ml_dtypes>=0.5' "
    "(with a CUDA 13 driver: 'cupy-cuda13x>=14' 'cuda-toolkit[cudart,nvrtc,cublas,curand]>=13,<14' 'ml_dtypes>=0.5')"
)

DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
_INSUFFICIENT_DRIVER = 35   # cudaErrorInsufficientDriver
_NO_DEVICE = 100            # cudaErrorNoDevice

_problem: list = []   # the answer, once found (it does not change while the process runs)


def problem() -> str | None:
    """Why cuflash's GPU functions cannot run here, in one sentence, or None if they can."""
    if not _problem:
        _problem.append(_find_problem())
    return _problem[0]


def cupy_import_problem(err: ImportError) -> str:
    """What an ImportError of ``import cupy`` means, and the install command that mends it."""
    if isinstance(err, ModuleNotFoundError) and err.name in ("cupy", "cupy_backends"):
        return f"CuPy is not installed: {CUPY_INSTALL}"
    return f"CuPy is installed but cannot be imported ({err}); reinstall it: {CUPY_INSTALL}"


def _find_problem() -> str | None:
    try:
        import cupy
    except ImportError as err:
        return cupy_import_problem(err)
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as err:
        return _runtime_problem(runtime, err)
    if count == 0:
        return _no_device()
    return None


def _runtime_problem(runtime, err) -> str:
    status = getattr(err, "status", None)
    if status == _INSUFFICIENT_DRIVER:
        if not _driver_loads():
            return f"no NVIDIA driver is installed ({DRIVER_LIBRARY} could not be loaded)"
        return (
            f"the NVIDIA driver supports CUDA {_version(runtime.driverGetVersion())}, older than the "
            f"CUDA {_version(runtime.runtimeGetVersion())} runtime of this CuPy build: update the driver, "
            "or install the CuPy build for it (cupy-cuda12x for CUDA 12)"
        )
    if status == _NO_DEVICE:
        return _no_device()
    return f"CUDA could not list the GPUs ({err})"


def _no_device() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible!r} hides the others)" if visible is not None else ""
    return f"the NVIDIA driver is installed but sees no GPU{hint}"


def _driver_loads() -> bool:
    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return False
    return True


def _version(v: int) -> str:
    """CUDA's integer version (12090) as text (12.9); 0 (no driver) as 'none'."""
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"
