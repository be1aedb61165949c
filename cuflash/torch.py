"""cuflash on PyTorch tensors, as ``torch.library`` custom ops (docs/contract.md, "PyTorch adapter").

Tensors are in the layout of ``torch.nn.functional.scaled_dot_product_attention``, (B, H, N, D),
or (total, H, D) for packed sequences. CUDA tensors reach cuflash's kernels as CuPy arrays over
their memory, and results come back through DLPack, with no copy, on torch's current stream; CPU tensors run ``cuflash.reference`` (NumPy float64, cast
back), slow but exact, so that the adapter can be checked without a GPU.
"""

from __future__ import annotations

try:
    import torch
except ImportError as err:
    raise ImportError("cuflash.torch needs PyTorch: pip install torch") from err

import contextlib
import dataclasses
import functools
import weakref
from typing import Optional

import numpy as np
from torch import Tensor

from . import _api, _checks, _dispatch, _launch, _plans, _trace, reference

__all__ = ["attention", "attention_kvcache", "block_mask", "merge_attention", "register_transformers"]


def _host_array(t):
    """A CPU tensor as the reference reads it: the same memory, but bfloat16 (which NumPy
    lacks) as float32, exact, since the reference computes in float64."""
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _host_tensor(x):
    return torch.from_numpy(np.ascontiguousarray(x))


class _StreamHandle:
    """A cudaStream_t through the CUDA stream protocol, which CuPy 14 reads."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_CUPY_STREAMS = {}   # (cudaStream_t, device index) -> its CuPy stream


def _current_stream(device) -> int:
    """torch's current stream on ``device`` as a cudaStream_t, read without making a
    torch.cuda.Stream (8 us a call on an H100's host, bench/host_overhead.py --adapter)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def _cupy_stream(cupy, handle: int, index: int):
    """The stream ``handle`` of device ``index`` as a CuPy stream: nothing created on the GPU,
    nothing synchronised; one wrapper per stream, made at its first call (torch's streams live as
    long as the process)."""
    key = (handle, index)
    if key not in _CUPY_STREAMS:
        if hasattr(cupy.cuda.Stream, "from_external"):   # CuPy >= 14 (ExternalStream is deprecated there)
            _CUPY_STREAMS[key] = cupy.cuda.Stream.from_external(_StreamHandle(handle))
        else:
            _CUPY_STREAMS[key] = cupy.cuda.ExternalStream(*key)
    return _CUPY_STREAMS[key]


def _torch_malloc(cupy, device, size):
    """CuPy memory from torch's caching allocator on torch's current stream, owned by a torch
    tensor (under CUDA graph capture: the graph's private pool)."""
    block = torch.empty(size, dtype=torch.uint8, device=device)
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), size, block, device.index), 0)


@contextlib.contextmanager
def _on_torch(cupy, device):
    # torch's current stream, so that the kernels are ordered with torch's work and nobody waits;
    # memory from torch's caching allocator, so that results behave as torch's own (record_stream)
    # and, under CUDA graph capture, come from the graph's private pool (CuPy's pool may not
    # allocate while a stream captures, and what it handed out would go back to it while the graph
    # still writes there)
    with _cupy_stream(cupy, _current_stream(device), device.index), \
            cupy.cuda.using_allocator(functools.partial(_torch_malloc, cupy, device)):
        yield


_CUPY_DTYPES = {}   # torch dtype -> the CuPy dtype DLPack gives its tensors


def _cupy_view(cupy, t):
    """A CuPy array over tensor ``t``'s memory, no copy: its pointer, shape and strides (in
    elements, as torch's) read directly, the tensor kept alive by the array. The same array as
    ``cupy.from_dlpack`` gives on torch's current stream, without DLPack's stream handshake in
    torch's Python code: 31 us a tensor on an H100's host against 7 (bench/host_overhead.py
    --adapter, the run of 3fcdc0d). Each dtype's CuPy twin comes from DLPack once."""
    t = t.detach()
    dtype = _CUPY_DTYPES.get(t.dtype)
    if dtype is None:
        dtype = _CUPY_DTYPES[t.dtype] = cupy.from_dlpack(t.new_empty(1)).dtype
    if t.numel() == 0:
        return cupy.empty(tuple(t.shape), dtype)
    size = t.element_size() * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), size, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0),
                        strides=tuple(st * t.element_size() for st in t.stride()))


def _backend(device):
    """(the functions, tensor -> array, array -> tensor, the context to call them in) for a device."""
    if device.type == "cuda":
        cupy = _checks.require_cupy()
        return _api, functools.partial(_cupy_view, cupy), torch.from_dlpack, _on_torch(cupy, device)
    if device.type == "cpu":
        return reference, _host_array, _host_tensor, contextlib.nullcontext()
    raise ValueError(f"cuflash.torch runs on CUDA (or, through cuflash.reference, CPU) tensors, not {device.type}")


# Layouts. The caller's: q (B, Hq, N, D) or packed (total, Hq, D); lse (B, Hq, N) or packed
# (Hq, total). cuflash's: heads before rows, (..., H, N, D); with `groups` query heads per key
# head, q (..., Hkv, G, N, D) against k, v (..., Hkv, 1, N, D). Every change is a view.

def _kernel_qkv(q, k, v, packed, groups):
    if packed:
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if groups > 1:
        q, k, v = q.unflatten(-3, (-1, groups)), k.unsqueeze(-3), v.unsqueeze(-3)
    return q, k, v


def _caller_rows(x, packed, groups, grouped=True):
    """out, dq (grouped) or dk, dv from cuflash's layout back to the caller's."""
    if groups > 1:
        x = x.flatten(-4, -3) if grouped else x.squeeze(-3)
    return x.transpose(0, 1) if packed else x


