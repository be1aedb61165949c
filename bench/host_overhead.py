"""Host time per call: how long cuflash's Python side takes to launch a forward and a
backward, against torch SDPA's, and where cuflash's time goes.

    python bench/host_overhead.py [--calls 2000] [--profile] [--adapter]

A call whose kernels finish sooner than the host can issue the next call is timed by
the benchmark (bench_attention.py, one synchronized call per sample) as host time plus
kernel time. This prints, per provider: microseconds of host time per call on small
inputs (cuflash's also with softcap, ALiBi and sinks), timed in batches of 100 calls with the GPU synchronized between them, and for the
benchmark's D = 128, N = 2048 forward, the synchronized per-call median next to the
back-to-back per-call time (kernels queued ahead, host time hidden). --profile adds a
cProfile listing of cuflash's calls. --adapter (with torch) adds cuflash.torch.attention's
forward and backward on the same memory, what each step of its way to the kernels costs
(the DLPack exchanges both ways, torch's current stream), and with --profile its listing.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402

try:
    cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
except RuntimeError as err:
    sys.exit(f"host_overhead.py: {err}")

import cupy  # noqa: E402

from bench_attention import median_ms, queued_ms  # noqa: I001  (this directory)


def host_us(fn, calls, batch=100):
    """Microseconds of host time per call: the median over batches of ``batch`` calls, the
    GPU synchronized between batches (untimed). A batch's launches stay well inside the
    driver's launch queue, so the host never waits for the GPU to make room in it, which
    would count GPU time as host time."""
    fn()
    cupy.cuda.Device().synchronize()
    per_call = []
    for _ in range(max(1, calls // batch)):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        per_call.append((time.perf_counter() - t0) / batch)
        cupy.cuda.Device().synchronize()
    return statistics.median(per_call) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--adapter", action="store_true", help="also cuflash.torch's calls and their parts")
    args = ap.parse_args()
    rng = cupy.random.default_rng(0)

    def draw(b, h, n, d):
        return [rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(4)]

    q, k, v, do = draw(1, 2, 128, 64)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    fwd = lambda: cuflash.attention(q, k, v, causal=True)  # noqa: E731
    bwd = lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=True)  # noqa: E731
    print(f"cuflash forward   host {host_us(fwd, args.calls):7.1f} us/call")
    print(f"cuflash backward  host {host_us(bwd, args.calls):7.1f} us/call")
    heads = rng.standard_normal(2, dtype=cupy.float32)   # one per head of (B, H) = (1, 2)
    for name, mods in (("softcap", dict(softcap=30.0)), ("alibi", dict(alibi_slopes=abs(heads))),
                       ("sinks", dict(sinks=heads))):
        mout, mlse = cuflash.attention(q, k, v, causal=True, return_lse=True, **mods)
        us = host_us(lambda: cuflash.attention(q, k, v, causal=True, **mods), args.calls)   # noqa: B023
        print(f"  with {name:8s} forward  host {us:7.1f} us/call")
        us = host_us(lambda: cuflash.attention_backward(do, q, k, v, mout, mlse, causal=True, **mods),   # noqa: B023
                     args.calls)
        print(f"  with {name:8s} backward host {us:7.1f} us/call")
    us = host_us(lambda: cupy.ascontiguousarray(cupy.broadcast_to(heads, (1, 2))), args.calls)
    print(f"  a per-head array broadcast and copied  {us:7.1f} us/call")
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            us = host_us(lambda: sdpa(tq, tk, tv, is_causal=True), args.calls)
        print(f"torch-flash fwd   host {us:7.1f} us/call")
    except ImportError:
        pass

    b, h, n, d = 8, 16, 2048, 128
    q2, k2, v2, _ = draw(b, h, n, d)
    big = lambda: cuflash.attention(q2, k2, v2)  # noqa: E731
    flops = 4 * b * h * n * n * d
    synced, queued = median_ms(big, [()], 30), queued_ms(big, calls=30, repeat=1)
    print(f"cuflash fwd D=128 N=2048: synchronized {synced * 1e3:6.1f} us ({flops / synced / 1e9:5.1f} TFLOP/s), "
          f"queued {queued * 1e3:6.1f} us ({flops / queued / 1e9:5.1f} TFLOP/s)")

    if args.profile:
        profile(lambda: (fwd(), bwd()), args.calls)
    if args.adapter:
        adapter(q, k, v, do, args)


def profile(fn, calls):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def wrap(t):
    """A CuPy array over a float16 tensor's memory, built from its pointer, shape and strides."""
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), t.untyped_storage().nbytes(), t, t.device.index)
    return cupy.ndarray(tuple(t.shape), cupy.float16, cupy.cuda.MemoryPointer(memory, 0),
                        strides=tuple(st * t.element_size() for st in t.stride()))


def adapter(q, k, v, do, args):
    """cuflash.torch.attention on q, k, v as torch tensors: its host time per call, forward and
    backward, and the parts of its way to the kernels, each alone."""
    import torch

    import cuflash.torch

    tq, tk, tv = (torch.from_dlpack(x).requires_grad_() for x in (q, k, v))
    tdo = torch.from_dlpack(do)
    tout = cuflash.torch.attention(tq, tk, tv, causal=True)
    handle = cuflash.torch._current_stream(tq.device)   # noqa: SLF001
    on_torch = cuflash.torch._on_torch(cupy, tq.device)   # noqa: SLF001  (the adapter's own context)
    with on_torch:
        parts = {
            "cuflash.torch.attention forward": lambda: cuflash.torch.attention(tq, tk, tv, causal=True),
            "cuflash.torch.attention backward": lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo,
                                                                            retain_graph=True),
            "cupy.from_dlpack(tensor)": lambda: cupy.from_dlpack(tq.detach()),
            "torch.from_dlpack(cupy array)": lambda: torch.from_dlpack(q),
            "torch.cuda.current_stream()": torch.cuda.current_stream,
            "its handle alone": lambda: cuflash.torch._current_stream(tq.device),   # noqa: SLF001
            "CuPy's wrapper of torch's stream": lambda: cuflash.torch._cupy_stream(   # noqa: SLF001
                cupy, handle, tq.device.index),
            "tensor.detach()": tq.detach,
            # the same memory exchanged without DLPack's stream handshake, for comparison
            "cupy.ndarray over the tensor's memory": lambda: wrap(tq),
            "torch.as_tensor(cupy array)": lambda: torch.as_tensor(q, device=tq.device),
        }
        for name, fn in parts.items():
            print(f"{name:40s} host {host_us(fn, args.calls):7.1f} us/call")
    if args.profile:
        profile(lambda: torch.autograd.grad(cuflash.torch.attention(tq, tk, tv, causal=True), (tq, tk, tv), tdo),
                args.calls)


if __name__ == "__main__":
    main()
