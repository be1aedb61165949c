"""deterministic=False at head dim 256 (the wide dk/dv pass adding dq^T up; "ws": its form on a
loading warpgroup, three stages) against the deterministic default, cuDNN and FA2 at the grid's
shapes (batch 16384 / N, heads 2048 / D = 8): python p_d256.py check|speed|san [lengths]."""
import dataclasses
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba  # noqa: E402
import cuflash  # noqa: E402
from cuflash import _dispatch, _plans  # noqa: E402

D = 256
TILES_OF = _dispatch.sm90_bwd_tiles


def adds_on_loading_warpgroup(stages):
    """The tiles that add dq up forced onto attn_bwd_dkdv_wide_sm90_ws (0: the default's)."""
    def tiles(dt, hd, queries=2048, deterministic=True):
        t = TILES_OF(dt, hd, queries, deterministic)
        return dataclasses.replace(t, dkdv_ws_stages=stages) if stages and t.dkdv_adds_dq else t
    _dispatch.sm90_bwd_tiles = tiles
    _plans.clear()


def backward(q, k, v, do, out, lse, causal, variant):
    adds_on_loading_warpgroup(3 if variant == "ws" else 0)
    return cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=variant == "det")


def time_bwd(data, causal, variant, repeat=10):
    adds_on_loading_warpgroup(3 if variant == "ws" else 0)
    saved = [(q, k, v, do) + cuflash.attention(q, k, v, causal=causal, return_lse=True) for q, k, v, do in data]
    return ba.median_ms(lambda q, k, v, do, out, lse: cuflash.attention_backward(
        do, q, k, v, out, lse, causal=causal, deterministic=variant == "det"), saved, repeat)


mode = sys.argv[1]
lengths = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [2048, 4096, 8192, 16384]
if mode == "san":   # one call each: causal with k and v broadcast over 2 heads (2050 keys); unmasked
    for shape, kv_shape, causal in (((1, 2, 2048, D), (1, 1, 2050, D), True), ((1, 2, 2048, D), (1, 2, 2048, D), False)):
        q, do = (cupy.asarray(np.random.default_rng(1).standard_normal(shape), dtype=cupy.float16) for _ in range(2))
        k, v = (cupy.asarray(np.random.default_rng(2).standard_normal(kv_shape), dtype=cupy.float16) for _ in range(2))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        for variant in ("any", "ws"):
            backward(q, k, v, do, out, lse, causal, variant)
    cupy.cuda.Device().synchronize()
    print("san done")
    sys.exit()
for dt in ("float16", "bfloat16"):
    for n in lengths if mode == "speed" else (4096,):
        b, h = 16384 // n, 2048 // D
        data = ba.make_inputs(b, h, n, D, dt, sets=2 if mode == "speed" else 1)
        for causal in (False, True):
            if mode == "check":
                q, k, v, do = data[0]
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                a = backward(q, k, v, do, out, lse, causal, "det")
                for variant in ("any", "ws"):
                    g1 = backward(q, k, v, do, out, lse, causal, variant)
                    g2 = backward(q, k, v, do, out, lse, causal, variant)
                    rel = [float(cupy.abs(x.astype(cupy.float32) - y.astype(cupy.float32)).max()
                                 / cupy.abs(y.astype(cupy.float32)).max()) for x, y in zip(g1, a)]
                    same = [bool(cupy.array_equal(x.view(cupy.uint16), y.view(cupy.uint16))) for x, y in zip(g1, g2)]
                    print(dt, "D", D, "causal", causal, variant, "rel to deterministic", ["%.1e" % r for r in rel],
                          "repeat-equal", same, flush=True)
                continue
            flops = 2.5 * 4 * b * h * n * n * D / (2 if causal else 1)
            res = {}
            for _ in range(2):
                for variant in ("det", "any", "ws"):
                    res.setdefault(variant, []).append(flops / time_bwd(data, causal, variant) / 1e9)
                for name in ("torch-cudnn", "torch-flash"):
                    ms = ba.time_torch(ba.TORCH_BACKENDS[name], data, causal, "bwd", 10)
                    res.setdefault(name, []).append(flops / ms / 1e9)
            m = {k: float(np.median(v)) for k, v in res.items()}
            c = m["torch-cudnn"]
            print(f"{dt} D{D} N{n:6d} c{causal:d} cudnn {c:.0f} fa2 {m['torch-flash']:.0f} | det {m['det']:.0f} "
                  f"({m['det'] / c:.2f}) any {m['any']:.0f} ({m['any'] / c:.2f}) ws {m['ws']:.0f} ({m['ws'] / c:.2f}) "
                  f"any/det {m['any'] / m['det']:.2f} ws/det {m['ws'] / m['det']:.2f}", flush=True)
        del data
        ba.free()
print("p_d256", mode, "done")
