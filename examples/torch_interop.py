"""cuflash on PyTorch tensors: zero-copy through DLPack, on torch's current stream.

    python examples/torch_interop.py

torch CUDA tensors in the (B, N, H, D) layout of most models become CuPy arrays over
the same memory (cupy.from_dlpack); cuflash reads them in place as (B, H, N, D) views;
its kernels run on torch's current CUDA stream; its results come back as torch
tensors over CuPy's memory (torch.from_dlpack). FlashAttention wraps this in a
torch.autograd.Function, so loss.backward() works. The script checks forward and
backward against torch.nn.functional.scaled_dot_product_attention, both measured
against SDPA in float64.
"""

from __future__ import annotations

import argparse
import sys

import cuflash

if __name__ == "__main__":   # before the GPU check: --help works on any machine
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

try:
    cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
    import torch
    import torch.nn.functional as F
except RuntimeError as err:
    sys.exit(f"torch_interop.py: {err}")
except ImportError:
    sys.exit("torch_interop.py needs PyTorch with CUDA: pip install torch (README, Interop)")

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402,F401  (bfloat16 for CuPy)


class _TorchStream:
    """A torch stream under the CUDA stream protocol: (version 0, its cudaStream_t)."""

    def __init__(self, stream):
        self.stream = stream  # CuPy's wrapper keeps this, and so the torch stream, alive

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


def cupy_stream(device=None):
    """torch's current stream as a CuPy stream: the same cudaStream_t, nothing created.

    Under ``with cupy_stream():`` CuPy (and so cuflash) launches on it, ordered after
    the torch work already queued there and before the torch work queued next.
    """
    stream = torch.cuda.current_stream(device)
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
        return cupy.cuda.Stream.from_external(_TorchStream(stream))
    return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def to_cupy(tensor):
    """A CuPy array over a torch CUDA tensor's memory (no copy)."""
    return cupy.from_dlpack(tensor.detach())


def to_torch(array):
    """A torch tensor over a CuPy array's memory (no copy)."""
    return torch.from_dlpack(array)


def _heads_first(x):  # CuPy (B, N, H, D) -> (B, H, N, D), a strided view
    return x.transpose(0, 2, 1, 3)


class FlashAttention(torch.autograd.Function):
    """cuflash attention of (B, N, H, D) torch tensors, differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        with cupy.cuda.Device(q.device.index), cupy_stream(q.device):
            out, ctx.vjp = cuflash.attention_vjp(*(_heads_first(to_cupy(t)) for t in (q, k, v)), causal=causal)
            return to_torch(out).transpose(1, 2)  # (B, N, H, D) view of cuflash's output

    @staticmethod
    def backward(ctx, dout):
        with cupy.cuda.Device(dout.device.index), cupy_stream(dout.device):
            dq, dk, dv = ctx.vjp(_heads_first(to_cupy(dout.contiguous())))
            return to_torch(dq).transpose(1, 2), to_torch(dk).transpose(1, 2), to_torch(dv).transpose(1, 2), None


def flash_attention(q, k, v, causal=False):
    """softmax(q k^T / sqrt(D) + mask) v for (B, N, H, D) torch tensors, by cuflash."""
    return FlashAttention.apply(q, k, v, causal)


def sdpa(q, k, v, causal=False):
    """torch's own attention on the same (B, N, H, D) layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def forward_backward(attention, inputs, dout, causal):
    """[out, dq, dk, dv] of `attention` through autograd."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = attention(*leaves, causal=causal)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


def run(dtype=torch.bfloat16, causal=True, shape=(2, 512, 8, 64), seed=0):
    """cuflash and torch SDPA, both in `dtype`, against SDPA in float64.

    Returns {"out" | "dq" | "dk" | "dv": (cuflash max error, SDPA max error, max |reference|)}.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for _ in range(4))
    ours = forward_backward(flash_attention, (q, k, v), dout, causal)
    theirs = forward_backward(sdpa, (q, k, v), dout, causal)
    refs = forward_backward(sdpa, [x.double() for x in (q, k, v)], dout.double(), causal)
    return {
        name: ((a.double() - r).abs().max().item(), (b.double() - r).abs().max().item(), r.abs().max().item())
        for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, refs)
    }


def main():
    if not torch.cuda.is_available():
        sys.exit(f"torch_interop.py: PyTorch {torch.__version__} has no CUDA; install a CUDA build (pip install torch)")
    q = torch.randn(2, 512, 8, 64, device="cuda", dtype=torch.bfloat16)
    print(f"zero-copy: CuPy's view of q starts at q.data_ptr(): {to_cupy(q).data.ptr == q.data_ptr()}")
    results = {}
    for dtype in (torch.bfloat16, torch.float16):
        results[dtype] = errors = run(dtype)
        print(f"{dtype}, causal, B=2 N=512 H=8 D=64: max |error| against float64")
        for name, (ours, theirs, size) in errors.items():
            print(f"  {name:3s}  cuflash {ours:.2e}   torch SDPA {theirs:.2e}   (max |value| {size:.2f})")
    return results


if __name__ == "__main__":
    main()
