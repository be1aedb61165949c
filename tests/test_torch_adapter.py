"""cuflash.torch, the PyTorch adapter (docs/contract.md, "PyTorch adapter").

Without a GPU: the imports (cuflash never imports torch; cuflash.torch without torch says how
to install it), the fake kernels' shapes, dtypes and strides, the argument errors, and the
whole autograd path on CPU tensors, where the ops run cuflash.reference: forward and gradients
against torch's scaled_dot_product_attention in float64, GQA, packed sequences, sinks, a bias
(SDPA's float attn_mask, with its gradient), dropout (its mask, its seed, its gradients), and
torch.library.opcheck. On a GPU: the same against SDPA in float64 for the kernels, opcheck,
zero-copy and the stream, and torch.compile(fullgraph=True).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import requires_gpu

import cuflash
from cuflash import reference

torch = pytest.importorskip("torch", reason="cuflash.torch needs PyTorch")

import torch.nn.functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import cuflash.torch as ct  # noqa: E402


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_cuflash_does_not_import_torch():
    done = run_python("import sys, cuflash; print('torch' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_without_torch_the_adapter_says_how_to_install_it():
    done = run_python("import sys; sys.modules['torch'] = None\n"
                      "try:\n    import cuflash.torch\nexcept ImportError as err:\n    print(err)")
    assert done.returncode == 0, done.stderr
    assert "pip install torch" in done.stdout


def make(shape, dtype=torch.float64, device="cpu", grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device).requires_grad_(grad)


def qkv(b, hq, hkv, nq, nk, d, dv=None, **kw):
    return (make((b, hq, nq, d), seed=1, **kw), make((b, hkv, nk, d), seed=2, **kw),
            make((b, hkv, nk, dv or d), seed=3, **kw))


# The fake kernels: shapes, dtypes and strides (those of the real kernels' results) without
# running anything; "cuda" fake tensors need no GPU.

FAKE_CASES = {
    "plain": dict(shapes=((2, 4, 64, 32), (2, 4, 80, 32), (2, 4, 80, 48)), kw={}, out=(2, 4, 64, 48), lse=(2, 4, 64)),
    "gqa": dict(shapes=((2, 8, 64, 32), (2, 2, 80, 32), (2, 2, 80, 32)), kw=dict(enable_gqa=True),
                out=(2, 8, 64, 32), lse=(2, 8, 64)),
    "packed": dict(shapes=((100, 8, 64), (120, 2, 64), (120, 2, 64)), kw=dict(enable_gqa=True, packed=True),
                   out=(100, 8, 64), lse=(8, 100)),
}


def fake_call(case, dtype, device):
    c = FAKE_CASES[case]
    kw = dict(c["kw"])
    q, k, v = (torch.empty(s, dtype=dtype, device=device, requires_grad=True) for s in c["shapes"])
    if kw.pop("packed", False):
        kw["cu_seqlens_q"] = torch.tensor([0, 60, 100], dtype=torch.int32, device=device)
        kw["cu_seqlens_k"] = torch.tensor([0, 50, 120], dtype=torch.int32, device=device)
    return (q, k, v), ct.attention(q, k, v, return_lse=True, **kw)


@pytest.mark.parametrize("case", FAKE_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_kernels_give_the_shapes_and_dtypes(case, dtype):
    with FakeTensorMode():   # "cuda" fake tensors need no GPU
        _, (out, lse) = fake_call(case, dtype, "cuda")
    assert (out.shape, out.dtype, out.device.type) == (FAKE_CASES[case]["out"], dtype, "cuda")
    assert (lse.shape, lse.dtype) == (FAKE_CASES[case]["lse"], torch.float32)
    assert not lse.requires_grad and out.requires_grad


@pytest.mark.parametrize("case", FAKE_CASES)
def test_fake_gradients_have_the_inputs_shapes(case):
    # the autograd engine needs a real device for "cuda" fake tensors: meta tensors use the fake kernels too
    inputs, (out, _) = fake_call(case, torch.float16, "meta")
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in inputs]


def test_fake_sinks_gradient_has_the_sinks_shape():
    q, k, v = (torch.empty((1, 4, 16, 32), device="meta", dtype=torch.float16, requires_grad=True) for _ in range(3))
    sinks = torch.empty(4, device="meta", requires_grad=True)
    (dsinks,) = torch.autograd.grad(ct.attention(q, k, v, sinks=sinks).sum(), (sinks,))
    assert (dsinks.shape, dsinks.dtype) == ((4,), torch.float32)


@pytest.mark.parametrize("shape", [(2, 8, 64, 80), (1, 1, 64, 80), (8, 1, 80), (64, 80), (80,)])
def test_fake_bias_gradient_has_the_bias_shape(shape):
    # under GQA the bias's query heads (axis -3) are split as q's are: each shape comes back as it was given
    q = torch.empty((2, 8, 64, 32), device="meta", dtype=torch.float16, requires_grad=True)
    k, v = (torch.empty((2, 2, 80, 32), device="meta", dtype=torch.float16) for _ in range(2))
    bias = torch.empty(shape, device="meta", dtype=torch.float32, requires_grad=True)
    out = ct.attention(q, k, v, bias=bias, enable_gqa=True, dropout_p=0.1)
    dq, dbias = torch.autograd.grad(out.sum(), (q, bias))
    assert (dq.shape, dbias.shape, dbias.dtype) == (q.shape, shape, torch.float32)


@pytest.mark.parametrize("shapes, kw, match", [
    (((2, 4, 16), (2, 4, 16, 8), (2, 4, 16, 8)), {}, r"q must be \(B, H, N, D\)"),
    (((2, 4, 16, 8),) * 3, dict(cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32),
                                cu_seqlens_k=torch.tensor([0, 16], dtype=torch.int32)), r"\(total, H, D\)"),
    (((16, 4, 8),) * 3, dict(cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32)), "both cu_seqlens_q and"),
    (((2, 6, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8)), dict(enable_gqa=True), "multiple"),
    (((2, 4, 16, 8),) * 3, dict(window=(1, 2, 3)), "window must be a pair"),
])
def test_argument_errors_raise_before_any_launch(shapes, kw, match):
    # meta tensors: nothing could run on them, so the error comes from the checks
    q, k, v = (torch.empty(s, device="meta") for s in shapes)
    with pytest.raises(ValueError, match=match):
        ct.attention(q, k, v, **kw)


def test_tensors_only():
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ct.attention(q.numpy(), q, q)


def meta(*shape):
    return torch.empty(shape, device="meta")


@pytest.mark.parametrize("kw, error, match", [
    (dict(bias=torch.zeros(2, 4, 16, 16).numpy()), TypeError, "bias must be a torch.Tensor"),
    (dict(bias=torch.zeros(2, 4, 16, 16)), ValueError, "bias must be on q's device"),
    (dict(bias=meta(2, 3, 16, 16)), ValueError, r"broadcasts to \(B, Hq, Nq, Nk\) = \(2, 4, 16, 16\)"),
    (dict(bias=meta(1, 2, 4, 16, 16)), ValueError, r"broadcasts to \(B, Hq, Nq, Nk\)"),
    (dict(bias=meta(16, 16), enable_gqa=True), ValueError, r"= \(2, 4, 16, 8\)"),
    (dict(bias=meta(2, 4, 16, 16), cu_seqlens_q=torch.zeros(3, dtype=torch.int32, device="meta"),
          cu_seqlens_k=torch.zeros(3, dtype=torch.int32, device="meta")), ValueError, "not taken with packed"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=0.1, seed=1.5), TypeError, "seed must be None or an int"),
    (dict(dropout_p=0.1, seed=2**64), ValueError, r"0 <= seed < 2\*\*64"),
    (dict(seed=-1), ValueError, r"0 <= seed < 2\*\*64"),
])
def test_bias_and_dropout_errors_raise_before_any_launch(kw, error, match):
    packed = "cu_seqlens_q" in kw
    q = meta(16, 4, 8) if packed else meta(2, 4, 16, 8)
    k = meta(16, 2, 8) if packed else meta(2, 2, 8, 8) if kw.get("enable_gqa") else q
    with pytest.raises(error, match=match):
        ct.attention(q, k, k, **kw)


# The autograd path end to end on CPU tensors (cuflash.reference), against SDPA in float64.

def sdpa_grads(q, k, v, dout, **kw):
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def ours_grads(q, k, v, dout, **kw):
    out = ct.attention(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def assert_all_close(got, want, tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        assert (a.double() - b.double()).abs().max().item() <= tol, name


# lse is float32, so gradients through the reference are good to float32's precision
CPU_TOL = 1e-5


@pytest.mark.parametrize("hq, hkv, causal", [(4, 4, False), (4, 4, True), (8, 2, False), (8, 2, True), (6, 1, True)])
def test_cpu_forward_and_gradients_match_sdpa(hq, hkv, causal):
    q, k, v = qkv(2, hq, hkv, 24, 24, 16, 8, grad=True)
    dout = make((2, hq, 24, 8), seed=4)
    kw = dict(is_causal=causal, enable_gqa=hkv != hq)
    want = sdpa_grads(q, k, v, dout, **kw)
    got = ours_grads(q, k, v, dout, causal=causal, enable_gqa=hkv != hq)
    assert_all_close(got, want, CPU_TOL)


@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_autocast_gives_sdpas_dtype(with_bias):
    """Under autocast q, k, v (and a float32 bias, as SDPA's float attn_mask) are cast to its dtype
    as SDPA's are: the output has SDPA's dtype and values, and float32 inputs get float32 gradients."""
    q, k, v = qkv(1, 4, 4, 32, 32, 16, dtype=torch.float32, grad=True)
    bias = make((1, 4, 32, 32), dtype=torch.float32, seed=5, grad=True) if with_bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ct.attention(q, k, v, causal=not with_bias, bias=bias)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=not with_bias, attn_mask=bias)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), atol=2e-2)
    got.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 for x in (q, k, v, bias) if x is not None)
    assert ct.attention(q, k, v).dtype == torch.float32   # and without autocast, nothing is cast


@pytest.fixture
def backward_keywords(monkeypatch):
    """The keywords of each cuflash.reference.attention_backward call (the CPU path's backward)."""
    seen = []
    real = reference.attention_backward
    monkeypatch.setattr(reference, "attention_backward", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    return seen


@pytest.mark.parametrize("given, switch, want", [(None, False, False), (None, True, True), (True, False, True),
                                                 (False, True, False)])
def test_deterministic_follows_torchs_switch_unless_given(backward_keywords, given, switch, want):
    q, k, v = qkv(1, 2, 2, 8, 8, 16, grad=True)
    out = ct.attention(q, k, v, **({} if given is None else {"deterministic": given}))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(switch)   # read when the backward runs, as torch's kernels do
    try:
        out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(before)
    assert [kw["deterministic"] for kw in backward_keywords] == [want]


def test_cpu_views_in_the_bnhd_layout():
    # (B, N, H, D) tensors transposed to (B, H, N, D), as models hold them
    q, k, v = (make((2, 24, h, 16), seed=s).transpose(1, 2).requires_grad_() for s, h in ((1, 8), (2, 2), (3, 2)))
    dout = make((2, 8, 24, 16), seed=4)
    assert_all_close(ours_grads(q, k, v, dout, enable_gqa=True), sdpa_grads(q, k, v, dout, enable_gqa=True), CPU_TOL)


def test_cpu_packed_sequences_match_sdpa_per_sequence():
    hq, hkv = 4, 2   # sequences of (5, 9, 3) queries and (7, 9, 4) keys
    cu_q = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 16, 20], dtype=torch.int32)
    q = make((17, hq, 16), seed=1, grad=True)
    k, v = make((20, hkv, 16), seed=2, grad=True), make((20, hkv, 16), seed=3, grad=True)
    dout = make((17, hq, 16), seed=4)
    out, lse = ct.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, enable_gqa=True, return_lse=True)
    assert lse.shape == (hq, 17)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    for s in range(3):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        per = [x[r].transpose(0, 1).unsqueeze(0) for x, r in ((q, rq), (k, rk), (v, rk))]
        want = sdpa_grads(*per, dout[rq].transpose(0, 1).unsqueeze(0), enable_gqa=True)
        want = [w.squeeze(0).transpose(0, 1) for w in want]
        assert_all_close([g[r] for g, r in zip(got, (rq, rq, rk, rk))], want, CPU_TOL)


