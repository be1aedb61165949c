"""Score and mask functions for cuflash, one per common attention variant (docs/examples.md).

Each factory returns a plain Python function in cuflash's form: ``score_mod(score, *idx)`` or
``mask_mod(*idx)``, with ``idx`` one index per batch dim, then ``q_idx`` and ``kv_idx`` (for
(B, H, N, D) inputs: ``b, h, q_idx, kv_idx``). Arrays the functions read are captured from the
factory's arguments. Run them with ``cuflash.reference.attention(q, k, v, score_mod=...,
mask_mod=...)``; ``python examples/score_functions.py`` runs each on small random inputs and
prints its block sparsity.
"""

from __future__ import annotations

import numpy as np

import cuflash


def causal(offset: int = 0):
    """Row i sees keys j <= i + offset (``causal=True`` is offset Nk - Nq)."""
    def mask_mod(*idx):
        return idx[-1] <= idx[-2] + offset
    return mask_mod


def sliding_window(left: int, offset: int = 0):
    """Causal, and at most ``left`` keys back (``window=(left, 0)`` with ``causal=True``)."""
    def mask_mod(*idx):
        q, k = idx[-2] + offset, idx[-1]
        return (k <= q) & (k >= q - left)
    return mask_mod


def sliding_window_with_global_tokens(left: int, num_global: int):
    """Causal sliding window of ``left`` keys back, plus the first ``num_global`` keys, which
    every row sees (Longformer's and BigBird's global tokens, attention sinks' first tokens)."""
    def mask_mod(*idx):
        q, k = idx[-2], idx[-1]
        return (k <= q) & ((k >= q - left) | (k < num_global))
    return mask_mod


def prefix_lm(prefix_lengths):
    """Per batch entry b: its first ``prefix_lengths[b]`` positions see one another in both
    directions; the rest is causal (T5's and PaliGemma's prefix-LM). ``prefix_lengths``: an
    int array (NumPy or CuPy, as the call's inputs), one per entry of the first batch dim."""
    def mask_mod(b, *idx):
        q, k = idx[-2], idx[-1]
        return (k <= q) | (k < prefix_lengths[b])
    return mask_mod


def document(doc_ids, causal: bool = True):
    """Packed training: ``doc_ids[b, i]`` is the document of position i of entry b; a row sees
    the keys of its own document (and, ``causal``, none after it). An int array."""
    def mask_mod(b, *idx):
        q, k = idx[-2], idx[-1]
        same = doc_ids[b, q] == doc_ids[b, k]
        return same & (k <= q) if causal else same
    return mask_mod


def softcap(cap: float):
    """Gemma 2's and Grok's cap: ``cap * tanh(score / cap)`` (the keyword ``softcap=cap``)."""
    def score_mod(score, *idx):
        return cap * cuflash.tanh(score / cap)
    return score_mod


def alibi(slopes, offset: int = 0):
    """ALiBi: ``score - slopes[h] * |i + offset - j|``, ``slopes`` one per head, heads the last
    batch dim, float32 (the keyword ``alibi_slopes`` is offset Nk - Nq)."""
    def score_mod(score, *idx):
        h, q, k = idx[-3], idx[-2], idx[-1]
        return score - slopes[h] * abs(q + offset - k)
    return score_mod


def relative_position(table):
    """T5-style learned relative position bias: ``score + table[h, clamp(j - i) + R]`` with
    ``table`` of shape (H, 2R + 1), float32 or 16-bit, distances beyond R clamped to the
    table's ends."""
    reach = (table.shape[-1] - 1) // 2

    def score_mod(score, *idx):
        h, q, k = idx[-3], idx[-2], idx[-1]
        return score + table[h, cuflash.minimum(cuflash.maximum(k - q, -reach), reach) + reach]
    return score_mod


def gallery(batch: int, heads: int, n: int, seed: int = 0) -> dict:
    """Every example as ``name: {"score_mod": ..., "mask_mod": ...}`` (keywords of `attention`)
    for inputs of batch (batch, heads) and n positions, with random tables, slopes, prefixes
    and documents drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    slopes = (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
    docs = np.sort(rng.integers(0, max(1, n // 64), (batch, n)), axis=-1).astype(np.int32)
    table = rng.standard_normal((heads, 2 * 32 + 1)).astype(np.float32)
    return {
        "causal": {"mask_mod": causal()},
        "sliding window": {"mask_mod": sliding_window(n // 4)},
        "sliding window + global tokens": {"mask_mod": sliding_window_with_global_tokens(n // 8, 4)},
        "prefix-LM": {"mask_mod": prefix_lm(rng.integers(0, n + 1, batch).astype(np.int32))},
        "document": {"mask_mod": document(docs)},
        "softcap": {"score_mod": softcap(30.0)},
        "ALiBi": {"score_mod": alibi(slopes), "mask_mod": causal()},
        "relative position": {"score_mod": relative_position(table)},
    }


def main():
    import argparse

    from cuflash import reference

    ap = argparse.ArgumentParser(description="Run every example in cuflash.reference (NumPy, float64) and "
                                             "print its block sparsity.")
    ap.add_argument("--n", type=int, default=512, help="positions (default 512)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    batch, heads, n, d = 2, 4, args.n, 64
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal((batch, heads, n, d)) for _ in range(3))
    print(f"(B, H, N, D) = {(batch, heads, n, d)}; tiles of 128 x 128: empty / full / partial")
    for name, fns in gallery(batch, heads, n, args.seed).items():
        out = reference.attention(q, k, v, **fns)
        kinds = "-"
        if "mask_mod" in fns:
            blocks = reference.block_mask(fns["mask_mod"], (batch, heads), n, n).kinds
            counts = [int((blocks == kind).sum()) for kind in
                      (reference.BlockMask.EMPTY, reference.BlockMask.FULL, reference.BlockMask.PARTIAL)]
            kinds = " / ".join(map(str, counts))
        print(f"{name:32s} out {out.shape}, |out| max {np.abs(out).max():.3f}, tiles {kinds}")


if __name__ == "__main__":
    main()
