"""CPU tests of how cuflash says why its GPU functions cannot run (cuflash._gpu).

Each case stands in a fake CuPy for the machine it describes, so that every branch
runs on any machine: no CuPy, CuPy that cannot be imported, no driver, a driver too
old for CuPy's runtime, a driver that sees no GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

import cuflash
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
    assert _gpu._find_problem().startswith("CuPy is not installed: pip install 'cupy-cuda12x>=14' ")


def test_broken_cupy(monkeypatch):
    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == "cupy":
                raise ImportError("libnvrtc.so.12: cannot open shared object file")

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder()] + sys.meta_path)
    problem = _gpu._find_problem()
    assert problem.startswith("CuPy is installed but cannot be imported (libnvrtc.so.12")
    assert "reinstall it: pip install 'cupy-cuda12x>=14'" in problem


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
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(status=35, driver=0))   # CuPy imports, no driver
    monkeypatch.setattr(_gpu, "_problem", ["no NVIDIA driver is installed (libcuda.so.1 could not be loaded)"])
    with pytest.raises(RuntimeError, match=r"need an NVIDIA GPU: no NVIDIA driver is installed \(libcuda"):
        cuflash.require_gpu()


def run_without_cupy(code: str) -> str:
    """The standard output of ``code`` run in a fresh process where ``import cupy`` fails."""
    code = 'import sys\nsys.modules["cupy"] = None   # import cupy raises ModuleNotFoundError\n' + textwrap.dedent(code)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(cuflash.__file__)))   # the cuflash under test
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_cuflash_reaches_naive_without_cupy():
    """`import cuflash` makes cuflash.naive reachable (docs/contract.md), and needs no CuPy for it."""
    out = run_without_cupy("""
        import cuflash
        print(callable(cuflash.naive.attention), callable(cuflash.naive.attention_backward), "naive" in cuflash.__all__)
    """)
    assert out.split() == ["True", "True", "True"]


def test_require_gpu_and_the_gpu_functions_raise_one_error_without_cupy():
    """Without CuPy, cuflash.require_gpu() and every GPU function raise the same error: one type,
    an ImportError (docs/contract.md) that is also the RuntimeError scripts catch around
    require_gpu(), and one message."""
    out = run_without_cupy("""
        import json
        import numpy as np
        import cuflash
        x, lse = np.ones((2, 4, 8), np.float16), np.zeros((2, 4), np.float32)
        calls = [cuflash.require_gpu, lambda: cuflash.attention(x, x, x),
                 lambda: cuflash.attention_backward(x, x, x, x, x, lse), lambda: cuflash.attention_vjp(x, x, x),
                 lambda: cuflash.merge_attention([x], [lse]), lambda: cuflash.attention_kvcache(x, x, x)]
        errors = []
        for call in calls:
            try:
                call()
            except Exception as err:
                errors.append([type(err).__name__, isinstance(err, ImportError), isinstance(err, RuntimeError), str(err)])
        print(json.dumps(errors))
    """)
    errors = json.loads(out)
    assert len(errors) == 6, errors
    assert all(e == errors[0] for e in errors), errors
    _, is_import_error, is_runtime_error, message = errors[0]
    assert is_import_error and is_runtime_error
    assert message.startswith("cuflash's GPU functions need an NVIDIA GPU: CuPy is not installed: pip install 'cupy-cuda12x>=14' ")


def test_the_install_hint_names_the_packages_of_the_cuda_extras():
    """The hint a missing CuPy prints installs what `pip install "cuflash[cuda12]"` (or
    cuda13) would: the same requirements as pyproject.toml's extras."""
    import re

    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    if not os.path.exists(pyproject):
        pytest.skip("the tests run from an installed package, without the source tree's pyproject.toml")
    text = open(pyproject, encoding="utf-8").read()
    for extra in ("cuda12", "cuda13"):
        (listed,) = re.findall(rf"^{extra} = \[(.*)\]$", text, re.M)
        requirements = re.findall(r'"([^"]+)"', listed)
        assert requirements and all(f"'{r}'" in _gpu.CUPY_INSTALL for r in requirements), (extra, requirements)
