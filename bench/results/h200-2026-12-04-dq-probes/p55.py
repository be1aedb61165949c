"""Where the dk/dv pass that adds dq up spends its time: variants by -DCUFLASH_PROBE (0 all, 1 no adds at L2,
2 no exchange either, 3 no dq product either)."""
import sys, os
variant = int(sys.argv[1])
from cuflash import _compile
base = _compile._common_options
_compile._common_options = lambda: base() + (f"-DCUFLASH_PROBE={variant}",)
assert variant in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
import cupy, numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba
import cuflash


def time_bwd(data, causal, det, repeat=10):
    saved = [(q, k, v, do) + cuflash.attention(q, k, v, causal=causal, return_lse=True) for q, k, v, do in data]
    return ba.median_ms(lambda q, k, v, do, out, lse: cuflash.attention_backward(
        do, q, k, v, out, lse, causal=causal, deterministic=det), saved, repeat)


for causal in (False, True):   # agreement with the deterministic gradients
    q, k, v, do = ba.make_inputs(1, 8, 3000, 64, "float16", sets=1)[0]
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    a = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
    b = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
    print(f"v{variant} c{causal:d} rel to det", ["%.1e" % float(cupy.abs(x.astype(cupy.float32) - y.astype(cupy.float32)).max()
                                          / cupy.abs(y.astype(cupy.float32)).max()) for x, y in zip(b, a)], flush=True)
for n in (4096, 16384):
    b, h, d = 16384 // n, 32, 64
    data = ba.make_inputs(b, h, n, d, "float16")
    for causal in (False, True):
        flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
        res = {}
        for rnd in range(2):
            for name, det in (("det", True), ("any", False)):
                res.setdefault(name, []).append(time_bwd(data, causal, det))
            res.setdefault("cudnn", []).append(ba.time_torch(ba.TORCH_BACKENDS["torch-cudnn"], data, causal, "bwd", 10))
        m = {k: float(np.median(v)) for k, v in res.items()}
        print(f"v{variant} D64 N{n:5d} c{causal:d} ms: cudnn {m['cudnn']:.2f} det {m['det']:.2f} any {m['any']:.2f} | "
              f"any/det speed {m['det'] / m['any']:.2f}, any/cudnn {m['cudnn'] / m['any']:.2f}", flush=True)
    del data
    ba.free()