def _kernel_rows(x, packed, groups):
    """out or dout from the caller's layout to cuflash's (the inverse of _caller_rows)."""
    if packed:
        x = x.transpose(0, 1)
    return x.unflatten(-3, (-1, groups)) if groups > 1 else x


def _kernel_lse(lse, groups):
    return lse.unflatten(-2, (-1, groups)) if groups > 1 else lse


def _caller_lse(lse, groups):
    return lse.flatten(-3, -2) if groups > 1 else lse


def _kernel_per_head(x, groups, axis=-1):
    """ALiBi slopes or sinks (one per query head on the last axis, or broadcast along it), or a
    bias (its query heads on axis -3), as cuflash's batch dims (..., Hkv, G) take them: a view.
    A tensor without that axis broadcasts along the heads as it is."""
    if x is None or groups == 1 or x.dim() < -axis:
        return x
    return x.unsqueeze(axis) if x.shape[axis] == 1 else x.unflatten(axis, (-1, groups))


def _keywords(array, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right,
              scale, softcap, alibi_slopes, sinks, bias, dropout_p, seed, groups, check):
    """The keywords that cuflash's attention and attention_backward share, from the ops' arguments."""
    def opt(x):
        return None if x is None else array(x)

    window = None if window_left is None and window_right is None else (window_left, window_right)
    return dict(causal=causal, window=window, scale=scale, cu_seqlens_q=opt(cu_seqlens_q),
                cu_seqlens_k=opt(cu_seqlens_k), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, check=check,
                softcap=softcap, alibi_slopes=opt(_kernel_per_head(alibi_slopes, groups)),
                sinks=opt(_kernel_per_head(sinks, groups)), bias=opt(_kernel_per_head(bias, groups, -3)),
                dropout_p=dropout_p, seed=None if seed is None else int(seed) % 2**64)


def _refuse_capture(device, dropout_p):
    """Dropout's seed reaches the kernels by value: a CUDA graph would replay the mask of its capture."""
    if dropout_p and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("cuflash.torch.attention with dropout_p > 0 cannot be captured in a CUDA graph: the "
                           "kernels take dropout's seed by value, so every replay would drop the same entries")


def _empty(like, shape, dtype=None):
    return like.new_empty(shape, dtype=like.dtype if dtype is None else dtype)


def _forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
             max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], causal: bool,
             window_left: Optional[int], window_right: Optional[int], scale: Optional[float],
             softcap: Optional[float], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
             bias: Optional[Tensor], dropout_p: float, seed: Optional[Tensor], groups: int, check: bool,
             deterministic: Optional[bool]) -> tuple[Tensor, Tensor]:
    # deterministic is the backward's, kept here because the autograd formula sees only these inputs;
    # seed: a CPU int64 tensor (its value, mod 2**64, read here with no synchronisation), None without dropout
    return _attention_forward(None, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                              window_left, window_right, scale, softcap, alibi_slopes, sinks, bias, dropout_p, seed,
                              groups, check)


def _attention_forward(functions, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
                       window_right, scale, softcap, alibi_slopes, sinks, bias, dropout_p, seed, groups, check,
                       deterministic=None):
    """The forward op's work, with the call's score and mask functions (`_Functions`, eager mode
    only) or None."""
    packed, device = cu_seqlens_q is not None, q.device
    _refuse_capture(device, dropout_p)
    qk, kk, vk = _kernel_qkv(q, k, v, packed, groups)
    ready = None
    if functions is None and device.type == "cuda" and not packed and _plain(alibi_slopes, sinks, bias, dropout_p):
        ready = ("fwd", *map(_layout, (qk, kk, vk)), *_typed(causal, window_left, window_right, scale, softcap))
        plan = _READY.get(ready)
        if plan is not None and _launchable(device):
            out, lse = _run_forward(plan, device, qk, kk, vk)
            return _caller_rows(out, packed, groups), _caller_lse(lse, groups)
    fns, array, tensor, stream = _backend(device)
    with stream:
        arrays = tuple(map(array, (qk, kk, vk)))
        out, lse = fns.attention(*arrays, return_lse=True, **_keywords(
            array, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale,
            softcap, alibi_slopes, sinks, bias, dropout_p, seed, groups, check),
            **({} if functions is None else functions.keywords(array, device, groups)))
        out, lse = tensor(out).to(q.dtype), tensor(lse).to(torch.float32)
        if ready is not None:
            plan, used = _plans.forward(*arrays, causal, _window(window_left, window_right), scale, None,
                                        _api._mods(softcap, None, None))
            if _same(used[:3], arrays) and plan.shapes[0][-1] == vk.shape[-1]:
                _keep_ready(ready, plan)
    return _caller_rows(out, packed, groups), _caller_lse(lse, groups)


# Launch-ready calls. A call whose plan cuflash's API made and kept, taking its tensors' memory as it
# is (no copy, no padding), is kept here by its layouts and keywords; a later call with the same
# ones launches that plan's kernels on the tensors' pointers and torch's current stream, its outputs
# from torch's allocator: no checks again, no CuPy arrays, no DLPack. Calls with packed sequences or
# modifiers that travel as arrays (ALiBi slopes, sinks, a bias, dropout) take the whole way.
_READY: dict = {}
MAX_READY = 512   # beyond this many signatures the table starts over


def _plain(alibi_slopes, sinks, bias, dropout_p) -> bool:
    return alibi_slopes is None and sinks is None and bias is None and not dropout_p


def _layout(t):
    """A tensor's part of a launch-ready signature: what a plan depends on (and what its checks
    read: a tensor of another dtype must not find the plan)."""
    return t.dtype, t.get_device(), t.shape, t.stride(), t.data_ptr() % 16 == 0


