"""Zero-copy interop with PyTorch and JAX through DLPack: examples/torch_interop.py and
examples/jax_interop.py, imported and run.

- The examples' results are as accurate as the frameworks' own attention (the accuracy
  criterion's factors of docs/contract.md, c = 2 and 3, over torch SDPA's or jax.nn.dot_product_attention's error, both against
  float64), forward and backward, bfloat16 and float16.
- The CuPy arrays are views of the frameworks' buffers (same address), cuflash reads the
  (B, N, H, D) -> (B, H, N, D) views in place, and the framework tensor made from out is
  out's memory.
- Under `with torch.cuda.stream(s)`, every cuflash kernel is launched on s, after the
  torch work already queued on s.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import GPU_MISSING, eps, requires_gpu, spin

pytestmark = requires_gpu

if GPU_MISSING is None:
    import cupy
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    import cuflash
    from cuflash import _checks, _compile

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DTYPES = ("bfloat16", "float16")


def load_example(name):
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"cuflash_examples_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def torch_example():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (the torch interop tests need it)")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA")
    return load_example("torch_interop")


@pytest.fixture(scope="module")
def jax_example():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with CuPy
    jax = pytest.importorskip("jax", reason="JAX is not installed (the JAX interop tests need it)")
    try:
        jax.devices("gpu")
    except RuntimeError as err:
        pytest.skip(f"JAX has no GPU backend (pip install 'jax[cuda12]'): {err}")
    return load_example("jax_interop")


def assert_as_accurate(errors, dtype, framework):
    """{name: (cuflash error, framework error, max |reference|)}: cuflash within the contract's
    factor of the framework's own error, plus a few ulps."""
    for name, (ours, theirs, size) in errors.items():
        c = 2 if name == "out" else 3
        atol = 4 * eps(np.dtype(dtype)) * max(1.0, size)
        assert np.isfinite(ours), f"{name}: cuflash error {ours}"
        assert ours <= c * theirs + atol, (
            f"{dtype} {name}: cuflash error {ours:.3g} > {c} x {framework} error {theirs:.3g} + {atol:.3g}"
        )


# ---- PyTorch ----


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_example_matches_sdpa(torch_example, dtype, causal):
    import torch

    errors = torch_example.run(getattr(torch, dtype), causal=causal)
    assert_as_accurate(errors, dtype, "torch SDPA")


def test_torch_example_main(torch_example):
    results = torch_example.main()
    assert len(results) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_zero_copy(torch_example, dtype):
    import torch

    ex = torch_example
    x = torch.randn(2, 100, 4, 64, device="cuda", dtype=getattr(torch, dtype))  # (B, N, H, D)
    cx = ex.to_cupy(x)
    assert cx.data.ptr == x.data_ptr(), "cupy.from_dlpack copied the tensor"
    assert cx.dtype.name == dtype and cx.shape == tuple(x.shape)
    assert cx.strides == tuple(s * x.element_size() for s in x.stride())
    assert cx.device.id == x.device.index

    view = cx.transpose(0, 2, 1, 3)  # (B, H, N, D), as the example hands it to cuflash
    assert _checks.attention_inputs(view, view, view, False, None, None).q is view, "cuflash copied the view"

    out = cuflash.attention(view, view, view)
    t = ex.to_torch(out)
    assert t.data_ptr() == out.data.ptr, "torch.from_dlpack copied cuflash's output"
    assert tuple(t.shape) == out.shape and t.dtype == x.dtype
    t.zero_()  # written through torch, read through CuPy: one buffer
    torch.cuda.synchronize()
    assert not bool(cupy.any(out.view(cupy.uint16))), "out does not see torch's write"


def test_torch_side_stream(torch_example, monkeypatch):
    """On a torch side stream s: a 0.3 s spin, then torch copies that write q, k, v, dout,
    then cuflash forward and backward through autograd. Every cuflash kernel must be
    launched on s (after the copies); the results are bitwise those of a later call on
    the default stream."""
    import torch

    ex = torch_example
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (2, 300, 4, 64)
    sources = [torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    ex.forward_backward(ex.flash_attention, sources[:3], sources[3], True)  # compile before the spin
    spin(0.0)
    targets = [torch.full_like(x, float("nan")) for x in sources]  # NaN until s's copies run
    torch.cuda.synchronize()

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        # a stream torch made for us does not wait for the legacy default stream, so a kernel
        # launched on the default stream instead of s would not wait for the spin either
        assert ex.cupy_stream().is_non_blocking

    launched = []
    get_function = _compile.get_function

    def spy(*args, **kwargs):  # every launch fetches its kernel here, just before launching
        launched.append(cupy.cuda.get_current_stream().ptr)
        return get_function(*args, **kwargs)

    monkeypatch.setattr(_compile, "get_function", spy)
    with torch.cuda.stream(s):
        with ex.cupy_stream():
            spin(0.3)
        for dst, src in zip(targets, sources):
            dst.copy_(src)
        q, k, v = (x.requires_grad_() for x in targets[:3])
        out = ex.flash_attention(q, k, v, causal=True)
        out.backward(targets[3])
        pending = not s.query()
    s.synchronize()
    monkeypatch.undo()

    assert pending, "s finished before the host had queued everything: the test did not overlap"
    assert launched, "no cuflash kernel was launched"
    assert set(launched) == {s.cuda_stream}, (
        f"cuflash launched on streams {sorted(set(launched))}, torch's stream is {s.cuda_stream}"
    )
    got = [out.detach(), q.grad, k.grad, v.grad]
    want = ex.forward_backward(ex.flash_attention, sources[:3], sources[3], True)  # default stream
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} differs from the default-stream run"


# ---- JAX ----


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_example_matches_dot_product_attention(jax_example, dtype):
    import jax.numpy as jnp

    errors = jax_example.run(getattr(jnp, dtype), causal=True)
    assert_as_accurate(errors, dtype, "jax.nn.dot_product_attention")


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_zero_copy(jax_example, dtype):
    import jax
    import jax.numpy as jnp

    ex = jax_example
    x = jax.random.normal(jax.random.key(0), (2, 100, 4, 64), dtype=getattr(jnp, dtype))
    cx = ex.to_cupy(x)
    assert cx.data.ptr == x.unsafe_buffer_pointer(), "cupy.from_dlpack copied the JAX array"
    assert cx.dtype.name == dtype and cx.shape == x.shape

    view = cx.transpose(0, 2, 1, 3)
    assert _checks.attention_inputs(view, view, view, False, None, None).q is view, "cuflash copied the view"
    out = cuflash.attention(view, view, view)
    y = ex.to_jax(out)
    assert y.unsafe_buffer_pointer() == out.data.ptr, "jax.numpy.from_dlpack copied cuflash's output"
    assert np.array_equal(np.asarray(y).view(np.uint16), cupy.asnumpy(out).view(np.uint16))
