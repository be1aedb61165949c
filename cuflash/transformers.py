"""cuflash as an attention implementation of Hugging Face transformers (docs/contract.md,
"PyTorch adapter": "Hugging Face transformers").

``register(name)`` puts an attention function into transformers' ``AttentionInterface`` and a
mask function into its ``AttentionMaskInterface`` under ``name``; a model made with
``attn_implementation=name`` (or switched with ``model.set_attn_implementation(name)``) then runs
its attention through ``cuflash.torch.attention``.

The mask function does not build a mask: it reads the pattern transformers asks for (causal,
a sliding window, padding, sequences packed by their position ids) and hands the attention
function a `Mask`, cuflash's keywords for it and, for a padded or packed batch, which rows of
q, k and v each sequence owns (packed sequences, ``cu_seqlens``). A pattern it cannot read
raises ``NotImplementedError`` naming it; nothing is ignored.
"""

from __future__ import annotations

try:
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface
except ImportError as err:
    raise ImportError("cuflash.transformers needs transformers: pip install transformers") from err

import numpy as np
import torch

from . import torch as cuflash_torch

__all__ = ["DEFAULT_NAME", "Mask", "attention_forward", "attention_mask", "register"]

DEFAULT_NAME = "cufa"
# transformers treats a name holding one of these as its own implementation of that name
RESERVED = ("flash", "sdpa", "flex", "eager", "paged", "|")