def test_cpu_sinks_gradient_matches_the_sink_as_an_extra_key():
    # a sink is a key of logit z and value 0: SDPA over a zero-valued extra column gives the same
    b, h, n, d = 1, 4, 12, 8
    q, k, v = qkv(b, h, h, n, n, d, grad=True)
    sinks = make((h,), dtype=torch.float32, seed=5, grad=True)
    dout = make((b, h, n, d), seed=4)
    out = ct.attention(q, k, v, sinks=sinks)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    scale = d ** -0.5
    scores = torch.cat([q @ k.transpose(-1, -2) * scale, sinks.view(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    want_out = scores.softmax(-1)[..., :n] @ v
    want = torch.autograd.grad(want_out, (q, k, v, sinks), dout)
    assert (out - want_out).abs().max().item() <= CPU_TOL
    for a, w in zip(got, want):
        assert (a - w).abs().max().item() <= CPU_TOL


# A bias (SDPA's float attn_mask, its gradient where it requires grad) and dropout, on the CPU

BIAS_SHAPES = {"per head": (2, 8, 12, 20), "key padding": (2, 1, 1, 20), "per head, shared": (8, 12, 20),
               "table": (12, 20), "per key": (20,)}


def bottom_right_causal(nq, nk):
    """cuflash's causal mask (row i sees keys j <= i + nk - nq) as an additive float mask."""
    allowed = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    return torch.zeros(nq, nk, dtype=torch.float64).masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq, hkv", [(8, 8), (8, 2)])
@pytest.mark.parametrize("shape", BIAS_SHAPES)
def test_cpu_bias_and_its_gradient_match_sdpas_float_mask(shape, hq, hkv, causal):
    q, k, v = qkv(2, hq, hkv, 12, 20, 16, 8, grad=True)
    bias = make(BIAS_SHAPES[shape], seed=5, grad=True)
    dout = make((2, hq, 12, 8), seed=4)
    mask = bias + bottom_right_causal(12, 20) if causal else bias
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
    want = (want, *torch.autograd.grad(want, (q, k, v, bias), dout))
    out = ct.attention(q, k, v, bias=bias, causal=causal, enable_gqa=hq != hkv)
    got = (out, *torch.autograd.grad(out, (q, k, v, bias), dout))
    assert_all_close(got, want, CPU_TOL)
    assert got[4].shape == bias.shape and (got[4] - want[4]).abs().max().item() <= CPU_TOL


@pytest.mark.parametrize("requires_grad", [False, True])
def test_cpu_dbias_only_where_the_bias_requires_grad(backward_keywords, requires_grad):
    q, k, v = qkv(1, 4, 2, 8, 8, 16, grad=True)
    bias = make((1, 4, 8, 8), seed=5, grad=requires_grad)
    ct.attention(q, k, v, bias=bias, enable_gqa=True).sum().backward()
    assert [kw["bias_grad"] for kw in backward_keywords] == [requires_grad]
    assert (bias.grad is not None) == requires_grad and q.grad is not None


class _NoGradient(torch.autograd.Function):
    """The identity, whose backward gives no gradient (None) to its input."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_cpu_no_gradient_into_out_gives_none_as_sdpa(backward_keywords):
    """A backward that reaches out with no gradient (an undefined one, not zeros) gives q, k, v
    none, as SDPA's does, and runs no kernel."""
    for attention in (ct.attention, F.scaled_dot_product_attention):
        q, k, v = qkv(1, 2, 2, 8, 8, 16, grad=True)
        (_NoGradient.apply(attention(q, k, v)).sum() + (q * 0).sum()).backward()
        assert q.grad is not None and not q.grad.any() and k.grad is None and v.grad is None, attention
    assert backward_keywords == []


def test_cpu_alibi_slopes_requiring_grad_get_none():
    """Slopes that require grad make out require grad, as the op's autograd does, and get none."""
    q, k, v = qkv(1, 2, 2, 8, 8, 16)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    out = ct.attention(q, k, v, alibi_slopes=slopes)
    assert out.requires_grad
    out.sum().backward()
    assert slopes.grad is None


def keep_mask(seed, n, nq, nk, p):
    """cuflash.reference.dropout_keep for batch entries n (an array), rows 0 .. nq - 1 and keys
    0 .. nk - 1, as a bool tensor of shape n.shape + (nq, nk)."""
    n = np.asarray(n)[..., None, None]
    keep = reference.dropout_keep(seed, n, np.arange(nq)[:, None], np.arange(nk), p)
    return torch.from_numpy(np.broadcast_to(keep, n.shape[:-2] + (nq, nk)).copy())


# the CPU path, and the kernels (skipped without a GPU)
DEVICES = [pytest.param("cpu", torch.float64, id="cpu"),
           pytest.param("cuda", torch.float16, id="gpu", marks=requires_gpu)]


def assert_kept_probabilities(out, keep, nk, p):
    """out of q = 0 (each of the Nk keys has probability 1 / Nk) and v the identity: key j's kept
    probability, 1 / (Nk (1 - p)), at [..., i, j] where dropout keeps it, 0 where it drops it."""
    eps = torch.finfo(out.dtype).eps
    out = out.cpu().double()
    assert torch.equal(out != 0, keep)
    want = 1 / (nk * (1 - p))
    assert (out[keep] - want).abs().max().item() <= 16 * eps * want


@pytest.mark.parametrize("device, dtype", DEVICES)
@pytest.mark.parametrize("seed", [3, 2**64 - 5])   # above 2**63 the seed travels as a negative int64
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2)])
def test_dropped_entries_are_dropout_keeps(hq, hkv, seed, device, dtype):
    # batch entry n = b * Hq + h
    b, nq, nk, p = 2, 40, 64, 0.3
    q = torch.zeros(b, hq, nq, 16, dtype=dtype, device=device)
    k = make((b, hkv, nk, 16), dtype=dtype, device=device, seed=2)
    v = torch.eye(nk, dtype=dtype, device=device).expand(b, hkv, nk, nk).contiguous()
    out = ct.attention(q, k, v, dropout_p=p, seed=seed, enable_gqa=hq != hkv)
    keep = keep_mask(seed, torch.arange(b * hq).view(b, hq).numpy(), nq, nk, p)
    assert 0.5 < keep.float().mean() < 0.9
    assert_kept_probabilities(out, keep, nk, p)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_dropped_entries_of_packed_sequences_are_dropout_keeps(device, dtype):
    # positions in the packed arrays, batch entry n = h; every key of a sequence of 24 keys
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device=device) for x in ([0, 5, 36], [0, 24, 48]))
    hq, hkv, p, seed = 4, 2, 0.25, 99
    q = torch.zeros(36, hq, 16, dtype=dtype, device=device)
    k = make((48, hkv, 16), dtype=dtype, device=device, seed=2)
    v = torch.eye(48, dtype=dtype, device=device)[:, None, :].expand(48, hkv, 48).contiguous()
    out = ct.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, dropout_p=p, seed=seed, enable_gqa=True)
    keep = keep_mask(seed, torch.arange(hq).numpy(), 36, 48, p).permute(1, 0, 2)   # (total_q, Hq, total_k)
    own = torch.zeros(36, 48, dtype=torch.bool)
    own[:5, :24] = own[5:, 24:] = True
    assert_kept_probabilities(out, keep & own[:, None, :], 24, p)


