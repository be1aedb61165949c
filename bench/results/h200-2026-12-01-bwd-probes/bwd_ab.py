"""Hopper backward variants (dq mode, dk/dv kernel): correctness against the current kernels, then speed."""
import sys, os, dataclasses
import cupy, numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import bench_attention as ba
import cuflash
from cuflash import _dispatch, _plans
torch = ba.torch
default = _dispatch.sm90_bwd_tiles
BASE = {64: {"dkdv_ws_stages": 0, "dq_ws_stages": 0}, 128: {"dkdv_ws_stages": 0, "dq_ws_stages": 0}}   # a20e9fc's


def use(change):
    def pick(dt, hd, *args):
        t = default(dt, hd, *args)
        if t is None or t.wide_dkdv:
            return t
        return dataclasses.replace(t, **{**BASE.get(hd, {}), **change.get(hd, {})})
    _dispatch.sm90_bwd_tiles = pick
    _plans.clear()


VARIANTS = {   # name: per head dim tile changes
    "base": {},
    "kv": {128: {"dkdv_ws_stages": 2}, 64: {"dkdv_ws_stages": 4}},
    "kv+q2": {128: {"dkdv_ws_stages": 2, "dq_ws_stages": 2}, 64: {"dkdv_ws_stages": 4, "dq_ws_stages": 2}},
    "kv+q3": {128: {"dkdv_ws_stages": 2, "dq_ws_stages": 3}, 64: {"dkdv_ws_stages": 4, "dq_ws_stages": 3}},
    "kv+q4s64": {64: {"dkdv_ws_stages": 4, "dq_ws_stages": 4, "dq_step": 64}},
}


def grads(variant, q, k, v, do, **kw):
    use(VARIANTS[variant])
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    return cuflash.attention_backward(do, q, k, v, out, lse, **kw)


def rel(a, b):
    a, b = a.astype(cupy.float32), b.astype(cupy.float32)
    return float(cupy.abs(a - b).max() / max(float(cupy.abs(b).max()), 1e-30))


MODE = sys.argv[1] if len(sys.argv) > 1 else "all"
if MODE in ("all", "check"):
    rng = cupy.random.default_rng(7)
    configs = [
        dict(qs=(2, 4, 300, 128), ks=(2, 4, 300, 128)),
        dict(qs=(1, 8, 1000, 64), ks=(1, 8, 777, 64), causal=True),
        dict(qs=(1, 8, 700, 128), ks=(1, 8, 1300, 128), causal=True),
        dict(qs=(2, 4, 513, 128), ks=(2, 4, 1500, 128), window=(100, 50)),
        dict(qs=(2, 2, 4, 400, 128), ks=(2, 2, 1, 400, 128), causal=True),
        dict(qs=(2, 8, 640, 64), ks=(2, 1, 640, 64)),
        dict(qs=(2, 4, 333, 96), ks=(2, 4, 555, 96), causal=True),
        dict(qs=(3, 4, 1, 128), ks=(3, 4, 5000, 128)),
        dict(qs=(1, 16, 4096, 128), ks=(1, 16, 4096, 128), causal=True, big=True),
    ]
    for dt in ("float16",):
        for c in configs:
            c = dict(c)
            qs, ks, big = c.pop("qs"), c.pop("ks"), c.pop("big", False)
            q = (rng.standard_normal(qs, dtype=cupy.float32) * (4 if big else 1)).astype(dt)
            k, v = (rng.standard_normal(ks, dtype=cupy.float32).astype(dt) for _ in range(2))
            do = rng.standard_normal(qs[:-1] + (ks[-1],), dtype=cupy.float32).astype(dt)
            ref = grads("base", q, k, v, do, **c)
            line = [f"q{qs} k{ks} {c}"]
            for name in VARIANTS:
                if name == "base":
                    continue
                g = grads(name, q, k, v, do, **c)
                r = [rel(a, b) for a, b in zip(g, ref)]
                line.append(f"{name} {max(r):.1e}")
                if name == "kv+q4s64" and qs[-1] != 64:
                    line.pop()
            print(" | ".join(line), flush=True)

if MODE in ("all", "speed"):
    for d in (64, 128):
        for n in (512, 1024, 2048, 4096, 8192, 16384):
            b, h = 16384 // n, 2048 // d
            data = ba.make_inputs(b, h, n, d, "float16")
            for causal in (False, True):
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                names = ["base", "kv", "kv+q2", "kv+q3"] + (["kv+q4s64"] if d == 64 else [])
                res = {}
                for rnd in range(2):
                    for name in names:
                        use(VARIANTS[name])
                        ms = ba.time_attention(cuflash, data, causal, "bwd", 10)
                        res.setdefault(name, []).append(flops / ms / 1e9)
                    ms = ba.time_torch(ba.TORCH_BACKENDS["torch-cudnn"], data, causal, "bwd", 10)
                    res.setdefault("cudnn", []).append(flops / ms / 1e9)
                m = {k: float(np.median(v)) for k, v in res.items()}
                print(f"D{d} N{n:5d} c{causal:d} cudnn {m['cudnn']:.0f} | " +
                      " ".join(f"{k} {m[k]:.0f} ({m[k] / m['cudnn']:.2f})" for k in names), flush=True)
            del data
            ba.free()