def register(name: str = DEFAULT_NAME) -> str:
    """Registers cuflash's attention and mask functions in transformers under `name`; returns it."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    taken = [word for word in RESERVED if word in name]
    if taken:
        raise ValueError(f"name {name!r} holds {taken[0]!r}, which transformers reads as one of its own "
                         f"implementations; choose another (the default is {DEFAULT_NAME!r})")
    AttentionInterface.register(name, attention_forward)
    masking_utils.AttentionMaskInterface.register(name, attention_mask)
    return name


class Mask:
    """The attention pattern as cuflash's keywords, for a batch of `batch` rows, `q_length`
    queries against `kv_length` keys.

    ``causal`` and ``window`` as ``cuflash.torch.attention`` takes them; keys from ``key_end`` on
    are masked for every query (a static cache's free slots) and are not read. ``rows`` is None
    when every row of the batch is one sequence; otherwise (query rows, key rows, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k), the rows as (batch index, position) tensors, the
    sequences packed from them in that order. Query rows outside every sequence (padding) get
    zeros.
    """

    ndim = 4   # what transformers checks of a prepared mask: generate passes it back in as it is

    def __init__(self, batch, q_length, kv_length, causal, window, key_end, rows=None):
        self.shape = (batch, 1, q_length, kv_length)
        self.causal, self.window, self.key_end, self.rows = causal, window, key_end, rows

    def contiguous(self):
        return self

    def __repr__(self):
        packed = "" if self.rows is None else f", {len(self.rows[2]) - 1} sequences"
        return f"cuflash Mask(shape={self.shape}, causal={self.causal}, window={self.window}{packed})"


# Reading transformers' mask functions: the plain ones by identity, the others (closures) by
# their code and captured values. Each bounds kv - q, the key's position minus the query's,
# from below (-left) or above (right), or splits the rows into sequences.
_KNOWN = {"and": masking_utils.and_masks(masking_utils.causal_mask_function).__code__,
          "sliding": masking_utils.sliding_window_overlay(1).__code__,
          "packed": masking_utils.packed_sequence_mask_function(None).__code__}
if hasattr(masking_utils, "sliding_window_bidirectional_overlay"):
    _KNOWN["bidirectional sliding"] = masking_utils.sliding_window_bidirectional_overlay(1).__code__
if hasattr(masking_utils, "remap_positions_for_packed_sequence"):   # (newer transformers: packed by position ids)
    _KNOWN["remap"] = masking_utils.remap_positions_for_packed_sequence(None, None).__code__


class _Pattern:
    def __init__(self):
        self.left = self.right = None   # kv - q >= -left, kv - q <= right; None: unbounded
        self.segments = None            # (B, N) sequence ids of packed sequences
        self.remapped = False           # bounds read in positions within each packed sequence

    def bound(self, left=None, right=None):
        if left is not None:
            self.left = left if self.left is None else min(self.left, left)
        if right is not None:
            self.right = right if self.right is None else min(self.right, right)

    def read(self, fn):
        if fn is masking_utils.causal_mask_function:
            return self.bound(right=0)
        if fn is masking_utils.bidirectional_mask_function:
            return None
        code = getattr(fn, "__code__", None)
        kind = next((k for k, c in _KNOWN.items() if c is code), None)
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()))) if kind else {}
        if kind == "and":
            for part in cells["mask_functions"]:
                self.read(part)
        elif kind == "sliding":        # kv > q - w
            self.bound(left=int(cells["sliding_window"]) - 1)
        elif kind == "bidirectional sliding":   # |q - kv| <= w
            self.bound(left=int(cells["sliding_window"]), right=int(cells["sliding_window"]))
        elif kind == "packed" and self.segments is None:
            self.segments = cells["packed_sequence_mask"]
        elif kind == "remap":   # its function on position ids: within a packed sequence they step by 1
            self.remapped = True
            self.read(cells["mask_function"])
        else:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            raise NotImplementedError(
                f"cuflash cannot express the attention mask function {name} (it reads causal and bidirectional "
                "masks, sliding windows and sequences packed by position ids, combined with and_masks, and "
                "a padding mask beside them)")
        return None


def _columns(mask, start, length):
    """Columns start .. start + length of a (B, L) bool mask, False past its end."""
    mask = mask[:, start:start + length].to(torch.bool)
    if mask.shape[1] < length:
        mask = torch.nn.functional.pad(mask, (0, length - mask.shape[1]))
    return mask


def _sides(left, right, delta):
    """cuflash's (causal, window) for kv - q in [-left, right] (key and query positions), where
    a sequence's j - i - off (its rows j, i; off its keys minus its queries, cuflash's
    bottom-right alignment) is kv - q + delta."""
    left = None if left is None else left - delta
    right = None if right is None else right + delta
    if (left is not None and left < 0) or (right is not None and right < 0):
        raise NotImplementedError(f"cuflash cannot express this mask: a window of {left} keys left and {right} "
                                  "right of the bottom-right diagonal")
    if right == 0:
        return True, None if left is None else (left, None)
    return False, None if left is None and right is None else (left, right)


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=masking_utils.causal_mask_function, attention_mask=None, **kwargs):
    """transformers' mask function for cuflash (an ``AttentionMaskInterface`` entry): the `Mask`
    the attention function reads. Query i sits at position q_offset + i, key j at kv_offset + j;
    ``attention_mask`` is the tokenizer's (B, positions) padding mask, 1 for a token."""
    if isinstance(attention_mask, Mask):   # prepared before (generate with a compilable cache)
        return attention_mask
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"cuflash cannot express a {attention_mask.dim()}-dim attention_mask as a "
                                  "padding mask (it takes the tokenizer's (batch, tokens) one)")
    pattern = _Pattern()
    pattern.read(mask_function)
    if pattern.remapped and pattern.segments is None:   # (positions alone do not keep the sequences apart)
        raise NotImplementedError("cuflash cannot express a mask function on position ids without the packed "
                                  "sequences' mask beside it")
    d = int(q_offset) - int(kv_offset)   # key d + i is at query i's own position
    nq, nk = int(q_length), int(kv_length)
    # keys past the last query's reach are masked for every query
    key_end = nk if pattern.right is None else max(0, min(nk, d + nq + pattern.right))
    valid = None if attention_mask is None else _columns(attention_mask, int(kv_offset), key_end)
    whole = valid is None or bool(valid.all())   # one look at the mask (a synchronization)
    if whole and pattern.segments is None:
        causal, window = _sides(pattern.left, pattern.right, d - (key_end - nq))
        return Mask(batch_size, nq, nk, causal, window, key_end)
    if pattern.segments is not None:
        if not whole or d != 0 or nq != nk:
            raise NotImplementedError("cuflash cannot express sequences packed by position ids together with "
                                      "padding or a cache")
        sequences, delta = _segments(pattern.segments.expand(batch_size, -1)[:, :nq]), 0
    elif pattern.left is None and pattern.right is None:
        # no bound on kv - q: every query, against its row's tokens wherever they are
        sequences = [(b, np.arange(nq), np.flatnonzero(row)) for b, row in enumerate(valid.cpu().numpy())]
        delta = 0
    else:
        sequences, delta = _padded(valid, d, nq, pattern.right)
    causal, window = _sides(pattern.left, pattern.right, delta)
    device = (valid if valid is not None else pattern.segments).device
    q_rows, cu_q, max_q = _rows([(b, q) for b, q, _ in sequences], device)
    k_rows, cu_k, max_k = _rows([(b, k) for b, _, k in sequences], device)
    return Mask(batch_size, nq, nk, causal, window, key_end, (q_rows, k_rows, cu_q, cu_k, max_q, max_k))