def test_cpu_dropout_gradients_go_through_the_forwards_mask():
    # against the same attention in plain torch, with cuflash.reference's keep mask: the backward makes
    # the forward's mask again from the seed
    b, hq, hkv, nq, nk, d, p, seed = 2, 4, 2, 12, 20, 16, 0.2, 12345
    q, k, v = qkv(b, hq, hkv, nq, nk, d, grad=True)
    bias = make((b, 1, nq, nk), seed=5, grad=True)
    dout = make((b, hq, nq, d), seed=4)
    out = ct.attention(q, k, v, bias=bias, dropout_p=p, seed=seed, enable_gqa=True, causal=True)
    got = (out, *torch.autograd.grad(out, (q, k, v, bias), dout))
    kk, vv = (x.repeat_interleave(hq // hkv, 1) for x in (k, v))
    s = q @ kk.transpose(-1, -2) * d ** -0.5 + bias + bottom_right_causal(nq, nk)
    keep = keep_mask(seed, torch.arange(b * hq).view(b, hq).numpy(), nq, nk, p)
    want = (s.softmax(-1) * keep / (1 - p)) @ vv
    want = (want, *torch.autograd.grad(want, (q, k, v, bias), dout))
    assert_all_close(got, want, CPU_TOL)
    assert (got[4] - want[4]).abs().max().item() <= CPU_TOL


def dropout_run(seed=None, **kw):
    """out and the gradients of q, k, v of one call with dropout."""
    q, k, v = qkv(1, 4, 2, 16, 16, 8, grad=True)
    out = ct.attention(q, k, v, dropout_p=0.4, seed=seed, enable_gqa=True, **kw)
    return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))


def test_cpu_dropout_seed_from_torchs_generator():
    torch.manual_seed(0)
    first = dropout_run()
    again = dropout_run()   # a new seed drawn
    torch.manual_seed(0)
    repeated = dropout_run()
    assert all(torch.equal(a, b) for a, b in zip(first, repeated))
    assert not torch.equal(first[0], again[0])
    # a given seed does not depend on torch's generator
    torch.manual_seed(1)
    given = dropout_run(seed=5)
    assert all(torch.equal(a, b) for a, b in zip(given, dropout_run(seed=5)))
    assert not torch.equal(given[0], dropout_run(seed=6)[0])


