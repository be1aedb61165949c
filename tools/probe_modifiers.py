"""Probe: the modified score path against the naive CuPy twin (max errors, cuflash / naive),
forward and backward, per kernel family. Prints one line per case; exit 1 on a NaN."""

import sys

import cupy
import ml_dtypes
import numpy as np

import cuflash
from cuflash import naive

rng = np.random.default_rng(0)
bad = 0
for dtype in (cupy.float16, ml_dtypes.bfloat16, cupy.float32):
    for d, n in ((64, 300), (128, 2048), (256, 500), (64, 4096)):
        for mods in ("softcap", "alibi", "sinks", "all"):
            q, k, v = (cupy.asarray(rng.standard_normal((1, 4, n, d), dtype=np.float32)).astype(dtype) for _ in range(3))
            kw = {}
            if mods in ("softcap", "all"):
                kw["softcap"] = 20.0
            if mods in ("alibi", "all"):
                kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.3, 4).astype(np.float32))
            if mods in ("sinks", "all"):
                kw["sinks"] = cupy.asarray(rng.normal(0, 2, 4).astype(np.float32))
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
            # float64 naive as the reference here
            q64, k64, v64 = (x.astype(cupy.float64) for x in (q, k, v))
            ref, ref_lse = naive.attention(q64, k64, v64, causal=True, return_lse=True, **kw)
            nv = naive.attention(q, k, v, causal=True, **kw)
            e_out = float(abs(out.astype(cupy.float64) - ref).max())
            e_naive = float(abs(nv.astype(cupy.float64) - ref).max())
            e_lse = float(abs(lse - ref_lse).max())
            dout = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32)).astype(dtype)
            g = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
            gr = naive.attention_backward(dout.astype(cupy.float64), q64, k64, v64, ref, ref_lse, causal=True, **kw)
            gn = naive.attention_backward(dout, q, k, v, nv, naive.attention(q, k, v, causal=True, return_lse=True, **kw)[1], causal=True, **kw)
            errs = []
            for name, a, r, b in zip(("dq", "dk", "dv", "dsinks"), g, gr, gn):
                if name == "dsinks":
                    r, b = r.sum(axis=0), b.sum(axis=0)
                ea = float(abs(a.astype(cupy.float64) - r).max())
                eb = float(abs(b.astype(cupy.float64) - r).max())
                errs.append(f"{name} {ea:.2e}/{eb:.2e}")
                bad += not np.isfinite(ea)
            print(f"{np.dtype(dtype).name:8} d{d} n{n} {mods:7}: out {e_out:.2e}/{e_naive:.2e} lse {e_lse:.1e}  " + "  ".join(errs), flush=True)
            bad += not np.isfinite(e_out)
sys.exit(1 if bad else 0)