def _typed(*values):
    """Keywords as a signature holds them: with their types, as the checks see them (1 is not True)."""
    return tuple(zip(map(type, values), values))


def _window(left, right):
    return None if left is None and right is None else (left, right)


def _same(got, given) -> bool:
    """Whether the API took the arrays it was given as they are."""
    return all(a is b for a, b in zip(got, given))


def _keep_ready(key, plan) -> None:
    if plan.launches.runs:   # (no launch: an empty call, which the whole way answers)
        if len(_READY) >= MAX_READY:
            _READY.clear()
        _READY[key] = plan


def _launchable(device) -> bool:
    """Whether a launch-ready call may run now: on torch's current device (whose context the
    launches use) and outside a CUDA graph's capture (whose memory the whole way takes from
    the graph's pool)."""
    return device.index == torch.cuda.current_device() and not torch.cuda.is_current_stream_capturing()


def _run_forward(plan, device, q, k, v):
    """out and lse of a launch-ready forward in cuflash's layout."""
    stream = _current_stream(device)
    out = torch.empty(plan.shapes[0], dtype=q.dtype, device=device)
    lse = torch.empty(plan.shapes[1], dtype=torch.float32, device=device)
    counter = (_launch.tile_counter(_checks.require_cupy(), device.index, stream) if plan.launches.counted
               else None)
    arrays = _launch.call_arrays(_launch.FWD_ARRAYS, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(),
                                 out=out.data_ptr(), lse=lse.data_ptr(), tile_counter=counter)
    for launch in plan.launches.runs:
        launch.run(arrays, stream)
    return out, lse


_attention_fwd = torch.library.custom_op("cuflash::attention_fwd", mutates_args=())(_forward)


@_attention_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale,
      softcap, alibi_slopes, sinks, bias, dropout_p, seed, groups, check, deterministic):
    packed = cu_seqlens_q is not None
    qk, kk, vk = _kernel_qkv(q, k, v, packed, groups)
    batch = torch.broadcast_shapes(qk.shape[:-2], kk.shape[:-2], vk.shape[:-2])
    out = _empty(q, (*batch, qk.shape[-2], vk.shape[-1]))
    lse = _empty(q, (*batch, qk.shape[-2]), torch.float32)
    return _caller_rows(out, packed, groups), _caller_lse(lse, groups)


