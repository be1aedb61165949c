"""One grid cell's backward, cuflash or cuDNN (SDPA), a few calls, for ncu: python pncu_bwd.py cuflash|cudnn N D [causal]."""
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import cupy  # noqa: E402

import bench_attention as ba  # noqa: E402
import cuflash  # noqa: E402

torch = ba.torch
who, n, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
causal = len(sys.argv) > 4 and sys.argv[4] == "1"
b, h = 16384 // n, 2048 // d
q, k, v, do = ba.make_inputs(b, h, n, d, "float16", sets=1)[0]
if who == "cuflash":
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    for _ in range(4):
        cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
else:
    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_() for x in (q, k, v))
    tdo = torch.from_dlpack(do)
    with ba.sdpa_kernel(ba.TORCH_BACKENDS["torch-cudnn"]):
        tout = ba.sdpa(tq, tk, tv, is_causal=causal)
        for _ in range(4):
            torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True)
cupy.cuda.Device().synchronize()
torch.cuda.synchronize()
print("done", who)
