"""A small attention model in pure CuPy, trained with hand-written gradients.

    python examples/train_attention.py [--steps 300]

The model: x -> (q, k, v) = x Wq, x Wk, x Wv split into heads -> causal
cuflash attention -> merge heads -> y = o Wo. The task (synthetic): predict,
at each position, the running mean of the inputs so far, projected by a
fixed random matrix; causal attention can represent it exactly. The loss is
the mean squared error. Every gradient is written by hand: the matmuls'
by the chain rule, the attention's by cuflash.attention_vjp. The attention
gradient is checked once against finite differences before training.
"""

from __future__ import annotations

import argparse
import sys

import cuflash


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    return ap.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()   # before the GPU check: --help works on any machine

try:
    cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
except RuntimeError as err:
    sys.exit(f"train_attention.py: {err}")

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

B, N, D_MODEL, HEADS = 8, 256, 128, 4
D_HEAD = D_MODEL // HEADS


def split_heads(x):  # (B, N, H*Dh) -> (B, H, N, Dh)
    return x.reshape(B, N, HEADS, D_HEAD).transpose(0, 2, 1, 3)


def merge_heads(x):  # (B, H, N, Dh) -> (B, N, H*Dh)
    return x.transpose(0, 2, 1, 3).reshape(B, N, D_MODEL)


def forward(params, x):
    """Returns the loss-free output and what the backward needs."""
    wq, wk, wv, wo = params
    q, k, v = (split_heads(x @ w).astype(cp.float32) for w in (wq, wk, wv))
    o, attn_vjp = cuflash.attention_vjp(q, k, v, causal=True)
    o = merge_heads(o)
    return o @ wo, (x, o, attn_vjp)


def backward(params, saved, dy):
    wq, wk, wv, wo = params
    x, o, attn_vjp = saved
    d_wo = o.reshape(-1, D_MODEL).T @ dy.reshape(-1, D_MODEL)
    dq, dk, dv = attn_vjp(split_heads(dy @ wo.T))
    xs = x.reshape(-1, D_MODEL)
    return [xs.T @ merge_heads(g).reshape(-1, D_MODEL) for g in (dq, dk, dv)] + [d_wo]


def check_attention_gradient(rng):
    """cuflash's attention gradient against central differences, in float32."""
    q, k, v = (cp.asarray(rng.standard_normal((1, 2, 40, 16)), dtype=cp.float32) for _ in range(3))
    w = cp.asarray(rng.standard_normal((1, 2, 40, 16)), dtype=cp.float32)  # loss = sum(out * w)
    _, vjp = cuflash.attention_vjp(q, k, v, causal=True)
    dq, _, _ = vjp(w)
    eps, worst = 1e-2, 0.0
    for idx in [(0, 0, 3, 1), (0, 1, 17, 5), (0, 0, 39, 15), (0, 1, 0, 0)]:
        qp, qm = q.copy(), q.copy()
        qp[idx] += eps
        qm[idx] -= eps
        fd = float(((cuflash.attention(qp, k, v, causal=True) - cuflash.attention(qm, k, v, causal=True)) * w).sum()) / (2 * eps)
        worst = max(worst, abs(fd - float(dq[idx])) / max(1e-3, abs(fd)))
    print(f"attention gradient vs finite differences: worst relative difference {worst:.1e}")
    assert worst < 1e-2, "attention gradient does not match finite differences"


def main(args):
    rng = np.random.default_rng(0)
    check_attention_gradient(rng)

    target_proj = cp.asarray(rng.standard_normal((D_MODEL, D_MODEL)) / np.sqrt(D_MODEL), dtype=cp.float32)
    params = [cp.asarray(rng.standard_normal((D_MODEL, D_MODEL)) / np.sqrt(D_MODEL), dtype=cp.float32) for _ in range(4)]
    adam_m = [cp.zeros_like(p) for p in params]
    adam_v = [cp.zeros_like(p) for p in params]
    counts = cp.arange(1, N + 1, dtype=cp.float32)[None, :, None]
    first = last = None
    for step in range(1, args.steps + 1):
        x = cp.asarray(rng.standard_normal((B, N, D_MODEL)), dtype=cp.float32)
        target = (cp.cumsum(x, axis=1) / counts) @ target_proj
        y, saved = forward(params, x)
        diff = y - target
        loss = float((diff * diff).mean())
        grads = backward(params, saved, 2 * diff / diff.size)
        for i, (p, g) in enumerate(zip(params, grads)):  # Adam
            adam_m[i] = 0.9 * adam_m[i] + 0.1 * g
            adam_v[i] = 0.999 * adam_v[i] + 0.001 * g * g
            p -= args.lr * (adam_m[i] / (1 - 0.9**step)) / (cp.sqrt(adam_v[i] / (1 - 0.999**step)) + 1e-8)
        first = loss if first is None else first
        last = loss
        if step == 1 or step % 50 == 0:
            print(f"step {step:4d}  loss {loss:.5f}")
    print(f"loss {first:.4f} -> {last:.4f}")
    assert last < 0.5 * first, "the loss did not go down"


if __name__ == "__main__":
    main(ARGS)
