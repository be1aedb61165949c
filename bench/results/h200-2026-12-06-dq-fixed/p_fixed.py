"""The deterministic backward at head dims 64, 128 and 256 with dq added up in fixed point
(branch d256-fixed, bench/NOTES.md v37, v38) against the same tree's dq pass (the default before), dq in
float32 in any order (deterministic=False) and cuDNN, in one process, rounds in turn; and
whether the fixed point repeats to the bit. python p_fixed.py [dtypes] [lengths] [head dims];
env ROUNDS (3), REPS (10)."""
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba  # noqa: E402
import cuflash  # noqa: E402
from cuflash import _dispatch, _plans  # noqa: E402

TILES = _dispatch.sm90_bwd_tiles


def variant(name):
    """fixed: the new default; pass: the dq pass (no adds); any: float32 sums."""
    _plans.clear()
    if name == "pass":
        _dispatch.sm90_bwd_tiles = lambda dt, hd, queries, deterministic, adds: TILES(dt, hd, queries, deterministic,
                                                                                        False)
    else:
        _dispatch.sm90_bwd_tiles = TILES
    return name != "any"   # deterministic


REPS, ROUNDS = int(os.environ.get("REPS", 10)), int(os.environ.get("ROUNDS", 3))
dtypes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["float16", "bfloat16"]
lengths = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [2048, 4096, 8192, 16384]
head_dims = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [64, 128, 256]
for D, dt in ((D, dt) for D in head_dims for dt in dtypes):
    for n in lengths:
        b, h = 16384 // n, 2048 // D
        data = ba.make_inputs(b, h, n, D, dt)
        for causal in (False, True):
            flops = 2.5 * 4 * b * h * n * n * D / (2 if causal else 1)
            q, k, v, do = data[0]
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            grads = {}
            for name in ("fixed", "pass", "any"):
                det = variant(name)
                grads[name] = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=det)
            variant("fixed")
            plan, _ = _plans.backward(do, q, k, v, out, lse, causal, None, None)
            again = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
            repeats = all(bool(cupy.array_equal(a.view(cupy.uint16), c.view(cupy.uint16)))
                          for a, c in zip(grads["fixed"], again))
            top = float(cupy.abs(grads["pass"][0].astype(cupy.float32)).max())
            diff = {m: float(cupy.abs(grads[m][0].astype(cupy.float32) - grads["pass"][0].astype(cupy.float32)).max())
                    / top for m in ("fixed", "any")}
            del grads, again
            res = {}
            for rnd in range(ROUNDS):
                order = ["fixed", "pass", "any"]
                order = order[rnd % 3:] + order[:rnd % 3]
                for name in order:
                    det = variant(name)
                    res.setdefault(name, []).append(
                        flops / ba.time_attention(cuflash, data, causal, "bwd", REPS, deterministic=det) / 1e9)
                res.setdefault("cudnn", []).append(
                    flops / ba.time_torch(ba.TORCH_BACKENDS["torch-cudnn"], data, causal, "bwd", REPS) / 1e9)
            variant("fixed")
            m = {k_: float(np.median(v_)) for k_, v_ in res.items()}
            print(f"{dt[:4]} D{D} N{n:5d} c{int(causal)} cudnn {m['cudnn']:.0f} | "
                  + " ".join(f"{k_} {m[k_]:.0f} ({m[k_] / m['cudnn']:.3f})" for k_ in ("fixed", "pass", "any"))
                  + f" | fixed/pass {m['fixed'] / m['pass']:.3f} | fixed plan {plan.launches.dq_fixed}"
                  f" repeats {repeats} | dq vs pass: fixed {diff['fixed']:.1e} any {diff['any']:.1e}", flush=True)
        del data, q, k, v, do, out, lse
        ba.free()
