"""The dK/dV pass's stages at head dim 128 (2 or 3) for the deterministic backward and for
deterministic=False, against cuDNN and FA2, at the grid's shapes (batch 16384 / N, heads
2048 / D), the variants' order rotated each round: python p62.py speed|san [head dim] [lengths]
[variants, comma-separated, for san]."""
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba  # noqa: E402
import cuflash  # noqa: E402
from cuflash import _dispatch, _plans  # noqa: E402

ORIGINAL = _dispatch.sm90_bwd_tiles


def use_stages(stages):
    _dispatch.sm90_bwd_tiles = lambda *a: dataclasses.replace(ORIGINAL(*a), dkdv_ws_stages=stages)
    _plans.clear()


def time_bwd(data, causal, det, repeat=10):
    saved = [(q, k, v, do) + cuflash.attention(q, k, v, causal=causal, return_lse=True) for q, k, v, do in data]
    return ba.median_ms(lambda q, k, v, do, out, lse: cuflash.attention_backward(
        do, q, k, v, out, lse, causal=causal, deterministic=det), saved, repeat)


mode = sys.argv[1]
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
lengths = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1024, 2048, 4096, 8192, 16384]
VARIANTS = [("det2", True, 2), ("det3", True, 3), ("any2", False, 2), ("any3", False, 3)]
if mode == "san":
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else [name for name, _, _ in VARIANTS]
    for name, det, stages in (v for v in VARIANTS if v[0] in only):
        use_stages(stages)
        for shape, causal in (((1, 2, 2064, d), True), ((2, 2, 1024, d), False)):
            q, k, v, do = ba.make_inputs(*shape, "float16", sets=1)[0]
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=det)
    print("san done")
    sys.exit()
for dt in ("float16", "bfloat16"):
    for n in lengths:
        b, h = 16384 // n, 2048 // d
        data = ba.make_inputs(b, h, n, d, dt, sets=2)
        for causal in (False, True):
            flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
            res = {}
            for r in range(2):
                for name, det, stages in VARIANTS[r:] + VARIANTS[:r]:
                    use_stages(stages)
                    res.setdefault(name, []).append(flops / time_bwd(data, causal, det) / 1e9)
                for name in ("torch-cudnn", "torch-flash"):
                    ms = ba.time_torch(ba.TORCH_BACKENDS[name], data, causal, "bwd", 10)
                    res.setdefault(name, []).append(flops / ms / 1e9)
            m = {k: float(np.median(v)) for k, v in res.items()}
            c = m["torch-cudnn"]
            print(f"{dt} D{d} N{n:6d} c{causal:d} cudnn {c:.0f} fa2 {m['torch-flash']:.0f} | " + " ".join(
                f"{k} {m[k]:.0f} ({m[k] / c:.2f})" for k, _, _ in VARIANTS)
                + f" | det3/det2 {m['det3'] / m['det2']:.2f} any2/det2 {m['any2'] / m['det2']:.2f}"
                f" any3/det2 {m['any3'] / m['det2']:.2f}", flush=True)
        del data
        ba.free()
print("p62", mode, "done")