def _backward_kernels(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                      max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], causal: bool,
                      window_left: Optional[int], window_right: Optional[int], scale: Optional[float],
                      softcap: Optional[float], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                      bias: Optional[Tensor], bias_grad: bool, dropout_p: float, seed: Optional[Tensor], groups: int,
                      check: bool, deterministic: Optional[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dbias (empty without bias_grad) and dsinks (empty without sinks): an op's outputs
    cannot be None."""
    *grads, dbias, dsinks = _attention_backward(None, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k, causal, window_left, window_right, scale, softcap,
                                                alibi_slopes, sinks, bias, bias_grad, dropout_p, seed, groups, check,
                                                deterministic)
    return *grads, _or_empty(dbias, q), _or_empty(dsinks, q)


def _attention_backward(functions, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        causal, window_left, window_right, scale, softcap, alibi_slopes, sinks, bias, bias_grad,
                        dropout_p, seed, groups, check, deterministic, reads=()):
    """The backward op's work, with the call's score and mask functions (`_Functions`) or None:
    dq, dk, dv, dbias and dsinks, None where there is none, then the gradient of each tensor of
    ``reads`` (tensors score_mod captures)."""
    packed, device = cu_seqlens_q is not None, q.device
    _refuse_capture(device, dropout_p)
    qk, kk, vk = _kernel_qkv(q, k, v, packed, groups)
    if deterministic is None:   # not given: torch's switch, read when the backward runs, as torch's kernels do
        deterministic = torch.are_deterministic_algorithms_enabled()
    dout_k, out_k, lse_k = _kernel_rows(dout, packed, groups), _kernel_rows(out, packed, groups), _kernel_lse(lse, groups)
    ready = None
    if functions is None and device.type == "cuda" and not packed and _plain(alibi_slopes, sinks, bias, dropout_p):
        ready = ("bwd", bool(deterministic), *map(_layout, (dout_k, qk, kk, vk, out_k, lse_k)),
                 *_typed(causal, window_left, window_right, scale, softcap))
        plan = _READY.get(ready)
        if plan is not None and _launchable(device):
            dq, dk, dv = _run_backward(plan, device, dout_k, qk, kk, vk, out_k, lse_k)
            return (_caller_rows(dq, packed, groups), _caller_rows(dk, packed, groups, grouped=False),
                    _caller_rows(dv, packed, groups, grouped=False), None, None)
    fns, array, tensor, stream = _backend(device)
    with stream:
        arrays = tuple(map(array, (dout_k, qk, kk, vk, out_k, lse_k)))
        grads = fns.attention_backward(
            *arrays, deterministic=deterministic,
            bias_grad=bias_grad, **_keywords(array, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                             window_left, window_right, scale, softcap, alibi_slopes, sinks, bias,
                                             dropout_p, seed, groups, check),
            **({} if functions is None else functions.keywords(array, device, groups, reads)))
        if ready is not None:
            plan, used = _plans.backward(*arrays, causal, _window(window_left, window_right), scale, None,
                                         bool(deterministic), _api._mods(softcap, None, None))
            if _same(used[:6], arrays[1:] + arrays[:1]) and _gradients_as_given(plan, qk, kk, vk):
                _keep_ready(ready, plan)
        grads = list(grads)
        dq, dk, dv = (tensor(grads.pop(0)).to(q.dtype) for _ in range(3))
        # (the kernels' bias is a view of the caller's: its gradient, contiguous, is viewed back)
        dbias = tensor(grads.pop(0)).to(bias.dtype).reshape(bias.shape) if _wants_dbias(bias, bias_grad) else None
        dsinks = tensor(grads.pop(0)).to(torch.float32).reshape(sinks.shape) if sinks is not None else None
        dreads = tuple(tensor(g).to(t.dtype).reshape(t.shape) for t, g in zip(reads, grads))
    return (_caller_rows(dq, packed, groups), _caller_rows(dk, packed, groups, grouped=False),
            _caller_rows(dv, packed, groups, grouped=False), dbias, dsinks, *dreads)


def _gradients_as_given(plan, q, k, v) -> bool:
    """Whether a backward plan's kernels give dq, dk and dv in the shapes of q, k and v as the
    kernels read them (no padding to slice off, no broadcast dims to sum over), dk and dv
    perhaps in partial sums over parts of each query group, and need no tile lists."""
    if plan.launches.tile_lists or plan.shapes[0] != q.shape:
        return False
    if plan.dkdv_entries is None or plan.dkdv_entries[1] == 1:
        return plan.shapes[1:3] == (k.shape, v.shape)
    return plan.shapes[1][-2:] == k.shape[-2:] and plan.shapes[2][-2:] == v.shape[-2:]


def _run_backward(plan, device, dout, q, k, v, out, lse):
    """dq, dk, dv of a launch-ready backward in cuflash's layout (`_api.attention_backward`'s
    work for the plans `_gradients_as_given` takes)."""
    stream = _current_stream(device)
    dq, dk, dv = (torch.empty(shape, dtype=q.dtype, device=device) for shape in plan.shapes[:3])
    delta = torch.empty(plan.shapes[3], dtype=torch.float32, device=device)
    sums = None if plan.launches.dq_sums is None else torch.zeros(plan.shapes[0], dtype=torch.float32, device=device)
    arrays = _launch.call_arrays(_launch.BWD_ARRAYS, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(),
                                 out=out.data_ptr(), lse=lse.data_ptr(), dout=dout.data_ptr(), delta=delta.data_ptr(),
                                 dq=(dq if sums is None else sums).data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr())
    for launch in plan.launches.runs:
        launch.run(arrays, stream)
    split = plan.dkdv_entries is not None and plan.dkdv_entries[1] > 1
    if sums is None and not split:
        return dq, dk, dv
    dtype_name = str(q.dtype).removeprefix("torch.")
    with _cupy_stream(_checks.require_cupy(), stream, device.index):   # (the kernels CuPy launches)
        if sums is not None:
            _dispatch.scale_dq_sums_at(sums.data_ptr(), dq.data_ptr(), dtype_name, dq.shape[-1], sums.numel(),
                                       plan.launches.dq_sums)
        if split:   # the partial sums over parts of each group, added up
            dk, dv = (_summed_parts(part, dtype_name, like) for part, like in ((dk, k), (dv, v)))
    return dq, dk, dv


def _summed_parts(partial, dtype_name, like):
    total = torch.empty(like.shape, dtype=partial.dtype, device=partial.device)
    _dispatch.sum_parts_at(partial.data_ptr(), total.data_ptr(), dtype_name, partial.shape, total.numel())
    return total


_attention_bwd = torch.library.custom_op("cuflash::attention_bwd", mutates_args=())(_backward_kernels)


def _wants_dbias(bias, bias_grad):
    return bias is not None and bias_grad


def _or_empty(grad, like):
    """An optional gradient as an op returns it: empty (float32) where there is none."""
    return _empty(like, (0,), torch.float32) if grad is None else grad


@_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
      window_right, scale, softcap, alibi_slopes, sinks, bias, bias_grad, dropout_p, seed, groups, check,
      deterministic):
    packed = cu_seqlens_q is not None
    # as the kernels return them: contiguous in cuflash's layout, then viewed as the caller's
    dq, dk, dv = (_empty(q, x.shape) for x in _kernel_qkv(q, k, v, packed, groups))
    dbias = _empty(bias, bias.shape) if _wants_dbias(bias, bias_grad) else None
    dsinks = None if sinks is None else _empty(q, sinks.shape, torch.float32)
    return (_caller_rows(dq, packed, groups), _caller_rows(dk, packed, groups, grouped=False),
            _caller_rows(dv, packed, groups, grouped=False), _or_empty(dbias, q), _or_empty(dsinks, q))


_FWD_INPUTS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "causal", "window_left",
               "window_right", "scale", "softcap", "alibi_slopes", "sinks", "bias", "dropout_p", "seed", "groups",
               "check", "deterministic")


def _setup_context(ctx, inputs, output):
    # (unpacked by position rather than through dicts of names: this runs on every eager call)
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale,
     softcap, alibi_slopes, sinks, bias, dropout_p, seed, groups, check, deterministic) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    # the tensors the backward reads (the seed: dropout's mask made again), then the other inputs
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, bias, seed)
    ctx.args = (max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale, softcap, dropout_p, groups, check,
                deterministic)


def _gradients(ctx, dout, bias_grad, backward_kernels):
    """dq, dk, dv, dsinks and dbias (None where there is none) of the forward `_setup_context` saw,
    by ``backward_kernels`` (the backward op, or its function)."""
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, bias, seed = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale, softcap, dropout_p, groups, check,
     deterministic) = ctx.args
    dq, dk, dv, dbias, dsinks, *dreads = backward_kernels(
        dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        window_left, window_right, scale, softcap, alibi_slopes, sinks, bias, bias_grad, dropout_p, seed, groups,
        check, deterministic)
    return (dq, dk, dv, None if sinks is None else dsinks, dbias if _wants_dbias(bias, bias_grad) else None,
            *dreads)


def _backward(ctx, dout, _dlse):
    """The gradients of _FWD_INPUTS: the op's autograd formula."""
    # dbias only where the bias requires grad (as SDPA's float attn_mask): it costs O(Nq * Nk)
    dq, dk, dv, dsinks, dbias = _gradients(ctx, dout, ctx.needs_input_grad[_FWD_INPUTS.index("bias")],
                                           _attention_bwd)
    grads = dict(q=dq, k=dk, v=dv, sinks=dsinks, bias=dbias)
    return tuple(grads.get(name) for name in _FWD_INPUTS)


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """The op's autograd in eager mode, around the op's own functions: the dispatcher's Python
    round trip for a custom op with an autograd formula costs about 100 us a call, this about 4.
    torch.compile and fake tensors take the op (`_eager`). Its inputs: the op's floating tensors
    (those that may require grad, as the op's autograd sees them), then all the op's inputs as one
    tuple (fewer inputs for autograd to walk, every call), and the call's score and mask functions
    (`_Functions`), which the op cannot take, or None."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, sinks, bias, inputs, functions, *learnable):
        output = _attention_forward(functions, *inputs)
        _setup_context(ctx, inputs, output)
        ctx.functions = functions
        ctx.learnable = learnable   # (the function's own tensors: alive while it is)
        # lse's gradient (it has none) not made as zeros on every backward: an allocation and a fill
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:   # (no gradient reached out: none flows back)
            return (None,) * (8 + len(ctx.learnable))
        need = ctx.needs_input_grad[8:]
        wanted = tuple(t for t, n in zip(ctx.learnable, need) if n)
        kernels = functools.partial(_attention_backward, ctx.functions, reads=wanted)
        dq, dk, dv, dsinks, dbias, *dreads = _gradients(ctx, dout, ctx.needs_input_grad[5], kernels)
        dreads = iter(dreads)
        return (dq, dk, dv, None, dsinks, dbias, None, None, *(next(dreads) if n else None for n in need))


class _Functions:
    """A call's score_mod, mask_mod and block_mask (eager mode), as cuflash's functions take them
    on the backend's arrays: the tensors the functions capture rebound to those arrays (CuPy views
    of CUDA tensors, NumPy for CPU ones), and with grouped query heads, the kernels' batch indices
    (..., Hkv, G) turned back into the caller's query head (..., Hq). Each function's rebound and
    grouped copies are kept (the last per function), so cuflash's trace of them is kept too. The
    tensors score_mod captures that require grad get their gradients (`learnable`)."""

    def __init__(self, score_mod, mask_mod, block_mask):
        # (a block mask carries its function: cuflash's check of the pair, before any rebinding)
        self.score_mod, self.block_mask = score_mod, block_mask
        self.mask_mod = _checks.block_mask_function(mask_mod, block_mask)

    @staticmethod
    def of(score_mod, mask_mod, block_mask):
        return None if score_mod is None and mask_mod is None and block_mask is None else \
            _Functions(score_mod, mask_mod, block_mask)

    def learnable(self) -> tuple:
        """The tensors score_mod captures that require grad (none where autograd is off)."""
        if self.score_mod is None or not torch.is_grad_enabled():
            return ()
        return tuple(t for t in _trace.captured_values(self.score_mod, _is_tensor) if t.requires_grad)

    def keywords(self, array, device, groups, reads=()) -> dict:
        """cuflash's keywords of the functions for a call on ``device``; ``reads``: tensors
        score_mod captures whose gradients the backward returns (score_mod_grads)."""
        score_mod = _grouped(_on_backend(self.score_mod, array, device), groups, True)
        mask_mod = _grouped(_on_backend(self.mask_mod, array, device), groups, False)
        grads = {}
        if reads:   # (the arrays the rebound score_mod reads, by the tensors' ids)
            made = _REBOUND[self.score_mod][2]
            grads = dict(score_mod_grads=[made[id(t)] for t in reads])
        if self.block_mask is None:
            return dict(score_mod=score_mod, mask_mod=mask_mod, **grads)
        kinds = self.block_mask.kinds
        if groups > 1 and kinds.ndim >= 3:   # (..., Hq) tiles as the kernels' (..., Hkv, G): a view
            kinds = kinds.reshape(kinds.shape[:-3] + ((1, 1) if kinds.shape[-3] == 1 else (-1, groups))
                                  + kinds.shape[-2:])
        return dict(score_mod=score_mod, block_mask=dataclasses.replace(self.block_mask, kinds=kinds,
                                                                        mask_mod=mask_mod), **grads)


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


# function -> (its captured tensors' identity, its rebound copy, the arrays it reads by the tensors' ids)
_REBOUND = weakref.WeakKeyDictionary()


def _on_backend(fn, array, device):
    """``fn`` with the tensors it captures as ``array`` gives them for a call on ``device``; ``fn``
    itself where it captures none. TypeError for a captured tensor on another device."""
    if fn is None:
        return None
    tensors = _trace.captured_values(fn, _is_tensor)
    if not tensors:
        return fn
    for t in tensors:
        if t.device != device:
            raise TypeError(f"{fn.__qualname__} reads a tensor on {t.device}, but the call runs on {device}: "
                            "a function reads tensors on q's device")
    # (a CPU tensor's version too: the reference may read a copy of it, bfloat16 as float32)
    key = tuple((id(t), t.dtype, t.data_ptr(), t.shape, t.stride(), t._version if t.device.type == "cpu" else None)
                for t in tensors)
    kept = _REBOUND.get(fn)
    if kept is None or kept[0] != key:
        made = {}   # (one array per tensor, however many closures capture it)

        def replace(t):
            if id(t) not in made:
                made[id(t)] = array(t.detach())
            return made[id(t)]
        kept = _REBOUND[fn] = (key, _trace.rebind(fn, replace, _is_tensor), made)
    return kept[1]


# (id of a function, groups) -> (the function, its copy over the kernels' indices): a plain dict,
# bounded, since the copy holds the function (a weak key whose value holds it would never go)
_GROUPED: dict = {}
MAX_GROUPED = 256


def _grouped(fn, groups, score):
    """``fn`` called with the caller's query head from the kernels' (..., Hkv, G) batch indices."""
    if fn is None or groups == 1:
        return fn
    kept = _GROUPED.get((id(fn), groups))
    if kept is None or kept[0] is not fn:
        if score:
            @_trace.wrapper
            def grouped(s, *idx):
                return fn(s, *idx[:-4], idx[-4] * groups + idx[-3], idx[-2], idx[-1])
        else:
            @_trace.wrapper
            def grouped(*idx):
                return fn(*idx[:-4], idx[-4] * groups + idx[-3], idx[-2], idx[-1])
        if len(_GROUPED) >= MAX_GROUPED:
            _GROUPED.clear()
        kept = _GROUPED[id(fn), groups] = (fn, grouped)
    return kept[1]


def _eager(tensor) -> bool:
    """Whether a call runs in eager mode on real tensors (``tensor`` one of the call's), not under
    torch.compile nor on fake or meta tensors."""
    return type(tensor) is Tensor and tensor.device.type in ("cuda", "cpu") and not torch.compiler.is_compiling()


def _eager_or(op, function, tensor):
    """`function`, the work of `op` (a custom op) without the dispatcher, in eager mode on real
    tensors (`tensor` one of the call's); else `op`: torch.compile and fake or meta tensors see it
    through its fake kernel."""
    return function if _eager(tensor) else op


def _sides(window):
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a pair (left, right), got {window!r}")
    return tuple(window)


def _groups(q, k, v, packed, enable_gqa):
    """Query heads per key head (1 without enable_gqa), after checking the layout's ranks."""
    rank, layout = (3, "(total, H, D)") if packed else (4, "(B, H, N, D)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != rank:
            raise ValueError(f"{name} must be {layout}{' (packed sequences)' if packed else ''}, got shape "
                             f"{tuple(x.shape)}")
    if not enable_gqa:
        return 1
    axis = 1 if packed else 1 - rank  # the heads axis of the caller's layout
    hq, hk, hv = q.shape[axis], k.shape[axis], v.shape[axis]
    if hk != hv or hk == 0 or hq % hk:
        raise ValueError(f"enable_gqa: q's heads ({hq}) must be a multiple of k's and v's ({hk}, {hv}), "
                         "which are equal")
    return hq // hk


def attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False, enable_gqa=False,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, check=True,
              softcap=None, alibi_slopes=None, sinks=None, bias=None, dropout_p=0.0, seed=None, deterministic=None,
              score_mod=None, mask_mod=None, block_mask=None):
    """``cuflash.attention`` on torch tensors in SDPA's layout, differentiable.

    q (B, Hq, N, D), k, v (B, Hkv, Nk, D / Dv); packed sequences (both ``cu_seqlens_q`` and
    ``cu_seqlens_k``, int32 tensors of shape (S + 1,)): q (total_q, Hq, D), k, v (total_k, Hkv, D).
    ``enable_gqa`` as in SDPA: query head h attends key head ``h // (Hq / Hkv)``. ``alibi_slopes``
    and ``sinks`` (float32) one per query head on their last axis, usually (Hq,). ``bias``, added
    to the scores as SDPA's float ``attn_mask``: q's dtype or float32, a shape that broadcasts to
    (B, Hq, Nq, Nk) (not with packed sequences). ``dropout_p`` with ``seed`` (an int,
    ``0 <= seed < 2**64``); without a seed one is drawn from torch's default (CPU) generator, so
    that ``torch.manual_seed`` repeats it, and the backward makes the same mask again. The other
    keywords are ``cuflash.attention``'s; ``deterministic`` is the backward's
    (``cuflash.attention_backward``), by default ``torch.are_deterministic_algorithms_enabled()``
    when the backward runs. Under autocast q, k, v and a floating bias are cast to its dtype
    first, as SDPA's are.

    ``score_mod`` and ``mask_mod`` (eager mode only) are cuflash's score and mask functions, with
    one index per batch dim of the caller's layout (``(score, b, h, q_idx, kv_idx)``; packed:
    ``(score, h, q_idx, kv_idx)``, positions in the packed tensors), h the query head also with
    ``enable_gqa``; the tensors they capture are read where they lie, and those score_mod captures
    that require grad get their gradients (a learnable bias table, per-head slopes or caps),
    through ``score_mod_grads`` of ``attention_backward``.
    ``block_mask`` from `block_mask` (over the caller's heads) carries its ``mask_mod``.

    Returns out (B, Hq, N, Dv) or packed (total_q, Hq, Dv), and with ``return_lse`` also lse,
    float32, (B, Hq, N) or packed (Hq, total_q), not differentiable. Gradients reach q, k, v,
    sinks, and the bias where it requires grad.
    """
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("packed sequences need both cu_seqlens_q and cu_seqlens_k")
    groups = _groups(q, k, v, packed, enable_gqa)
    _check_bias(bias, q, k, v, packed, groups)
    dropout_p, seed = _seed(dropout_p, seed)
    q, k, v, bias = _autocast(q, k, v, bias)
    left, right = _sides(window)
    functions = _Functions.of(score_mod, mask_mod, block_mask)
    inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, left, right, scale, softcap,
              alibi_slopes, sinks, bias, dropout_p, seed, groups, check, deterministic)
    if _eager(q):
        learnable = () if functions is None else functions.learnable()
        out, lse = _Attention.apply(q, k, v, alibi_slopes, sinks, bias, inputs, functions, *learnable)
    elif functions is None:
        out, lse = _attention_fwd(*inputs)
    else:
        raise NotImplementedError("cuflash.torch.attention takes score_mod, mask_mod and block_mask in eager mode "
                                  "only: its torch.library op (what torch.compile and fake tensors see) cannot take "
                                  "Python functions")
    return (out, lse) if return_lse else out


def _check_bias(bias, q, k, v, packed, groups):
    """A bias in the caller's layout: a tensor on q's device whose shape broadcasts to
    (B, Hq, Nq, Nk) without enlarging it. (Its dtype is cuflash's to check.)"""
    if bias is None:
        return
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
    if packed:
        raise ValueError(f"bias is not taken with packed sequences (cu_seqlens_q, cu_seqlens_k), got a bias of "
                         f"shape {tuple(bias.shape)}")
    if bias.device != q.device:
        raise ValueError(f"bias must be on q's device ({q.device}), got {bias.device}")
    heads = (q.shape[1],) if groups > 1 else ()   # with enable_gqa q's heads are the batch's
    try:
        batch = torch.broadcast_shapes(*(x.shape[:-2] if groups == 1 else x.shape[:1] for x in (q, k, v))) + heads
    except RuntimeError:   # batch dims that do not broadcast: cuflash says so
        return
    target = (*batch, q.shape[-2], k.shape[-2])
    if not _checks._broadcasts_to(tuple(bias.shape), target):
        raise ValueError(f"bias must have a shape that broadcasts to (B, Hq, Nq, Nk) = {target} (it may have fewer "
                         f"dims, or 1 where it repeats), got shape {tuple(bias.shape)}")


def _seed(dropout_p, seed):
    """(dropout_p, seed as the ops take it): the seed a CPU int64 tensor (its value mod 2**64), drawn
    from torch's default generator where dropout needs one and none is given; None without dropout."""
    if seed is None and type(dropout_p) is float and dropout_p == 0.0:   # no dropout: nothing to check
        return 0.0, None
    dropout_p = _checks.check_dropout_p(dropout_p)
    if seed is not None:
        _, seed = _checks.check_dropout(dropout_p, seed)
    if not dropout_p:
        return 0.0, None
    if seed is None:
        return dropout_p, torch.randint(2**63 - 1, (), dtype=torch.int64)
    return dropout_p, torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64)


