"""Small forward and backward calls over a representative set of specializations, for compute-sanitizer.

    compute-sanitizer --tool memcheck python tools/sanitize_cases.py
"""

import cupy
import ml_dtypes  # noqa: F401
import numpy as np

import cuflash

rng = np.random.default_rng(0)
for dtype in ("float16", "bfloat16", "float32"):
    for d in (64, 128, 256):
        for mask in ({}, {"causal": True}, {"window": (17, 5)}):
            q = cupy.asarray(rng.standard_normal((2, 67, d), dtype=np.float32)).astype(dtype)
            k = cupy.asarray(rng.standard_normal((2, 93, d), dtype=np.float32)).astype(dtype)
            v = cupy.asarray(rng.standard_normal((2, 93, d), dtype=np.float32)).astype(dtype)
            out, vjp = cuflash.attention_vjp(q, k, v, **mask)
            grads = vjp(cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32)).astype(dtype))
            cupy.cuda.Device().synchronize()
            finite = all(bool(cupy.isfinite(x.astype(np.float32)).all()) for x in (out,) + grads)
            print(dtype, d, mask, "finite:", finite)