def _segments(ids):
    """(row, positions, positions) of each run of one sequence id in a (B, N) tensor: a sequence
    whose queries and keys are those positions."""
    sequences = []
    for b, row in enumerate(ids.cpu().numpy()):
        bounds = np.concatenate(([0], np.flatnonzero(np.diff(row)) + 1, [len(row)]))
        sequences += [(b, np.arange(s, e), np.arange(s, e)) for s, e in zip(bounds[:-1], bounds[1:])]
    return sequences


def _padded(valid, d, nq, right):
    """A sequence (row, query positions, key positions) per batch row, and the delta of
    `_sides` they share. Each row's tokens must be one run (left or right padding); its queries
    are those at a token's position, its keys the tokens up to the last query's reach."""
    nk = valid.shape[1]
    if d < 0 or d + nq > nk:
        raise NotImplementedError("cuflash cannot express a padding mask where a query's own position is not "
                                  "among the keys")
    count, first = valid.sum(1), valid.int().argmax(1)
    end = nk - valid.flip(1).int().argmax(1)
    sequences, deltas = [], set()
    for b, (n, s, e) in enumerate(torch.stack([count, first, end], 1).tolist()):   # a synchronization
        if n and e - s != n:
            raise NotImplementedError(f"cuflash cannot express padding that is not one run of tokens per row "
                                      f"(row {b} has holes): a key-padding mask from left or right padding only")
        t, u = (min(max(s - d, 0), nq), min(max(e - d, 0), nq)) if n else (0, 0)
        e = e if right is None else max(s, min(e, d + u + right))
        if n and u > t and e > s:   # kv - q - (j - i - off) for this sequence, off = its keys - its queries
            deltas.add(d - s + t - ((e - s) - (u - t)))
        sequences.append((b, np.arange(t, u), np.arange(s, e) if n else np.arange(0)))
    if len(deltas) > 1:
        raise NotImplementedError("cuflash cannot express this mask: its rows' queries and keys are not aligned "
                                  "alike")
    return sequences, deltas.pop() if deltas else 0


def _rows(sequences, device):
    """The rows (batch index, position) of `sequences` ((row, positions) each) in order, their
    cu_seqlens and the longest one's length."""
    lengths = [len(p) for _, p in sequences]
    batch_idx = np.concatenate([np.full(len(p), b, dtype=np.int64) for b, p in sequences])
    position = np.concatenate([p.astype(np.int64) for _, p in sequences])
    cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    rows = (torch.from_numpy(batch_idx).to(device), torch.from_numpy(position).to(device))
    return rows, torch.from_numpy(cu).to(device), max(lengths)


