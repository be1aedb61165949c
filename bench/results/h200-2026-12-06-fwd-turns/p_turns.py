"""The loading-warpgroup forward's schedules (branch fwd-turns, bench/NOTES.md v37): turns at the
exponentials, with or without block i-1's p v under block i's softmax, at 128 or 176 keys,
against the default and cuDNN in the same process, rounds taken in turn.
python p_turns.py [dtypes] [head dims] [lengths]; env ROUNDS (3), REPS (10)."""
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba  # noqa: E402
import cuflash  # noqa: E402
from cuflash import _dispatch, _plans, _tiles  # noqa: E402

W = _tiles.Sm90WsFwdTiles
DEFAULT = _dispatch.hopper_fwd_tiles
# name: tiles, or None for the default; "e": turns at the exponentials, "n": none; "s": each
# warpgroup's steps in turn (cuDNN's order), "o": the last p v under the softmax
VARIANTS = {
    128: {"def": None, "e128s": W(128, 128, 2, turns="exponentials", overlap=False),
          "e128o": W(128, 128, 2, turns="exponentials"), "n128s": W(128, 128, 2, overlap=False),
          "e176s": W(128, 176, 2, turns="exponentials", overlap=False, q_buffers=1),
          "e176o": W(128, 176, 2, turns="exponentials", q_buffers=1),
          "e128s3": W(128, 128, 3, turns="exponentials", overlap=False, q_buffers=1)},
    64: {"def": None, "e128s": W(64, 128, 2, turns="exponentials", overlap=False),
         "e128o": W(64, 128, 2, turns="exponentials")},
    256: {"def": None, "e80s": W(256, 80, 2, turns="exponentials", overlap=False, q_buffers=1),
          "n80s": W(256, 80, 2, overlap=False, q_buffers=1),
          "e64s": W(256, 64, 2, turns="exponentials", overlap=False, q_buffers=1)},
}


def use(tiles):
    _plans.clear()
    _dispatch.hopper_fwd_tiles = DEFAULT if tiles is None else (lambda *a: tiles)   # (through maps: _dispatch)


def maxdiff(a, b):
    return float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())


REPS, ROUNDS = int(os.environ.get("REPS", 10)), int(os.environ.get("ROUNDS", 3))
dtypes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["float16", "bfloat16"]
dims = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64, 256]
lengths = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [2048, 8192, 16384]
for dt in dtypes:
    for d in dims:
        variants = VARIANTS[d]
        for n in lengths:
            b, h = 16384 // n, 2048 // d
            data = ba.make_inputs(b, h, n, d, dt)
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                q, k, v, do = data[0]
                use(None)
                ref = cuflash.attention(q, k, v, causal=causal)
                bad = []
                for name, tiles in variants.items():
                    use(tiles)
                    diff = maxdiff(cuflash.attention(q, k, v, causal=causal), ref)
                    if not diff <= 0.02:
                        bad.append(f"{name} DIFFERS {diff:.3g}")
                del ref
                res = {}
                for rnd in range(ROUNDS):
                    order = list(variants.items())
                    order = order[rnd % len(order):] + order[:rnd % len(order)]
                    for name, tiles in order:
                        use(tiles)
                        res.setdefault(name, []).append(
                            flops / ba.time_attention(cuflash, data, causal, "fwd", REPS) / 1e9)
                    res.setdefault("cudnn", []).append(
                        flops / ba.time_torch(ba.TORCH_BACKENDS["torch-cudnn"], data, causal, "fwd", REPS) / 1e9)
                m = {k_: float(np.median(v_)) for k_, v_ in res.items()}
                print(f"{dt[:4]} D{d} N{n:5d} c{int(causal)} cudnn {m['cudnn']:.0f} | "
                      + " ".join(f"{k_} {m[k_]:.0f} ({m[k_] / m['cudnn']:.3f})" for k_ in variants)
                      + " " + " ".join(bad), flush=True)
            del data, q, k, v, do
            ba.free()
use(None)
