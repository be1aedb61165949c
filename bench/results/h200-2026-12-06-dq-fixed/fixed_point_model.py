"""A NumPy model of dq added up in fixed point (kernels/prefill/dq_sums.cuh) beside float32 sums,
against float64: python fixed_point_model.py N D [score scale]. fp16 inputs; parts of 128-key
blocks in float32 (as the kernel's accumulators), each rounded to an integer in units of 2^-e_i
with e_i from fixed_dq_exponent."""
import sys

import numpy as np

rng = np.random.default_rng(0)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
qmul = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
f16 = np.float16
q = (rng.standard_normal((N, D)) * qmul).astype(f16).astype(np.float64)
k, v, do = (rng.standard_normal((N, D)).astype(f16).astype(np.float64) for _ in range(3))
scale = 1 / np.sqrt(D)
s = q @ k.T * scale
p = np.exp(s - s.max(1, keepdims=True))
p /= p.sum(1, keepdims=True)
delta = (do * (p @ v)).sum(1)
ds = p * (do @ v.T - delta[:, None])
dq_ref = scale * ds @ k


def above(x):   # the least b with x < 2^b (fixed_dq_exponent), for float32 x >= 0
    return (np.asarray(x, np.float32).view(np.uint32) >> 23).astype(np.int64) - 126


bound = (np.abs(k).max() * (np.sqrt((do * do).sum(1)) * np.sqrt((v * v).sum(1).max()) + np.abs(delta))).astype(np.float32)
e = np.clip(30 - above(bound), -126, 126)
unit = 2.0 ** e
acc32 = np.zeros((N, D), np.float32)
acci = np.zeros((N, D), np.int64)
for blk in range(N // 128):
    part = (ds[:, blk * 128:(blk + 1) * 128] @ k[blk * 128:(blk + 1) * 128]).astype(np.float32)   # unscaled
    acc32 = (acc32 + part).astype(np.float32)
    acci += np.rint(part.astype(np.float64) * unit[:, None]).astype(np.int64)
assert np.abs(acci).max() < 2**31, "a sum overflows int32"
dq_fixed = scale * acci.astype(np.float32).astype(np.float64) / unit[:, None]
dq_float = scale * acc32.astype(np.float64)
rounding = np.abs(dq_ref.astype(f16).astype(np.float64) - dq_ref).max()
print(f"N {N} D {D} scores x{qmul}: max|dq| {np.abs(dq_ref).max():.3g}; max error: fixed point "
      f"{np.abs(dq_fixed - dq_ref).max():.2e}, float32 sums {np.abs(dq_float - dq_ref).max():.2e}, "
      f"dq rounded to fp16 {rounding:.2e}; largest sum 2^{np.log2(np.abs(acci).max()):.1f}")
