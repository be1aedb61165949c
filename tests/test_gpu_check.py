"""CPU tests of how cuflash says why its GPU functions cannot run (cuflash._gpu).

Each case stands in a fake CuPy for the machine it describes, so that every branch
runs on any machine: no CuPy, CuPy that cannot be imported, no driver, a driver too
old for CuPy's runtime, a driver that sees no GPU.
"""

from __future__ import annotations

import sys
import types

import pytest

from cuflash import _gpu


class FakeCudaError(Exception):
    def __init__(self, status, text):
        super().__init__(text)
        self.status = status


def fake_cupy(count=None, status=None, driver=12020, runtime=12090):
    """A module with just what _gpu reads: cupy.cuda.runtime."""

    def get_device_count():
        if status is not None:
            raise FakeCudaError(status, f"cudaError {status}")
        return count

    rt = types.SimpleNamespace(
        CUDARuntimeError=FakeCudaError,
        getDeviceCount=get_device_count,
        driverGetVersion=lambda: driver,
        runtimeGetVersion=lambda: runtime,
    )
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))


def test_no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # import cupy raises ModuleNotFoundError
    assert _gpu._find_problem().startswith("CuPy is not installed: pip install cupy-cuda12x ")


def test_broken_cupy(monkeypatch):
    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == "cupy":
                raise ImportError("libnvrtc.so.12: cannot open shared object file")

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder()] + sys.meta_path)
    problem = _gpu._find_problem()
    assert problem.startswith("CuPy is installed but cannot be imported (libnvrtc.so.12")
    assert "reinstall it: pip install cupy-cuda12x" in problem


def test_no_driver(monkeypatch):
    # CuPy's own message here would be "driver version is insufficient"
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(status=35, driver=0))
    monkeypatch.setattr(_gpu, "_driver_loads", lambda: False)
    assert _gpu._find_problem() == f"no NVIDIA driver is installed ({_gpu.DRIVER_LIBRARY} could not be loaded)"


def test_old_driver(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(status=35, driver=12020, runtime=12090))
    monkeypatch.setattr(_gpu, "_driver_loads", lambda: True)
    problem = _gpu._find_problem()
    assert problem.startswith("the NVIDIA driver supports CUDA 12.2, older than the CUDA 12.9 runtime")


@pytest.mark.parametrize("machine", [{"status": 100}, {"count": 0}], ids=["no-device-error", "zero-devices"])
def test_driver_without_gpu(monkeypatch, machine):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(**machine))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _gpu._find_problem() == "the NVIDIA driver is installed but sees no GPU (CUDA_VISIBLE_DEVICES='' hides the others)"


def test_other_cuda_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(status=999))
    assert _gpu._find_problem() == "CUDA could not list the GPUs (cudaError 999)"


def test_gpu_present(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(count=2))
    assert _gpu._find_problem() is None


def test_require_gpu_says_the_problem(monkeypatch):
    import cuflash

    monkeypatch.setattr(_gpu, "_problem", ["no NVIDIA driver is installed (libcuda.so.1 could not be loaded)"])
    with pytest.raises(RuntimeError, match=r"need an NVIDIA GPU: no NVIDIA driver is installed \(libcuda"):
        cuflash.require_gpu()