def test_cpu_activation_checkpointing_recomputes_the_same_dropout():
    """torch.utils.checkpoint restores torch's generator before it recomputes the forward, so the
    recomputation draws the same seed: the same gradients, bitwise."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = qkv(2, 8, 2, 24, 24, 16, grad=True)
    bias = make((2, 8, 24, 24), seed=5, grad=True)

    def layer(q, k, v, bias):
        return ct.attention(q, k, v, causal=True, enable_gqa=True, bias=bias, dropout_p=0.3).tanh()

    torch.manual_seed(0)
    want = torch.autograd.grad(layer(q, k, v, bias).sum(), (q, k, v, bias))
    torch.manual_seed(0)
    got = torch.autograd.grad(checkpoint(layer, q, k, v, bias, use_reentrant=False).sum(), (q, k, v, bias))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_cpu_torch_compile_with_bias_and_dropout_without_graph_breaks():
    # the seed drawn from torch's generator inside the compiled graph, an input of the op: the same
    # seed as eager after the same torch.manual_seed, and no recompilation for a new one
    q, k, v = qkv(1, 8, 2, 16, 16, 8, grad=True)
    bias = make((1, 8, 16, 16), seed=5, grad=True)

    def loss(q, k, v, bias):
        return ct.attention(q, k, v, causal=True, enable_gqa=True, bias=bias, dropout_p=0.25).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    want = torch.autograd.grad(loss(q, k, v, bias), (q, k, v, bias))
    torch.manual_seed(3)
    got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(2):
            xs = [make(x.shape, seed=10 + 4 * step + i, grad=True) for i, x in enumerate((q, k, v, bias))]
            torch.manual_seed(step)
            want = torch.autograd.grad(loss(*xs), xs)
            torch.manual_seed(step)
            got = torch.autograd.grad(compiled(*xs), xs)
            for a, b in zip(got, want):
                assert torch.equal(a, b)


# the forward op's arguments, by name, as ct.attention passes them when not given
FWD_DEFAULTS = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                    window_left=None, window_right=None, scale=None, softcap=None, alibi_slopes=None, sinks=None,
                    bias=None, dropout_p=0.0, seed=None, groups=1, check=True, deterministic=None)


def opcheck_fwd(**args):
    """torch.library.opcheck of cuflash::attention_fwd, its arguments by name (FWD_DEFAULTS for the rest)."""
    op = torch.ops.cuflash.attention_fwd.default
    named = dict(FWD_DEFAULTS, **args)
    torch.library.opcheck(op, tuple(named[a.name] for a in op._schema.arguments))


def test_cpu_opcheck():
    q, k, v = qkv(1, 4, 2, 8, 8, 16, grad=True)
    opcheck_fwd(q=q, k=k, v=v, causal=True, groups=2, deterministic=True)
    bias = make((1, 4, 8, 8), seed=5, grad=True)
    opcheck_fwd(q=q, k=k, v=v, bias=bias, dropout_p=0.25, seed=torch.tensor(7), groups=2, deterministic=True)


def test_cpu_merge_matches_one_attention_over_all_keys():
    q, k, v = qkv(1, 2, 2, 6, 20, 8)
    whole = ct.attention(q, k, v, return_lse=True)
    parts = [ct.attention(q, k[..., r, :], v[..., r, :], return_lse=True) for r in (slice(0, 8), slice(8, 20))]
    for outs, lses in (([p[0] for p in parts], [p[1] for p in parts]),
                       (torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))):
        out, lse = ct.merge_attention(outs, lses)
        assert (out - whole[0]).abs().max().item() <= CPU_TOL
        assert (lse - whole[1]).abs().max().item() <= CPU_TOL
    torch.library.opcheck(torch.ops.cuflash.merge_attention.default, ([p[0] for p in parts], [p[1] for p in parts]))


class _RecordingCupy:
    """What _cupy_view asks of CuPy, recorded: enough of its API to check the view's arithmetic
    on CPU tensors."""

    class cuda:  # noqa: N801 - CuPy's name
        UnownedMemory = staticmethod(lambda ptr, size, owner, device: dict(ptr=ptr, size=size, owner=owner))
        MemoryPointer = staticmethod(lambda memory, offset: dict(memory, offset=offset))

    from_dlpack = staticmethod(lambda t: np.empty(0, dtype=str(t.dtype).removeprefix("torch.")))
    ndarray = staticmethod(lambda shape, dtype, memptr, strides: dict(shape=shape, dtype=dtype, strides=strides,
                                                                      **memptr))
    empty = staticmethod(lambda shape, dtype: dict(shape=shape, dtype=dtype, empty=True))


@pytest.mark.parametrize("view", ["contiguous", "transposed", "sliced", "expanded", "empty"])
def test_cupy_view_spans_the_tensors_elements(view, monkeypatch):
    """_cupy_view's array: the tensor's shape, strides in bytes and first element, over memory
    that reaches its last element and no further, owned by the tensor (a stand-in CuPy records
    the calls)."""
    monkeypatch.setattr(ct, "_CUPY_DTYPES", {})
    base = torch.arange(4 * 6 * 10, dtype=torch.float16).reshape(4, 6, 10)
    t = {"contiguous": base, "transposed": base.transpose(0, 2), "sliced": base[1:, ::2, 3:7],
         "expanded": base[:, :1].expand(4, 5, 10), "empty": base[:, :0]}[view]
    a = ct._cupy_view(_RecordingCupy, t)
    assert (a["shape"], a["dtype"]) == (tuple(t.shape), np.float16)
    if view == "empty":
        assert a["empty"]
        return
    assert a["strides"] == tuple(2 * st for st in t.stride())
    assert (a["ptr"], a["offset"]) == (t.data_ptr(), 0) and a["owner"] is not None
    last = max(sum(i * st for i, st in zip(index, t.stride())) for index in np.ndindex(*t.shape))
    assert a["size"] == 2 * (last + 1)


def test_cpu_kvcache_appends_and_attends_over_the_cached_keys():
    # float32 caches: NumPy shares their memory, so the reference's append lands in them
    b, hq, hkv, nmax, d = 2, 8, 2, 16, 8
    q = make((b, hq, 1, d), dtype=torch.float32, seed=1)
    k_cache, v_cache = (make((b, hkv, nmax, d), dtype=torch.float32, seed=s) for s in (2, 3))
    k_new, v_new = (make((b, hkv, 2, d), dtype=torch.float32, seed=s) for s in (4, 5))
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    versions = k_cache._version, v_cache._version
    out, lse = ct.attention_kvcache(q, k_cache, v_cache, k_new=k_new, v_new=v_new, cache_seqlens=lengths,
                                    enable_gqa=True, return_lse=True)
    assert (out.shape, lse.shape) == ((b, hq, 1, d), (b, hq, 1))
    # the write counts as an in-place change for autograd, as the op's declared mutation does
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[i, :, n:n + 2], k_new[i]) and torch.equal(v_cache[i, :, n:n + 2], v_new[i])
        want = ct.attention(q[i:i + 1], k_cache[i:i + 1, :, :n + 2], v_cache[i:i + 1, :, :n + 2], enable_gqa=True)
        assert (out[i:i + 1] - want).abs().max().item() <= CPU_TOL
    same = ct.attention_kvcache(q, k_cache, v_cache, cache_seqlens=nmax, enable_gqa=True)
    assert (same - ct.attention(q, k_cache, v_cache, enable_gqa=True)).abs().max().item() <= CPU_TOL
    torch.library.opcheck(torch.ops.cuflash.attention_kvcache.default,
                          (q, k_cache, v_cache, k_new, v_new, lengths, None, None, False, None, None, None, None,
                           True, None, None, None, 4))


def test_cpu_kvcache_takes_score_and_mask_functions():
    """score_mod and mask_mod on the cache (eager): each sequence's rows as attention over its
    keys with the functions at positions in the sequence (q_idx from its length) and h the query
    head under enable_gqa, reading a captured tensor; refused under torch.compile's op."""
    b, hq, hkv, nq, nmax, d = 2, 4, 2, 2, 16, 8
    q = make((b, hq, nq, d), seed=1)
    k_cache, v_cache = (make((b, hkv, nmax, d), seed=s) for s in (2, 3))
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float32)
    lengths = torch.tensor([5, 12], dtype=torch.int32)

    def score_mod(s, b, h, i, j):
        return s - slopes[h] * abs(i - j)

    def mask_mod(b, h, i, j):
        return (i >= j) & (j >= b)

    out = ct.attention_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, enable_gqa=True, score_mod=score_mod,
                               mask_mod=mask_mod)
    for i, n in enumerate(lengths.tolist()):
        off = n - nq
        want = ct.attention(q[i:i + 1], k_cache[i:i + 1, :, :n], v_cache[i:i + 1, :, :n], enable_gqa=True,
                            score_mod=lambda s, _, h, r, j: s - slopes[h] * abs(r + off - j),
                            mask_mod=lambda _, h, r, j: (r + off >= j) & (j >= i))
        assert (out[i:i + 1] - want).abs().max().item() <= CPU_TOL
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k_cache, v_cache))
        with pytest.raises(NotImplementedError, match="eager mode only"):
            ct.attention_kvcache(fq, fk, fv, cache_seqlens=5, enable_gqa=True, score_mod=score_mod)


def test_fake_kvcache_shapes():
    with FakeTensorMode():
        q = torch.empty((3, 8, 2, 64), device="cuda", dtype=torch.float16)
        pages = torch.empty((10, 2, 16, 64), device="cuda", dtype=torch.float16)
        table = torch.zeros((3, 4), device="cuda", dtype=torch.int32)
        lengths = torch.zeros(3, device="cuda", dtype=torch.int32)
        out, lse = ct.attention_kvcache(q, pages, pages, block_table=table, cache_seqlens=lengths, enable_gqa=True,
                                        return_lse=True)
        stacked = torch.empty((2, 3, 8, 2, 64), device="cuda"), torch.empty((2, 3, 8, 2), device="cuda")
        parts = ct.merge_attention(*stacked)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((3, 8, 2, 64), torch.float16, (3, 8, 2), torch.float32)
    assert [(x.shape, x.dtype) for x in parts] == [((3, 8, 2, 64), torch.float32), ((3, 8, 2), torch.float32)]


