"""A small deterministic=False backward on the dk/dv pass that adds dq up, for compute-sanitizer."""
import cupy, numpy as np, cuflash
from cuflash import _dispatch, _plans
tiles = _dispatch.sm90_bwd_tiles("float16", 64, 4096, False)
_dispatch.sm90_bwd_tiles = lambda *a: tiles
rng = np.random.default_rng(0)
for qs, ks, kw in (((1, 2, 700, 64), (1, 2, 1300, 64), {"causal": True}), ((2, 1, 4, 400, 64), (2, 1, 1, 400, 64), {})):
    q = cupy.asarray(rng.standard_normal(qs), dtype=cupy.float16)
    k, v = (cupy.asarray(rng.standard_normal(ks), dtype=cupy.float16) for _ in range(2))
    do = cupy.asarray(rng.standard_normal(qs), dtype=cupy.float16)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    g = cuflash.attention_backward(do, q, k, v, out, lse, deterministic=False, **kw)
cupy.cuda.Device().synchronize()
print("san54 done")
