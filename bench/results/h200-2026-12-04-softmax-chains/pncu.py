"""One grid cell's forward, cuflash or cuDNN (SDPA), a few calls, for ncu: python pncu.py cuflash|cudnn N D [causal]."""
import sys, os
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import cupy, cuflash
import bench_attention as ba
torch = ba.torch
who, n, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
causal = len(sys.argv) > 4 and sys.argv[4] == "1"
b, h = 16384 // n, 2048 // d
q, k, v, do = ba.make_inputs(b, h, n, d, "float16", sets=1)[0]
if who == "cuflash":
    for _ in range(4):
        cuflash.attention(q, k, v, causal=causal)
else:
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    with ba.sdpa_kernel(ba.TORCH_BACKENDS["torch-cudnn"]):
        for _ in range(4):
            ba.sdpa(tq, tk, tv, is_causal=causal)
cupy.cuda.Device().synchronize()
torch.cuda.synchronize()
print("done", who)