def test_cpu_torch_compile_without_graph_breaks():
    # aot_eager traces the forward and backward graphs through the fake kernels and the autograd
    # formula, as inductor would, without compiling C++
    q, k, v = qkv(1, 8, 2, 16, 16, 8, grad=True)
    sinks = make((8,), dtype=torch.float32, seed=5, grad=True)

    def loss(q, k, v, sinks):
        return ct.attention(q, k, v, causal=True, enable_gqa=True, sinks=sinks, window=(4, None)).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    want = torch.autograd.grad(loss(q, k, v, sinks), (q, k, v, sinks))
    got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # later steps, new values of the same shapes (and the switch read by the backward): no recompilation
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            xs = [make(x.shape, dtype=x.dtype, seed=10 + 4 * step + i, grad=True) for i, x in enumerate((q, k, v, sinks))]
            got = torch.autograd.grad(compiled(*xs), xs)
            for a, b in zip(got, torch.autograd.grad(loss(*xs), xs)):
                assert torch.equal(a, b)


def test_cpu_activation_checkpointing_gives_the_same_gradients():
    """torch.utils.checkpoint recomputes the forward in the backward: the same gradients, bitwise."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = qkv(2, 8, 2, 24, 24, 16, grad=True)
    sinks = make((8,), dtype=torch.float32, seed=5, grad=True)

    def layer(q, k, v, sinks):
        return ct.attention(q, k, v, causal=True, enable_gqa=True, sinks=sinks).tanh()

    want = torch.autograd.grad(layer(q, k, v, sinks).sum(), (q, k, v, sinks))
    got = torch.autograd.grad(checkpoint(layer, q, k, v, sinks, use_reentrant=False).sum(), (q, k, v, sinks))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_cpu_kvcache_and_merge_compile_without_graph_breaks():
    # the cache update is a declared mutation: the compiled step must leave the caches as eager does
    q = make((2, 8, 1, 8), dtype=torch.float32, seed=1)
    caches = [make((2, 2, 16, 8), dtype=torch.float32, seed=s) for s in (2, 3)]
    new = [make((2, 2, 1, 8), dtype=torch.float32, seed=s) for s in (4, 5)]
    lengths = torch.tensor([3, 7], dtype=torch.int32)

    def step(q, k_cache, v_cache, k_new, v_new):
        first = ct.attention_kvcache(q, k_cache, v_cache, k_new=k_new, v_new=v_new, cache_seqlens=lengths,
                                     enable_gqa=True, return_lse=True)
        return ct.merge_attention([first[0], first[0]], [first[1], first[1]])

    eager_caches = [c.clone() for c in caches]
    want = step(q, *eager_caches, *new)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches, *new)
    for a, b in zip((*got, *caches), (*want, *eager_caches)):
        assert torch.equal(a, b)


# Score and mask functions (eager mode): captured tensors read where they lie, the caller's heads

def grads_of(fn, q, k, v, dout):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2)])
def test_cpu_functions_capturing_tensors_give_the_keywords_results(hq, hkv):
    """ALiBi as a score function reading a tensor of per-query-head slopes, causal as a mask
    function: out and the gradients of alibi_slopes= and causal=True, with enable_gqa too (the
    functions see the caller's query head)."""
    q, k, v = qkv(2, hq, hkv, 9, 11, 8, grad=True)
    dout = make((2, hq, 9, 8), seed=4)
    slopes = torch.linspace(0.1, 0.8, hq, dtype=torch.float32)
    gqa = hq != hkv
    got = grads_of(lambda q, k, v: ct.attention(q, k, v, enable_gqa=gqa,
                                                score_mod=lambda s, b, h, i, j: s - slopes[h] * abs(i + 2 - j),
                                                mask_mod=lambda b, h, i, j: j <= i + 2), q, k, v, dout)
    want = grads_of(lambda q, k, v: ct.attention(q, k, v, enable_gqa=gqa, alibi_slopes=slopes, causal=True),
                    q, k, v, dout)
    assert_all_close(got, want, CPU_TOL)


def test_cpu_document_mask_over_packed_tensors_equals_cu_seqlens():
    """A mask function reading a tensor of document ids over packed (total, H, D) tensors (its
    indices h, q_idx, kv_idx: positions in the packed tensors), with GQA: cu_seqlens' results."""
    lengths = [5, 1, 7]
    total = sum(lengths)
    docs = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(lengths))
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    q, k, v = (make((total, h, 8), seed=s, grad=True) for h, s in ((4, 1), (2, 2), (2, 3)))
    dout = make((total, 4, 8), seed=4)
    got = grads_of(lambda q, k, v: ct.attention(q, k, v, enable_gqa=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                mask_mod=lambda h, i, j: (docs[i] == docs[j]) & (j <= i)),
                   *(x.detach().requires_grad_() for x in (q, k, v)), dout)
    want = grads_of(lambda q, k, v: ct.attention(q, k, v, enable_gqa=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                 causal=True), q, k, v, dout)
    assert_all_close(got, want, CPU_TOL)


def test_cpu_block_mask_over_the_callers_heads():
    """cuflash.torch.block_mask over (B, Hq) with a function reading a tensor, passed with
    enable_gqa: the results of its mask_mod alone; another mask_mod beside it is refused."""
    first = torch.tensor([[0, 3, 6, 9], [2, 2, 2, 2]], dtype=torch.int32)   # (B, Hq): each head's first key
    fn = lambda b, h, i, j: (j >= first[b, h]) & (j <= i + 4)   # noqa: E731
    bm = ct.block_mask(fn, (2, 4), 10, 14, block=(4, 8), device="cpu")
    assert bm.mask_mod is fn and bm.kinds.shape == (2, 4, 3, 2)
    q, k, v = qkv(2, 4, 2, 10, 14, 8, grad=True)
    dout = make((2, 4, 10, 8), seed=4)
    got = grads_of(lambda q, k, v: ct.attention(q, k, v, enable_gqa=True, block_mask=bm), q, k, v, dout)
    want = grads_of(lambda q, k, v: ct.attention(q, k, v, enable_gqa=True, mask_mod=fn), q, k, v, dout)
    assert_all_close(got, want, 0.0)
    with pytest.raises(ValueError, match="mask_mod"):
        ct.attention(q, k, v, enable_gqa=True, block_mask=bm, mask_mod=lambda b, h, i, j: j <= i)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_cpu_tensors_a_score_function_captures_get_their_gradients(hq, hkv, table_dtype):
    """A learnable relative-position table (float32 or bfloat16) and per-head gains that require
    grad, captured by score_mod (the table by two closures): loss.backward() gives them, and q, k,
    v, the gradients of the same attention written in torch ops (float64, autograd), with
    enable_gqa too; loss.backward() fills their .grad, and none of a captured tensor that does not
    require grad or that only the mask function reads."""
    b, nq, nk, d, reach = 2, 7, 9, 8, 3
    q, k, v = qkv(b, hq, hkv, nq, nk, d, grad=True)
    dout = make((b, hq, nq, d), seed=4)
    table = make((hq, 2 * reach + 1), dtype=table_dtype, grad=True, seed=5)
    gain = (1 + 0.2 * make((hq,), seed=6)).to(torch.float32).detach().requires_grad_()
    frozen = make((hq,), dtype=torch.float32, seed=7)
    docs = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2], dtype=torch.float32, requires_grad=True)

    def bias(h, i, j):
        return table[h, cuflash.minimum(cuflash.maximum(j - i, -reach), reach) + reach]

    def score_mod(s, bb, h, i, j):
        return s * gain[h] + bias(h, i, j) + frozen[h] + 0.5 * table[h, 0]

    def mask_mod(bb, h, i, j):
        return (docs[cuflash.minimum(i, 8)] == docs[j]) | (j <= i)

    out = ct.attention(q, k, v, enable_gqa=hq != hkv, score_mod=score_mod, mask_mod=mask_mod)
    got = torch.autograd.grad(out, (q, k, v, table, gain), dout)

    kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    heads = torch.arange(hq)[:, None, None]
    rel = table.double()[heads, (j - i).clamp(-reach, reach) + reach]
    scores = (q @ kk.transpose(-1, -2)) / d ** 0.5
    scores = scores * gain.double()[:, None, None] + rel + frozen.double()[:, None, None] \
        + 0.5 * table.double()[:, 0, None, None]
    allowed = (docs[i.clamp(max=8)] == docs[j]) | (j <= i)
    want_out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ vv
    want = torch.autograd.grad(want_out, (q, k, v, table, gain), dout)
    torch.testing.assert_close(out, want_out, rtol=0, atol=CPU_TOL)
    for name, g, w in zip(("dq", "dk", "dv", "dtable", "dgain"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        tol = CPU_TOL if g.dtype != torch.bfloat16 else 2**-7 * w.abs().max().item()
        torch.testing.assert_close(g.double(), w.double(), rtol=0, atol=tol, msg=name)
    # loss.backward() fills .grad of what score_mod reads, and only of that
    (ct.attention(q, k, v, enable_gqa=hq != hkv, score_mod=score_mod, mask_mod=mask_mod) * dout).sum().backward()
    assert docs.grad is None and frozen.grad is None
    assert torch.equal(table.grad, got[3]) and torch.equal(gain.grad, got[4])


def test_cpu_functions_are_rebound_once_and_refused_where_the_op_runs():
    """A function's tensors are rebound once while they stay the same tensors (cuflash keeps its
    trace); under fake tensors (what torch.compile sees) functions are refused."""
    table = torch.randn(4, 40, dtype=torch.float32)
    fn = lambda s, b, h, i, j: s + table[h, i - j + 20]   # noqa: E731
    q, k, v = qkv(1, 4, 4, 6, 6, 8)
    first = ct.attention(q, k, v, score_mod=fn)
    rebound = ct._REBOUND[fn][1]
    again = ct.attention(q, k, v, score_mod=fn)
    assert ct._REBOUND[fn][1] is rebound and torch.equal(first, again)
    table[:, 20] += 5.0   # new values in place (the diagonal's scores): read anew
    shifted = ct.attention(q, k, v, score_mod=fn)
    want = ct.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h, i - j + 20])
    torch.testing.assert_close(shifted, want, rtol=0, atol=0)
    assert not torch.allclose(shifted, again)
    elsewhere = torch.zeros(4, device="meta")
    with pytest.raises(TypeError, match="reads a tensor on meta"):
        ct.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + elsewhere[h])
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        with pytest.raises(NotImplementedError, match="eager mode only"):
            ct.attention(fq, fk, fv, score_mod=fn)


