"""Probe 10 (dq_bulk_fragments.patch): dq added up inside the head-dim-64 dK/dV pass, each warp
staging its 16 rows in the accumulator's order and adding them by one bulk reduction. Run from
the patched tree with CUFLASH_PROBE=10 in the environment (the kernels compile with
-DCUFLASH_PROBE=10 and the host picks the sums' order from it). Prints agreement with the
deterministic gradients, then the backward's time against the deterministic default and cuDNN."""
import os
import sys

assert os.environ.get("CUFLASH_PROBE") == "10"
from cuflash import _compile, _dispatch

base = _compile._common_options
_compile._common_options = lambda: base() + ("-DCUFLASH_PROBE=10",)
assert _dispatch.PROBE_FRAGMENTS
import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba  # noqa: E402
import cuflash  # noqa: E402
from cuflash import _plans  # noqa: E402


def time_bwd(data, causal, det, repeat=10):
    saved = [(q, k, v, do) + cuflash.attention(q, k, v, causal=causal, return_lse=True) for q, k, v, do in data]
    return ba.median_ms(lambda q, k, v, do, out, lse: cuflash.attention_backward(
        do, q, k, v, out, lse, causal=causal, deterministic=det), saved, repeat)


for shape, causal in (((1, 8, 3008, 64), False), ((1, 8, 3008, 64), True), ((2, 4, 4096, 64), True)):
    q, k, v, do = ba.make_inputs(shape[0], shape[1], shape[2], shape[3], "float16", sets=1)[0]
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    a = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
    b = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
    plan, _ = _plans.backward(do, q, k, v, out, lse, causal, None, None, None, False)
    assert plan.launches.dq_sums is not None and [r.threads for r in plan.launches.runs] == [128, 384], "no dq pass"
    print(f"{shape} causal={causal:d} rel to det", ["%.1e" % float(cupy.abs(x.astype(cupy.float32) - y.astype(cupy.float32)).max()
                                                 / cupy.abs(y.astype(cupy.float32)).max()) for x, y in zip(b, a)], flush=True)
for n in (2048, 4096, 16384):
    b, h, d = 16384 // n, 32, 64
    data = ba.make_inputs(b, h, n, d, "float16")
    for causal in (False, True):
        res = {}
        for rnd in range(3):   # in turns, each round starting at the next
            order = [("det", True), ("any", False), ("cudnn", None)]
            for name, det in order[rnd % 3:] + order[:rnd % 3]:
                ms = (ba.time_torch(ba.TORCH_BACKENDS["torch-cudnn"], data, causal, "bwd", 10) if det is None
                      else time_bwd(data, causal, det))
                res.setdefault(name, []).append(ms)
        m = {k: float(np.median(v)) for k, v in res.items()}
        print(f"D64 N{n:5d} c{causal:d} ms: cudnn {m['cudnn']:.2f} det {m['det']:.2f} any {m['any']:.2f} | "
              f"any/det speed {m['det'] / m['any']:.2f}, any/cudnn {m['cudnn'] / m['any']:.2f}, "
              f"det/cudnn {m['cudnn'] / m['det']:.2f}", flush=True)
    del data
    ba.free()