def _autocast(*xs):
    """The tensors in autocast's dtype where it is on for their device (floating ones), as
    autocast casts SDPA's inputs (its float attn_mask too); else as they are. None stays None."""
    device = xs[0].device.type   # (is_autocast_enabled: torch.compile folds it; is_autocast_available it may not trace)
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return xs
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if x is not None and x.is_floating_point() else x for x in xs)


def _call(fn_name, device, *args, **kwargs):
    """A cuflash function of the device's backend on converted tensors (None and non-tensors
    pass as they are); its array results back as tensors."""
    fns, array, tensor, stream = _backend(device)

    def convert(x):
        if isinstance(x, (list, tuple)):
            return [convert(y) for y in x]
        return array(x) if isinstance(x, Tensor) else x

    with stream:
        result = getattr(fns, fn_name)(*map(convert, args), **{key: convert(x) for key, x in kwargs.items()})
        return tuple(map(tensor, result))


def block_mask(mask_mod, batch_shape, nq, nk, block=(128, 128), device="cuda"):
    """``cuflash.block_mask`` for `attention` on tensors (FlexAttention's ``create_block_mask``):
    what ``mask_mod`` (as `attention` takes it, the tensors it captures read where they lie)
    allows in each tile, over the caller's batch dims ``batch_shape`` (usually ``(B, Hq)``, or
    ``(Hq,)`` for packed sequences), computed on ``device``: on a GPU by cuflash's kernel on
    torch's current stream, on the CPU by ``cuflash.reference.block_mask``. Its ``kinds`` are a
    CuPy or NumPy array; pass it to `attention` as ``block_mask``, on the same device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _, array, _, stream = _backend(device)
    if device.type == "cpu":
        built = reference.block_mask(_on_backend(mask_mod, array, device), batch_shape, nq, nk, block)
    else:
        from . import _block_mask

        with _checks.require_cupy().cuda.Device(device.index), stream:
            built = _block_mask.block_mask(_on_backend(mask_mod, array, device), batch_shape, nq, nk, block)
    return dataclasses.replace(built, mask_mod=mask_mod)


def _merge_parts(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    out, lse = _call("merge_attention", outs[0].device, outs, lses)
    return out.to(outs[0].dtype), lse.to(torch.float32)


_merge = torch.library.custom_op("cuflash::merge_attention", mutates_args=())(_merge_parts)


@_merge.register_fake
def _(outs, lses):
    return _empty(outs[0], outs[0].shape), _empty(lses[0], lses[0].shape, torch.float32)


def merge_attention(outs, lses):
    """``cuflash.merge_attention`` on torch tensors: parts (..., Nq, Dv) and their lse (..., Nq),
    as sequences or stacked on a first axis. The custom op ``cuflash::merge_attention``, with no
    autograd formula."""
    outs, lses = (list(x.unbind(0) if isinstance(x, Tensor) else x) for x in (outs, lses))
    if not outs:
        raise ValueError("merge_attention needs at least one part")
    return _eager_or(_merge, _merge_parts, outs[0])(outs, lses)


def _kvcache_kernels(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Optional[Tensor], v_new: Optional[Tensor],
                     cache_seqlens: Optional[Tensor], cache_length: Optional[int], block_table: Optional[Tensor],
                     causal: bool, window_left: Optional[int], window_right: Optional[int], scale: Optional[float],
                     num_splits: Optional[int], check: bool, softcap: Optional[float], alibi_slopes: Optional[Tensor],
                     sinks: Optional[Tensor], groups: int) -> tuple[Tensor, Tensor]:
    return _kvcache_run(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_length, block_table, causal,
                        window_left, window_right, scale, num_splits, check, softcap, alibi_slopes, sinks, groups)


def _kvcache_run(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_length, block_table, causal, window_left,
                 window_right, scale, num_splits, check, softcap, alibi_slopes, sinks, groups, functions=None):
    """The op's work; ``functions`` (eager mode): the call's score and mask functions (_Functions)."""
    # k_new and v_new are written into the caches (declared mutated, as torch.compile must know)
    q_, k_, v_ = _kernel_qkv(q, k_cache, v_cache, False, groups)
    new = [x if x is None or groups == 1 else x.unsqueeze(-3) for x in (k_new, v_new)]
    window = None if window_left is None and window_right is None else (window_left, window_right)
    keywords = {} if functions is None else functions.keywords(_backend(q.device)[1], q.device, groups)
    out, lse = _call("attention_kvcache", q.device, q_, k_, v_, k_new=new[0], v_new=new[1],
                     cache_seqlens=cache_length if cache_seqlens is None else cache_seqlens, block_table=block_table,
                     causal=causal, window=window, scale=scale, num_splits=num_splits, check=check, return_lse=True,
                     softcap=softcap, alibi_slopes=_kernel_per_head(alibi_slopes, groups),
                     sinks=_kernel_per_head(sinks, groups), **keywords)
    return _caller_rows(out.to(q.dtype), False, groups), _caller_lse(lse.to(torch.float32), groups)


_kvcache = torch.library.custom_op("cuflash::attention_kvcache", mutates_args=("k_cache", "v_cache"))(_kvcache_kernels)


def _kvcache_eager(q, k_cache, v_cache, k_new, *args, functions=None):
    """_kvcache's work without the dispatcher, and its bookkeeping: the caches' version counters
    count the write, so that autograd refuses a backward through a cache read before it."""
    result = _kvcache_run(q, k_cache, v_cache, k_new, *args, functions=functions)
    if k_new is not None:
        torch.autograd.graph.increment_version([x for x in (k_cache, v_cache) if not x.is_inference()])
    return result


@_kvcache.register_fake
def _(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_length, block_table, causal, window_left, window_right,
      scale, num_splits, check, softcap, alibi_slopes, sinks, groups):
    q_, k_, _ = _kernel_qkv(q, k_cache, v_cache, False, groups)
    batch = (q_.shape[0], *torch.broadcast_shapes(q_.shape[1:-2], k_.shape[1:-2]))
    out = _empty(q, (*batch, q_.shape[-2], v_cache.shape[-1]))
    lse = _empty(q, (*batch, q_.shape[-2]), torch.float32)
    return _caller_rows(out, False, groups), _caller_lse(lse, groups)


def attention_kvcache(q, k_cache, v_cache, *, k_new=None, v_new=None, cache_seqlens=None, block_table=None,
                      causal=False, window=None, scale=None, num_splits=None, check=True, return_lse=False,
                      enable_gqa=False, softcap=None, alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None):
    """``cuflash.attention_kvcache`` on torch tensors in SDPA's layout: q (B, Hq, Nq, D), caches
    (B, Hkv, Nmax, D / Dv) or paged (P, Hkv, page_size, D / Dv), k_new, v_new (B, Hkv, Nnew, D / Dv),
    written into the caches in place. ``cache_seqlens`` an int or an int tensor (B,);
    ``enable_gqa``, ``alibi_slopes`` and ``sinks`` as in ``attention``; ``score_mod`` and
    ``mask_mod`` (eager mode only) as there, ``(score, b, h, q_idx, kv_idx)`` with positions in
    the sequence (``cuflash.attention_kvcache``). The custom op ``cuflash::attention_kvcache``
    (under torch.compile), with no autograd formula."""
    groups = _groups(q, k_cache, v_cache, False, enable_gqa)
    left, right = _sides(window)
    per_sequence = isinstance(cache_seqlens, Tensor)   # an op's argument is a tensor or an int, not either
    args = (q, k_cache, v_cache, k_new, v_new, cache_seqlens if per_sequence else None,
            None if per_sequence else cache_seqlens, block_table, causal, left, right, scale, num_splits, check, softcap,
            alibi_slopes, sinks, groups)
    functions = _Functions.of(score_mod, mask_mod, None)
    if _eager(q):
        out, lse = _kvcache_eager(*args, functions=functions)
    elif functions is None:
        out, lse = _kvcache(*args)
    else:
        raise NotImplementedError("cuflash.torch.attention_kvcache takes score_mod and mask_mod in eager mode only: "
                                  "its torch.library op (what torch.compile and fake tensors see) cannot take Python "
                                  "functions")
    return (out, lse) if return_lse else out


def register_transformers(name="cufa"):
    """Registers ``attention`` as an attention implementation of Hugging Face transformers under
    `name` (its ``AttentionInterface`` and ``AttentionMaskInterface``), so that
    ``AutoModelForCausalLM.from_config(config, attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` runs the model's attention through cuflash; returns
    `name`. Needs transformers (``cuflash.transformers``, imported here and not before)."""
    from . import transformers as hf   # the module of cuflash, which imports transformers

    return hf.register(name)
