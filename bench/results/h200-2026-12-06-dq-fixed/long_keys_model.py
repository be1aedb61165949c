"""A NumPy model of fixed-point dq (kernels/prefill/dq_sums.cuh) at long sequences, over ROWS query
rows (the N x N matrix does not fit): python long_keys_model.py N D ROWS [kmul]. fp16 inputs; the
kernel's parts (ds rounded to fp16, 128 keys, float32) rounded to units of the row's bound, with
max|k| taken kmul times larger (another head's, as the bounds are the whole call's); against naive
(ds and dq rounded to fp16) and float32 sums, each against float64."""
import sys
import numpy as np
N, D, ROWS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
kmul = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0   # an outlier K/V head: max|k| x kmul elsewhere
rng = np.random.default_rng(1)
f16 = np.float16
q = rng.standard_normal((ROWS, D)).astype(f16).astype(np.float64)
k, v = (rng.standard_normal((N, D)).astype(f16).astype(np.float64) for _ in range(2))
do = rng.standard_normal((ROWS, D)).astype(f16).astype(np.float64)
scale = 1 / np.sqrt(D)
s = q @ k.T * scale
p = np.exp(s - s.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
out = p @ v
delta = (do * out).sum(1)
ds = p * (do @ v.T - delta[:, None])
ref = scale * ds @ k
# naive: ds in fp16 (from fp32), dq = fp16(scale * ds16 @ k) with fp32 accumulation
ds16 = ds.astype(np.float32).astype(f16).astype(np.float64)
naive = (scale * (ds16 @ k).astype(np.float32)).astype(f16).astype(np.float64)
# kernel: ds16 parts per 128 keys in fp32, fixed point with the global bound
kmax = np.abs(k).max() * kmul
bound = kmax * (np.sqrt((do * do).sum(1)) * np.sqrt((v * v).sum(1).max()) + np.abs(delta))
e = np.clip(30 - (np.floor(np.log2(bound)).astype(int) + 1), -99, 126)
unit = 2.0 ** e
acc = np.zeros((ROWS, D), np.int64); acc32 = np.zeros((ROWS, D), np.float32)
B = 128
for b in range(N // B):
    part = (ds16[:, b*B:(b+1)*B] @ k[b*B:(b+1)*B]).astype(np.float32)
    acc += np.rint(part.astype(np.float64) * unit[:, None]).astype(np.int64)
    acc32 += part
fixed = ((scale * acc.astype(np.float32) / unit[:, None]).astype(np.float32)).astype(f16).astype(np.float64)
flt = (scale * acc32).astype(f16).astype(np.float64)
err = lambda x: np.abs(x - ref).max()
print(f"N={N} D={D} kmul={kmul}: |dq|max {np.abs(ref).max():.3g}  naive {err(naive):.3g}  float32 sums {err(flt):.3g}  "
      f"fixed {err(fixed):.3g}  fixed/naive {err(fixed)/err(naive):.2f}  max|sum| 2^{np.log2(np.abs(acc).max()):.1f}")