# On a GPU: the kernels through DLPack on torch's stream.

GPU_DTYPES = [torch.float16, torch.bfloat16]


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("hq, hkv, causal", [(8, 8, False), (8, 8, True), (8, 2, True), (16, 1, False)])
def test_gpu_forward_and_gradients_as_accurate_as_sdpa(dtype, hq, hkv, causal):
    # the accuracy criterion with SDPA in the dtype for the baseline: c = 2 forward, 3 for the gradients
    q, k, v = qkv(2, hq, hkv, 256, 256, 64, device="cuda", dtype=dtype, grad=True)
    dout = make((2, hq, 256, 64), device="cuda", dtype=dtype, seed=4)
    kw = dict(is_causal=causal, enable_gqa=hkv != hq)
    ref = sdpa_grads(*(x.detach().double().requires_grad_() for x in (q, k, v)), dout.double(), **kw)
    theirs = sdpa_grads(q, k, v, dout, **kw)
    ours = ours_grads(q, k, v, dout, causal=causal, enable_gqa=hkv != hq)
    ulp = torch.finfo(dtype).eps
    for name, c, o, t, r in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3), ours, theirs, ref):
        assert o.dtype == dtype and o.shape == r.shape, name
        err, their_err = ((x.double() - r).abs().max().item() for x in (o, t))
        assert err <= c * their_err + 4 * ulp * max(1.0, r.abs().max().item()), name


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_functions_and_block_masks_capturing_tensors(dtype):
    """A score function and a block mask whose functions read CUDA tensors, with enable_gqa: out
    and the gradients against float64 (the CPU path, the same functions over CPU tensors) within
    the accuracy criterion, SDPA with the same scores as a float mask for the baseline."""
    def functions(slopes, first):
        return (lambda s, b, h, i, j: s - slopes[h] * abs(i - j),
                lambda b, h, i, j: (j <= i) & ((j >= first[b, h]) | (j == i)))

    gen = torch.Generator().manual_seed(9)
    slopes = torch.linspace(0.05, 0.4, 8, dtype=torch.float32)
    first = torch.randint(0, 60, (2, 8), generator=gen, dtype=torch.int32)
    q, k, v = qkv(2, 8, 2, 200, 200, 64, device="cuda", dtype=dtype, grad=True)
    dout = make((2, 8, 200, 64), device="cuda", dtype=dtype, seed=4)
    score_mod, mask_mod = functions(slopes.cuda(), first.cuda())
    bm = ct.block_mask(mask_mod, (2, 8), 200, 200, block=(64, 32))
    ours = ours_grads(q, k, v, dout, enable_gqa=True, score_mod=score_mod, block_mask=bm)
    host_score, host_mask = functions(slopes, first)
    ref = grads_of(lambda q, k, v: ct.attention(q, k, v, enable_gqa=True, score_mod=host_score, mask_mod=host_mask),
                   *(x.detach().cpu().double().requires_grad_() for x in (q, k, v)), dout.cpu().double())
    i, j = torch.arange(200)[:, None], torch.arange(200)[None, :]
    allowed = (j <= i) & ((j >= first[:, :, None, None].long()) | (j == i))
    bias = torch.where(allowed, -slopes[:, None, None] * (i - j).abs(), float("-inf")).to(dtype).cuda()
    theirs = sdpa_grads(q, k, v, dout, attn_mask=bias, enable_gqa=True)
    ulp = torch.finfo(dtype).eps
    for name, c, o, t, r in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3), ours, theirs, ref):
        r = r.cuda()
        err, their_err = ((x.double() - r).abs().max().item() for x in (o, t))
        assert err <= c * their_err + 4 * ulp * max(1.0, r.abs().max().item()), name


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("hq, hkv, shape", [(8, 8, (2, 8, 256, 256)), (8, 2, (2, 8, 256, 256)),
                                            (8, 2, (2, 1, 1, 256)), (16, 1, (256, 256))])
def test_gpu_bias_and_its_gradient_as_accurate_as_sdpas_float_mask(dtype, hq, hkv, shape):
    # SDPA with the bias as its float attn_mask, which requires grad: the same criterion as above, dbias too
    q, k, v = qkv(2, hq, hkv, 256, 256, 64, device="cuda", dtype=dtype, grad=True)
    bias = make(shape, device="cuda", dtype=dtype, seed=5, grad=True)
    dout = make((2, hq, 256, 64), device="cuda", dtype=dtype, seed=4)

    def sdpa(q, k, v, bias, dout):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=hkv != hq)
        return (out, *torch.autograd.grad(out, (q, k, v, bias), dout))

    ref = sdpa(*(x.detach().double().requires_grad_() for x in (q, k, v, bias)), dout.double())
    theirs = sdpa(q, k, v, bias, dout)
    out = ct.attention(q, k, v, bias=bias, enable_gqa=hkv != hq)
    ours = (out, *torch.autograd.grad(out, (q, k, v, bias), dout))
    ulp = torch.finfo(dtype).eps
    for name, c, o, t, r in zip(("out", "dq", "dk", "dv", "dbias"), (2, 3, 3, 3, 3), ours, theirs, ref):
        assert o.dtype == dtype and o.shape == r.shape, name
        err, their_err = ((x.double() - r).abs().max().item() for x in (o, t))
        assert err <= c * their_err + 4 * ulp * max(1.0, r.abs().max().item()), name


