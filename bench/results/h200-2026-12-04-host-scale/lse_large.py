"""lse at large logits (bench/NOTES.md v32 Next 5): the test_each_rows_max_at_every_key_position
inputs (row i's top score at key i, the scaled score TOP there) at TOP 320 and 1280, cuflash's lse,
the naive path's (float32 scores from cuBLAS), and FA2's (torch), each against float64, in
float32 ulps of the lse. Run from the repository root with PYTHONPATH=$PWD."""
import ml_dtypes  # noqa: F401  (numpy's bfloat16)
import numpy as np
import cupy
import torch
import cuflash
import cuflash.naive as naive

n = 2048
print("| dtype | D | top | cuflash | naive | FA2 | max lse |  (max |lse - lse64|, in ulps of float32 at the lse)")
for dtype in ("float16", "bfloat16"):
    for d in (64, 128, 256):
        for top in (320, 1280):
            rng = np.random.default_rng(60 + d)
            g = rng.standard_normal((1, n, d))
            hk = (g * np.sqrt(d) / np.linalg.norm(g, axis=-1, keepdims=True)).astype(dtype)
            hq = (top / np.sqrt(d) * hk.astype(np.float32)).astype(dtype)
            hv = rng.standard_normal((1, n, d)).astype(dtype)
            s = hq[0].astype(np.float64) @ hk[0].astype(np.float64).T / np.sqrt(d)
            m = s.max(axis=1)
            lse64 = m + np.log(np.exp(s - m[:, None]).sum(axis=1))
            q, k, v = (cupy.asarray(x).astype(dtype) for x in (hq, hk, hv))
            _, lse = cuflash.attention(q, k, v, return_lse=True)
            _, lse_n = naive.attention(q, k, v, return_lse=True)
            tdt = getattr(torch, dtype)
            tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).cuda().to(tdt)[None] for x in (hq, hk, hv))
            res = torch.ops.aten._scaled_dot_product_flash_attention(tq, tk, tv, 0.0, False, False)
            lse_f = res[1][0].float().cpu().numpy()
            ulp = np.spacing(np.float32(np.abs(lse64).max()))
            errs = [np.abs(cupy.asnumpy(x).astype(np.float64).reshape(-1) - lse64).max() / ulp
                    for x in (lse, lse_n)] + [np.abs(lse_f.reshape(-1) - lse64).max() / ulp]
            print(f"| {dtype} | {d} | {top} | " + " | ".join(f"{e:.1f}" for e in errs) + f" | {np.abs(lse64).max():.0f} |")
