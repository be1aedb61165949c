"""cuflash on JAX arrays: zero-copy through DLPack.

    python examples/jax_interop.py

JAX GPU arrays in the (B, N, H, D) layout become CuPy arrays over the same memory
(cupy.from_dlpack); cuflash reads them in place as (B, H, N, D) views; its results
come back as JAX arrays over CuPy's memory (jax.numpy.from_dlpack). The DLPack
exchange orders the work: CuPy's stream waits for JAX's writes before cuflash reads
the inputs, and JAX waits for cuflash's kernels before it reads the results.

This is eager code: it runs outside jax.jit, and the backward is an explicit call
(attention returns a vjp function) rather than jax.grad. The script checks forward
and backward against jax.nn.dot_product_attention, both measured against a float64
NumPy reference (cuflash.reference).
"""

from __future__ import annotations

import argparse
import os
import sys

import cuflash

if __name__ == "__main__":   # before the GPU check: --help works on any machine
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

try:
    cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
    import jax
    import jax.numpy as jnp
except RuntimeError as err:
    sys.exit(f"jax_interop.py: {err}")
except ImportError:
    sys.exit("jax_interop.py needs JAX with CUDA: pip install 'jax[cuda12]' (README, Interop)")

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402,F401  (bfloat16 for CuPy)
import numpy as np  # noqa: E402

from cuflash import reference  # noqa: E402

# JAX takes 75% of the GPU's memory when it first runs unless told not to; leave room
# for CuPy. (Read when JAX starts its GPU backend, on first use, not at import.)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def to_cupy(x):
    """A CuPy array over a JAX GPU array's memory (no copy)."""
    return cupy.from_dlpack(x)


def to_jax(x):
    """A JAX array over a CuPy array's memory (no copy)."""
    return jnp.from_dlpack(x)


def attention(q, k, v, causal=False):
    """cuflash attention of (B, N, H, D) JAX arrays.

    Returns out (B, N, H, D) and vjp(dout) -> (dq, dk, dv), all JAX arrays.
    """
    heads_first = (0, 2, 1, 3)  # (B, N, H, D) <-> (B, H, N, D)
    out, vjp = cuflash.attention_vjp(*(to_cupy(x).transpose(heads_first) for x in (q, k, v)), causal=causal)

    def backward(dout):
        grads = vjp(to_cupy(dout).transpose(heads_first))
        return tuple(to_jax(g).transpose(heads_first) for g in grads)  # JAX's transpose copies

    return to_jax(out).transpose(heads_first), backward


def jax_attention(q, k, v, causal=False):
    """JAX's own attention (its XLA version: matmul, float32 softmax, matmul)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def run(dtype=jnp.bfloat16, causal=True, shape=(2, 512, 8, 64), seed=0):
    """cuflash and jax.nn.dot_product_attention, both in `dtype`, against float64.

    Returns {"out" | "dq" | "dk" | "dv": (cuflash max error, JAX max error, max |reference|)}.
    """
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, dout = (jax.random.normal(key, shape, dtype=dtype) for key in keys)

    out, backward = attention(q, k, v, causal=causal)
    ours = (out,) + backward(dout)
    jax_out, jax_vjp = jax.vjp(lambda q, k, v: jax_attention(q, k, v, causal=causal), q, k, v)
    theirs = (jax_out,) + tuple(jax_vjp(dout))

    # float64 reference on (B, H, N, D), the layout cuflash.reference takes
    hq, hk, hv, hdo = (np.swapaxes(np.asarray(x, dtype=np.float64), 1, 2) for x in (q, k, v, dout))
    r_out, r_lse = reference.attention(hq, hk, hv, causal=causal, return_lse=True)
    refs = (r_out,) + tuple(reference.attention_backward(hdo, hq, hk, hv, r_out, r_lse, causal=causal))

    errors = {}
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, refs):
        r = np.swapaxes(r, 1, 2)
        a, b = (np.asarray(x, dtype=np.float64) for x in (a, b))
        errors[name] = (float(np.abs(a - r).max()), float(np.abs(b - r).max()), float(np.abs(r).max()))
    return errors


def main():
    try:
        jax.devices("gpu")
    except RuntimeError:
        sys.exit(f"jax_interop.py: JAX {jax.__version__} has no GPU backend; pip install 'jax[cuda12]'")
    q = jax.random.normal(jax.random.key(1), (2, 512, 8, 64), dtype=jnp.bfloat16)
    print(f"zero-copy: CuPy's view of q starts at JAX's buffer: {to_cupy(q).data.ptr == q.unsafe_buffer_pointer()}")
    results = {}
    for dtype in (jnp.bfloat16, jnp.float16):
        results[dtype] = errors = run(dtype)
        print(f"{jnp.dtype(dtype).name}, causal, B=2 N=512 H=8 D=64: max |error| against float64")
        for name, (ours, theirs, size) in errors.items():
            print(f"  {name:3s}  cuflash {ours:.2e}   jax.nn.dot_product_attention {theirs:.2e}   (max |value| {size:.2f})")
    return results


if __name__ == "__main__":
    main()