@requires_gpu
def test_gpu_dropout_with_one_seed_gives_the_same_bits():
    q, k, v = qkv(2, 8, 2, 256, 256, 64, device="cuda", dtype=torch.float16, grad=True)
    bias = make((2, 8, 256, 256), device="cuda", dtype=torch.float16, seed=5, grad=True)
    dout = make((2, 8, 256, 64), device="cuda", dtype=torch.float16, seed=4)

    def run(seed=None):
        out = ct.attention(q, k, v, causal=True, enable_gqa=True, bias=bias, dropout_p=0.2, seed=seed,
                           deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v, bias), dout))

    given = run(77)
    assert all(torch.equal(a, b) for a, b in zip(given, run(77)))
    torch.manual_seed(0)
    drawn = run()
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(drawn, run()))
    assert not torch.equal(drawn[0], run()[0]) and not torch.equal(given[0], run(78)[0])


@requires_gpu
def test_gpu_dropout_is_refused_under_cuda_graph_capture():
    # the kernels take the seed by value: a replay would drop what the capture dropped
    q, k, v = qkv(1, 4, 4, 128, 128, 64, device="cuda", dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        doubled = q * 2   # (the graph is not empty)
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            ct.attention(q, k, v, dropout_p=0.1, seed=1)
    graph.replay()
    assert torch.equal(doubled, q * 2)


@requires_gpu
@pytest.mark.parametrize("case", ["packed", "sinks", "alibi_window", "bnhd_view", "bias_dropout", "packed_dropout"])
def test_gpu_agrees_with_the_cpu_path(case):
    # the CPU path (cuflash.reference, float64) checked against SDPA above; here the kernels against it,
    # within float16's error at the results' scale (dbias: at its own, which is small); with dropout, the
    # same seed gives both the same mask
    hq, hkv = 8, 2
    kw = dict(enable_gqa=True, causal=True)
    if case.startswith("packed"):
        shapes = ((300, hq, 64), (340, hkv, 64), (340, hkv, 64))
        kw.update(cu_seqlens_q=torch.tensor([0, 100, 300], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 140, 340], dtype=torch.int32))
    else:
        shapes = ((2, hq, 200, 64), (2, hkv, 240, 64), (2, hkv, 240, 64))
    if case == "sinks":
        kw["sinks"] = make((hq,), dtype=torch.float32, seed=5)
    if case == "alibi_window":
        kw.update(alibi_slopes=make((hq,), dtype=torch.float32, seed=5).abs(), window=(64, None), softcap=30.0)
    if case.endswith("dropout"):
        kw.update(dropout_p=0.2, seed=2024)
    if case == "bias_dropout":   # one bias for every head: its gradient sums the heads'
        kw["bias"] = make((2, 1, 200, 240), dtype=torch.float32, seed=6)
    inputs = [make(shape, seed=i) for i, shape in enumerate(shapes)]
    if case == "bnhd_view":
        inputs = [make(shape[:1] + shape[2:3] + shape[1:2] + shape[3:], seed=i).transpose(1, 2)
                  for i, shape in enumerate(shapes)]
    dout = make(shapes[0], seed=9)
    differentiable = [key for key in ("bias", "sinks") if key in kw]

    def run(device, dtype):
        xs = [x.to(device=device, dtype=dtype).requires_grad_() for x in inputs]
        opts = {key: x.to(device) if isinstance(x, torch.Tensor) else x for key, x in kw.items()}
        for key in differentiable:
            opts[key].requires_grad_()
        out, lse = ct.attention(*xs, return_lse=True, **opts)
        wrt = xs + [opts[key] for key in differentiable]
        return [out, lse, *torch.autograd.grad(out, wrt, dout.to(device=device, dtype=dtype))]

    names = ["out", "lse", "dq", "dk", "dv"] + ["d" + key for key in differentiable]
    for name, got, want in zip(names, run("cuda", torch.float16), run("cpu", torch.float64), strict=True):
        assert got.shape == want.shape, name
        scale = want.abs().max().item() if name == "dbias" else max(1.0, want.abs().max().item())
        assert (got.cpu().double() - want.double()).abs().max().item() <= 1e-2 * scale, name


@requires_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_tensors_a_score_function_captures_get_their_gradients(dtype):
    """A learnable relative-position table (a CUDA tensor that requires grad), with enable_gqa:
    the gradients of q, k, v and the table against the CPU path's (the same function over float64
    CPU tensors, cuflash.reference) within three times SDPA's relative error on q, k, v with the
    same scores as a float mask (its worst), of each gradient's scale, plus a few ulps."""
    def function(table):
        return lambda s, b, h, i, j: s + table[h, cuflash.minimum(cuflash.maximum(j - i, -16), 16) + 16]

    b, hq, hkv, n, d = 2, 8, 2, 200, 64
    q, k, v = qkv(b, hq, hkv, n, n, d, device="cuda", dtype=dtype, grad=True)
    dout = make((b, hq, n, d), device="cuda", dtype=dtype, seed=4)
    table = make((hq, 33), dtype=torch.float32, device="cuda", grad=True, seed=5)
    out = ct.attention(q, k, v, enable_gqa=True, score_mod=function(table))
    ours = (out, *torch.autograd.grad(out, (q, k, v, table), dout))
    host = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    host_table = table.detach().cpu().requires_grad_()
    host_out = ct.attention(*host, enable_gqa=True, score_mod=function(host_table))
    ref = (host_out, *torch.autograd.grad(host_out, (*host, host_table), dout.cpu().double()))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    bias = table.detach()[:, (j - i).clamp(-16, 16).cuda() + 16].to(dtype)
    theirs = sdpa_grads(q, k, v, dout, attn_mask=bias, enable_gqa=True)
    relative = max((t.double() - r.cuda()).abs().max().item() / max(r.abs().max().item(), 1e-30)
                   for t, r in zip(theirs[1:], ref[1:4]))
    for name, o, r in zip(("out", "dq", "dk", "dv", "dtable"), ours, ref):
        assert o.dtype == (torch.float32 if name == "dtable" else dtype) and o.shape == r.shape, name
        r = r.cuda().double()
        err = (o.double() - r).abs().max().item()
        assert err <= (3 * relative + 4 * torch.finfo(dtype).eps) * max(1.0, r.abs().max().item()), name


@requires_gpu
@pytest.mark.parametrize("functions", [False, True])
def test_gpu_kvcache_and_merge_agree_with_the_cpu_path(functions):
    """With ``functions``, ALiBi per query head and a first visible key per sequence written as
    score and mask functions that read tensors, in place of causal."""
    q = make((3, 8, 2, 64), seed=1)
    caches = [make((3, 2, 256, 64), seed=s) for s in (2, 3)]
    new = [make((3, 2, 2, 64), seed=s) for s in (4, 5)]
    lengths = torch.tensor([0, 100, 254], dtype=torch.int32)

    def run(device, dtype):
        q_, ks, vs, k_new, v_new = (x.to(device=device, dtype=dtype) for x in (q, *caches, *new))
        mods = dict(causal=True)
        if functions:
            slopes = torch.linspace(0.05, 0.4, 8, dtype=torch.float32, device=device)
            first = torch.tensor([0, 30, 200], dtype=torch.int32, device=device)
            mods = dict(score_mod=lambda s, b, h, i, j: s - slopes[h] * abs(i - j),
                        mask_mod=lambda b, h, i, j: (i >= j) & (j >= first[b]))
        out, lse = ct.attention_kvcache(q_, ks, vs, k_new=k_new, v_new=v_new, cache_seqlens=lengths.to(device),
                                        enable_gqa=True, return_lse=True, **mods)
        merged = ct.merge_attention([out, out], [lse, lse])
        return out, lse, *merged, ks, vs

    for name, got, want in zip(("out", "lse", "merged out", "merged lse", "k_cache", "v_cache"),
                               run("cuda", torch.float16), run("cpu", torch.float64)):
        assert got.shape == want.shape, name
        scale = max(1.0, want.abs().max().item())
        assert (got.cpu().double() - want.double()).abs().max().item() <= 1e-2 * scale, name


