"""deterministic=False against the deterministic default, cuDNN and FA2, at the grid's shapes
(batch 16384 / N, heads 2048 / D): python p61.py check|speed|san [head dims, comma-separated] [lengths, comma-separated]."""
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba  # noqa: E402
import cuflash  # noqa: E402


def time_bwd(data, causal, det, repeat=10):
    saved = [(q, k, v, do) + cuflash.attention(q, k, v, causal=causal, return_lse=True) for q, k, v, do in data]
    return ba.median_ms(lambda q, k, v, do, out, lse: cuflash.attention_backward(
        do, q, k, v, out, lse, causal=causal, deterministic=det), saved, repeat)


mode = sys.argv[1]
dims = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128]
lengths = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [2048, 4096, 8192, 16384]
if mode == "san":
    for d in dims:
        for shape, causal in (((1, 2, 2064, d), True), ((2, 2, 1024, d), False)):
            q, k, v, do = ba.make_inputs(*shape, "float16", sets=1)[0]
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
    print("san done")
    sys.exit()
for d in dims:
    for dt in ("float16", "bfloat16"):
        for n in lengths if mode == "speed" else (4096,):
            b, h = 16384 // n, 2048 // d
            data = ba.make_inputs(b, h, n, d, dt, sets=2 if mode == "speed" else 1)
            for causal in (False, True):
                if mode == "check":
                    q, k, v, do = data[0]
                    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                    a = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
                    g1 = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
                    g2 = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
                    rel = [float(cupy.abs(x.astype(cupy.float32) - y.astype(cupy.float32)).max()
                                 / cupy.abs(y.astype(cupy.float32)).max()) for x, y in zip(g1, a)]
                    same = [bool(cupy.array_equal(x.view(cupy.uint16), y.view(cupy.uint16))) for x, y in zip(g1, g2)]
                    print(dt, "D", d, "causal", causal, "rel to deterministic", ["%.1e" % r for r in rel],
                          "repeat-equal", same, flush=True)
                    continue
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                res = {}
                for _ in range(2):
                    for name, det in (("det", True), ("any", False)):
                        res.setdefault(name, []).append(flops / time_bwd(data, causal, det) / 1e9)
                    for name in ("torch-cudnn", "torch-flash"):
                        ms = ba.time_torch(ba.TORCH_BACKENDS[name], data, causal, "bwd", 10)
                        res.setdefault(name, []).append(flops / ms / 1e9)
                m = {k: float(np.median(v)) for k, v in res.items()}
                print(f"{dt} D{d} N{n:6d} c{causal:d} cudnn {m['torch-cudnn']:.0f} fa2 {m['torch-flash']:.0f} | "
                      f"det {m['det']:.0f} ({m['det'] / m['torch-cudnn']:.2f}) any {m['any']:.0f} "
                      f"({m['any'] / m['torch-cudnn']:.2f}) any/det {m['any'] / m['det']:.2f}", flush=True)
            del data
            ba.free()
print("p61", mode, "done")
