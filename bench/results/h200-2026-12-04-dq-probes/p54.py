"""deterministic=False at head dim 64 (the dk/dv pass adds dq up) against the dq pass and cuDNN."""
import sys, os
import cupy, numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba
import cuflash
torch = ba.torch


def time_bwd(data, causal, det, repeat=10):
    saved = [(q, k, v, do) + cuflash.attention(q, k, v, causal=causal, return_lse=True) for q, k, v, do in data]
    return ba.median_ms(lambda q, k, v, do, out, lse: cuflash.attention_backward(
        do, q, k, v, out, lse, causal=causal, deterministic=det), saved, repeat)


mode = sys.argv[1] if len(sys.argv) > 1 else "speed"
if mode == "check":   # agreement and repeatability at a benchmark shape
    for dt in ("float16", "bfloat16"):
        for causal in (False, True):
            data = ba.make_inputs(2, 32, 4096, 64, dt, sets=1)
            q, k, v, do = data[0]
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            a = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
            b = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
            c = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
            rel = [float(cupy.abs(x.astype(cupy.float32) - y.astype(cupy.float32)).max() /
                         cupy.abs(y.astype(cupy.float32)).max()) for x, y in zip(b, a)]
            same = [bool(cupy.array_equal(x.view(cupy.uint16), y.view(cupy.uint16))) for x, y in zip(b, c)]
            print(dt, causal, "rel to deterministic", ["%.1e" % r for r in rel], "repeat-equal", same, flush=True)
            del data
            ba.free()
    sys.exit()

dts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["float16", "bfloat16"]
for dt in dts:
    for n in (2048, 4096, 8192, 16384):
        b, h, d = 16384 // n, 32, 64
        data = ba.make_inputs(b, h, n, d, dt)
        for causal in (False, True):
            flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
            res = {}
            for rnd in range(2):
                for name, det in (("det", True), ("any", False)):
                    res.setdefault(name, []).append(flops / time_bwd(data, causal, det) / 1e9)
                ms = ba.time_torch(ba.TORCH_BACKENDS["torch-cudnn"], data, causal, "bwd", 10)
                res.setdefault("cudnn", []).append(flops / ms / 1e9)
                ms = ba.time_torch(ba.TORCH_BACKENDS["torch-flash"], data, causal, "bwd", 10)
                res.setdefault("fa2", []).append(flops / ms / 1e9)
            m = {k: float(np.median(v)) for k, v in res.items()}
            print(f"{dt} D64 N{n:5d} c{causal:d} cudnn {m['cudnn']:.0f} fa2 {m['fa2']:.0f} | det {m['det']:.0f} "
                  f"({m['det'] / m['cudnn']:.2f}) any {m['any']:.0f} ({m['any'] / m['cudnn']:.2f}) "
                  f"any/det {m['any'] / m['det']:.2f}", flush=True)
        del data
        ba.free()