@requires_gpu
def test_gpu_decoding_step_under_cuda_graph_capture():
    """A decoding step (append one token per sequence, attend over the cache) captured in a CUDA
    graph and replayed: the same out and caches as the same step run eagerly, with the lengths a
    tensor the graph reads when it replays (check=False: no host synchronisation)."""
    dt, dev = torch.float16, "cuda"
    q = make((3, 8, 1, 64), dtype=dt, device=dev, seed=1)
    new = [make((3, 2, 1, 64), dtype=dt, device=dev, seed=s) for s in (4, 5)]
    lengths = torch.tensor([0, 100, 254], dtype=torch.int32, device=dev)

    def caches():
        return [make((3, 2, 256, 64), dtype=dt, device=dev, seed=s) for s in (2, 3)]

    def step(kc, vc):
        return ct.attention_kvcache(q, kc, vc, k_new=new[0], v_new=new[1], cache_seqlens=lengths,
                                    enable_gqa=True, check=False)

    eager_caches = caches()
    want = step(*eager_caches)
    graph_caches = caches()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # the kernels compiled, the plan made, before capture
        step(*caches())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(*graph_caches)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(graph_caches, eager_caches))


@requires_gpu
def test_gpu_outputs_come_from_torchs_allocator_and_go_back_when_they_die(monkeypatch):
    """out and the gradients come from torch's caching allocator, on a call's first time (through
    cuflash's API, CuPy allocating through torch) as on a repeat call (launch-ready), and go back
    when their tensors die; CuPy's pool holds none of it: nothing leaks across steps."""
    import cupy

    monkeypatch.setattr(ct, "_READY", {})
    pool = cupy.get_default_memory_pool()
    q, k, v = qkv(2, 8, 2, 512, 512, 64, device="cuda", dtype=torch.float16, grad=True)
    for step in range(3):
        torch.cuda.synchronize()
        before = pool.used_bytes(), torch.cuda.memory_allocated()
        out = ct.attention(q, k, v, enable_gqa=True)
        assert pool.used_bytes() == before[0], step
        assert torch.cuda.memory_allocated() - before[1] >= out.numel() * out.element_size(), step
        out.sum().backward()
        del out
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        assert (pool.used_bytes(), torch.cuda.memory_allocated()) == before, step


@requires_gpu
@pytest.mark.parametrize("dtype, hq, hkv, d, keywords", [
    (torch.float16, 8, 2, 64, dict(causal=True, deterministic=True)),
    (torch.bfloat16, 8, 8, 128, dict(window=(100, 0), softcap=30.0, deterministic=True)),
    (torch.bfloat16, 16, 4, 128, dict(causal=True, deterministic=False)),
    (torch.float16, 4, 4, 64, dict(scale=0.3, deterministic=False)),
])
def test_gpu_repeat_calls_launch_the_kept_plans(monkeypatch, dtype, hq, hkv, d, keywords):
    """A call's first time goes through cuflash's API and keeps its plans; a repeat call with the
    same layouts and keywords launches them without the API, on torch's current stream, with the
    same bits (deterministic: the same bits; not: within SDPA's error of float64 SDPA), outputs
    poisoned before the kernels write them."""
    import cuflash

    monkeypatch.setattr(ct, "_READY", {})
    gqa = hq != hkv
    q, k, v = qkv(2, hq, hkv, 300, 300, d, device="cuda", dtype=dtype, grad=True)
    dout = make((2, hq, 300, d), device="cuda", dtype=dtype, seed=4)
    first = ours_grads(q, k, v, dout, enable_gqa=gqa, **keywords)
    assert {key[0] for key in ct._READY} == {"fwd", "bwd"}

    def refuse(*args, **kw):
        raise AssertionError("a repeat call went through cuflash's API")

    monkeypatch.setattr(cuflash._api, "attention", refuse)
    monkeypatch.setattr(cuflash._api, "attention_backward", refuse)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    empty = torch.empty

    def poisoned(*args, **kw):   # (every output of the launch-ready calls comes from torch.empty)
        return empty(*args, **kw).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned)
    with torch.cuda.stream(stream):
        again = ours_grads(q, k, v, dout, enable_gqa=gqa, **keywords)
    monkeypatch.setattr(torch, "empty", empty)
    torch.cuda.current_stream().wait_stream(stream)
    if keywords["deterministic"]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), name
    else:
        kw = dict(is_causal=keywords.get("causal", False), scale=keywords.get("scale"))
        ref = sdpa_grads(*(x.detach().double().requires_grad_() for x in (q, k, v)), dout.double(), enable_gqa=gqa,
                         **kw)
        theirs = sdpa_grads(q, k, v, dout, enable_gqa=gqa, **kw)
        ulp = torch.finfo(dtype).eps
        for name, c, o, t, r in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3), again, theirs, ref):
            err, their_err = ((x.double() - r).abs().max().item() for x in (o, t))
            assert err <= c * their_err + 4 * ulp * max(1.0, r.abs().max().item()), name


@requires_gpu
def test_gpu_opcheck():
    q, k, v = qkv(1, 8, 2, 128, 128, 64, device="cuda", dtype=torch.float16, grad=True)
    opcheck_fwd(q=q, k=k, v=v, causal=True, groups=4, deterministic=True)
    cu = torch.tensor([0, 50, 128], dtype=torch.int32, device="cuda")
    packed = [x[0].transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v)]
    opcheck_fwd(q=packed[0], k=packed[1], v=packed[2], cu_seqlens_q=cu, cu_seqlens_k=cu, groups=4, check=False,
                deterministic=True)
    # a bias that requires grad (dbias) under GQA, and dropout with its seed
    bias = make((1, 8, 128, 128), device="cuda", dtype=torch.float16, seed=5, grad=True)
    opcheck_fwd(q=q, k=k, v=v, bias=bias, dropout_p=0.25, seed=torch.tensor(7), groups=4, deterministic=True)


@requires_gpu
def test_gpu_inputs_reach_the_kernels_without_a_copy_on_torch_stream(monkeypatch):
    """The arrays cuflash.attention gets are over the tensors' own memory, on torch's current stream."""
    import cupy

    import cuflash

    monkeypatch.setattr(ct, "_READY", {})   # (a call's first time goes through cuflash.attention)
    q, k, v = qkv(1, 4, 4, 128, 128, 64, device="cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())   # q, k, v were written on the default stream
    seen = []
    real_attention = cuflash.attention

    def spy(*arrays, **kw):
        seen.extend((a.data.ptr, cupy.cuda.get_current_stream().ptr) for a in arrays)
        return real_attention(*arrays, **kw)

    monkeypatch.setattr(cuflash._api, "attention", spy)
    with torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)   # no deprecated CuPy stream API
        out = ct.attention(q, k, v)
    assert [s[0] for s in seen] == [x.data_ptr() for x in (q, k, v)]
    assert {s[1] for s in seen} == {stream.cuda_stream}
    stream.synchronize()
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=2e-3)


@requires_gpu
def test_gpu_torch_compile_fullgraph():
    q, k, v = qkv(2, 8, 2, 128, 128, 64, device="cuda", dtype=torch.float16, grad=True)
    sinks = make((8,), device="cuda", dtype=torch.float32, seed=5, grad=True)
    weights = make((2, 8, 128, 64), device="cuda", dtype=torch.float16, seed=6)

    def loss(q, k, v, sinks):
        # linear in out: dout is exactly `weights` in both runs, so the gradients are bitwise the same
        return (ct.attention(q, k, v, causal=True, enable_gqa=True, sinks=sinks) * weights).sum()

    compiled = torch.compile(loss, fullgraph=True)
    want = torch.autograd.grad(loss(q, k, v, sinks), (q, k, v, sinks))
    got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@requires_gpu
def test_gpu_torch_compile_fullgraph_with_bias_and_dropout():
    q, k, v = qkv(2, 8, 2, 128, 128, 64, device="cuda", dtype=torch.float16, grad=True)
    bias = make((2, 1, 128, 128), device="cuda", dtype=torch.float16, seed=5, grad=True)
    weights = make((2, 8, 128, 64), device="cuda", dtype=torch.float16, seed=6)

    def loss(q, k, v, bias):
        out = ct.attention(q, k, v, causal=True, enable_gqa=True, bias=bias, dropout_p=0.1, seed=3,
                           deterministic=True)
        return (out * weights).sum()

    compiled = torch.compile(loss, fullgraph=True)
    want = torch.autograd.grad(loss(q, k, v, bias), (q, k, v, bias))
    got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
