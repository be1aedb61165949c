"""A small deterministic=False backward on probe 10, for compute-sanitizer (CUFLASH_PROBE=10)."""
import os
assert os.environ.get("CUFLASH_PROBE") == "10"
from cuflash import _compile
base = _compile._common_options
_compile._common_options = lambda: base() + ("-DCUFLASH_PROBE=10",)
import cupy, numpy as np, cuflash  # noqa: E402,E401
rng = np.random.default_rng(0)
for qs, ks, kw in (((1, 2, 2064, 64), (1, 2, 2100, 64), {"causal": True}), ((2, 1, 4, 2048, 64), (2, 1, 1, 2048, 64), {})):
    q = cupy.asarray(rng.standard_normal(qs), dtype=cupy.float16)
    k, v = (cupy.asarray(rng.standard_normal(ks), dtype=cupy.float16) for _ in range(2))
    do = cupy.asarray(rng.standard_normal(qs), dtype=cupy.float16)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    g = cuflash.attention_backward(do, q, k, v, out, lse, deterministic=False, **kw)
cupy.cuda.Device().synchronize()
print("san59 done")