# Keywords a model may pass that change the scores in ways cuflash.torch.attention does not take
REFUSED = {"alibi": "an ALiBi bias tensor (cuflash takes ALiBi as alibi_slopes, one per head)"}


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function for cuflash (an ``AttentionInterface`` entry).

    query (B, Hq, N, D), key and value (B, Hkv, Nk, D) with Hq a multiple of Hkv; returns
    (out (B, N, Hq, Dv), None). ``attention_mask`` is the `Mask` of `attention_mask`, or a 4-dim
    mask given to the model (float: added to the scores; bool: True where a key is attended), or
    None: then causal is ``is_causal`` or ``module.is_causal``, and the window the
    ``sliding_window`` keyword's, as transformers' FlashAttention integration reads them.
    ``softcap``, ``s_aux`` (gpt-oss's sinks) and ``position_bias`` (added to the scores) are passed
    on, and ``dropout`` (the config's attention dropout in training) as ``dropout_p``, with a seed
    from torch's generator.
    """
    for name, what in REFUSED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"cuflash cannot add {what} ({name}) to the scores")
    mask, bias = attention_mask, kwargs.get("position_bias")
    b, hq, nq, _ = query.shape
    nk = key.shape[2]
    if mask is None:
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal) and nq > 1
        window = kwargs.get("sliding_window")
        if causal and nk > nq:   # as transformers' SDPA integration: the first nq keys (an empty static cache)
            key, value, nk = key[:, :, :nq], value[:, :, :nq], nq
        mask = Mask(b, nq, nk, causal, None if not window else (int(window) - 1, None if causal else int(window) - 1),
                    nk)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        # a mask given to the model, handed on as it is: as transformers' SDPA integration, its first nk keys
        # and no causal bound of its own
        bias = _mask_bias(mask[..., :nk], bias, query.dtype)
        mask = Mask(b, nq, nk, False, None, nk)
    elif not isinstance(mask, Mask):
        what = f"a {mask.dim()}-dim {mask.dtype} tensor" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise NotImplementedError(f"cuflash cannot express attention_mask {what}: it reads the masks its own mask "
                                  "function makes (a model built with this attn_implementation and a 2-dim "
                                  "padding mask) and 4-dim float or bool masks")
    if mask.shape != (b, 1, nq, nk):
        raise ValueError(f"the mask was made for (batch, queries, keys) {mask.shape[::2] + mask.shape[3:]}, "
                         f"the attention got {(b, nq, nk)}")
    sinks = kwargs.get("s_aux")
    if sinks is not None:   # float32, as cuflash takes them (the gradient flows back through the cast)
        sinks = sinks.to(torch.float32)
    if bias is not None:
        bias = bias[..., :mask.key_end]
        if bias.dtype not in (query.dtype, torch.float32):   # as cuflash takes it (the gradient flows back)
            bias = bias.to(torch.float32)
    options = dict(causal=mask.causal, window=mask.window, scale=scaling, enable_gqa=hq != key.shape[1],
                   softcap=kwargs.get("softcap") or None, sinks=sinks, dropout_p=float(dropout))
    key, value = key[:, :, :mask.key_end], value[:, :, :mask.key_end]
    if mask.rows is None:
        out = cuflash_torch.attention(query, key, value, bias=bias, **options)
        return out.transpose(1, 2), None
    if bias is not None:
        raise NotImplementedError("cuflash cannot add a position_bias to the scores of a padded batch or of "
                                  "sequences packed by position ids (it runs them as packed sequences, which take "
                                  "no bias)")
    q_rows, k_rows, cu_q, cu_k, max_q, max_k = mask.rows
    q, k, v = (x.transpose(1, 2)[r] for x, r in ((query, q_rows), (key, k_rows), (value, k_rows)))
    out = cuflash_torch.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                  max_seqlen_k=max_k, check=False, **options)
    full = out.new_zeros((b, nq, hq, out.shape[-1]))
    return full.index_put(q_rows, out), None


def _mask_bias(mask, position_bias, dtype):
    """A 4-dim mask (and the position bias, if any) as one additive bias, as transformers' SDPA
    integration combines them: a float mask added; a bool one -inf where False (0, or the position
    bias, where True), in `dtype` without a position bias."""
    if mask.dtype != torch.bool:
        return mask if position_bias is None else mask + position_bias
    kept = torch.zeros((), dtype=dtype, device=mask.device) if position_bias is None else position_bias
    return torch.where(mask, kept, float("-inf"))
