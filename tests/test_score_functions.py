"""The examples page's score and mask functions (examples/score_functions.py, docs/examples.md)
through cuflash.reference: each against attention written out densely in NumPy from the same
rule, and against the built-in keyword it rebuilds where there is one. No GPU needed."""

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuflash import reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import score_functions as gallery  # noqa: E402

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=20)


def dense(q, k, v, scale, allowed=None, bias=None, score=None):
    """softmax(score(scale q.k) + bias, where allowed) v, row by row in float64; a row that sees
    no key gives 0 and lse -inf."""
    s = scale * q @ np.swapaxes(k, -1, -2)
    if score is not None:
        s = score(s)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    out = np.where(total > 0, (e / np.where(total > 0, total, 1.0)) @ v, 0.0)
    lse = np.where(total[..., 0] > 0, np.log(np.where(total > 0, total, 1.0))[..., 0] + m[..., 0], -np.inf)
    return out, lse


def assert_close(got, want):
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.isneginf(x), np.isneginf(y))
        finite = np.isfinite(y)
        np.testing.assert_allclose(x[finite], y[finite], rtol=1e-10, atol=1e-10)


@st.composite
def inputs(draw):
    b, h, n, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 24)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (rng.standard_normal((b, h, n, d)) * 3 for _ in range(3))   # large logits among them
    return q, k, v, rng


def grid(n):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return i, j


@settings(**FAST)
@given(inputs(), st.integers(0, 6), st.integers(0, 4))
def test_masks_against_their_rules_written_out(x, left, num_global):
    q, k, v, rng = x
    b, n = q.shape[0], q.shape[-2]
    scale = q.shape[-1] ** -0.5
    i, j = grid(n)
    prefix = rng.integers(0, n + 1, b).astype(np.int32)
    docs = np.sort(rng.integers(0, 3, (b, n)), axis=-1).astype(np.int32)
    cases = [
        (gallery.causal(), j <= i),
        (gallery.sliding_window(left), (j <= i) & (j >= i - left)),
        (gallery.sliding_window_with_global_tokens(left, num_global), (j <= i) & ((j >= i - left) | (j < num_global))),
        (gallery.prefix_lm(prefix), (j <= i) | (j < prefix[:, None, None, None])),
        (gallery.document(docs), (docs[:, None, :, None] == docs[:, None, None, :]) & (j <= i)),
        (gallery.document(docs, causal=False), docs[:, None, :, None] == docs[:, None, None, :]),
    ]
    for mask_mod, allowed in cases:
        assert_close(reference.attention(q, k, v, return_lse=True, mask_mod=mask_mod),
                     dense(q, k, v, scale, allowed=np.broadcast_to(allowed, q.shape[:2] + (n, n))))


@settings(**FAST)
@given(inputs(), st.sampled_from([1.0, 5.0, 30.0]))
def test_score_functions_against_their_rules_written_out(x, cap):
    q, k, v, rng = x
    h, n = q.shape[1], q.shape[-2]
    scale = q.shape[-1] ** -0.5
    i, j = grid(n)
    slopes = rng.uniform(0, 1, h).astype(np.float32)
    reach = 3
    table = rng.standard_normal((h, 2 * reach + 1)).astype(np.float32)
    rel = table[:, np.clip(j - i, -reach, reach) + reach]   # (H, N, N)
    assert_close(reference.attention(q, k, v, return_lse=True, score_mod=gallery.softcap(cap)),
                 dense(q, k, v, scale, score=lambda s: cap * np.tanh(s / cap)))
    assert_close(reference.attention(q, k, v, return_lse=True, score_mod=gallery.alibi(slopes)),
                 dense(q, k, v, scale, bias=-slopes.astype(np.float64)[:, None, None] * np.abs(i - j)))
    assert_close(reference.attention(q, k, v, return_lse=True, score_mod=gallery.relative_position(table)),
                 dense(q, k, v, scale, bias=rel.astype(np.float64)))


@settings(**FAST)
@given(inputs(), st.integers(0, 5))
def test_functions_with_a_built_in_give_its_results_and_gradients(x, left):
    q, k, v, rng = x
    slopes = rng.uniform(0, 1, q.shape[1]).astype(np.float32)
    pairs = [
        (dict(mask_mod=gallery.causal()), dict(causal=True)),
        (dict(mask_mod=gallery.sliding_window(left)), dict(causal=True, window=(left, 0))),
        (dict(score_mod=gallery.softcap(20.0)), dict(softcap=20.0)),
        (dict(score_mod=gallery.alibi(slopes), mask_mod=gallery.causal()), dict(alibi_slopes=slopes, causal=True)),
    ]
    dout = rng.standard_normal(v.shape)
    for fn, builtin in pairs:
        results = []
        for kwargs in (fn, builtin):
            o, lse = reference.attention(q, k, v, return_lse=True, **kwargs)
            results.append((o, lse, *reference.attention_backward(dout, q, k, v, o, lse, **kwargs)))
        assert_close(*results)


@settings(**FAST)
@given(inputs(), st.integers(1, 24), st.integers(0, 5))
def test_offsets_give_the_built_ins_when_nq_and_nk_differ(x, nq, left):
    """The built-ins align the mask and ALiBi's distance to the bottom right: offset Nk - Nq."""
    _, k, v, rng = x
    q = rng.standard_normal(k.shape[:-2] + (nq, k.shape[-1])) * 3
    offset = k.shape[-2] - nq
    slopes = rng.uniform(0, 1, q.shape[1]).astype(np.float32)
    pairs = [
        (dict(mask_mod=gallery.causal(offset)), dict(causal=True)),
        (dict(mask_mod=gallery.sliding_window(left, offset)), dict(causal=True, window=(left, 0))),
        (dict(score_mod=gallery.alibi(slopes, offset)), dict(alibi_slopes=slopes)),
    ]
    for fn, builtin in pairs:
        assert_close(*(reference.attention(q, k, v, return_lse=True, **kwargs) for kwargs in (fn, builtin)))


def test_relative_position_table_gets_the_bias_gradient():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 9, 4)) for _ in range(3))
    reach = 2
    table = rng.standard_normal((2, 2 * reach + 1)).astype(np.float32)
    i, j = grid(9)
    index = np.clip(j - i, -reach, reach) + reach
    bias = table[:, index].astype(np.float64)[None]
    fn = gallery.relative_position(table)
    o, lse = reference.attention(q, k, v, return_lse=True, score_mod=fn)
    dout = rng.standard_normal(o.shape)
    *_, dtable = reference.attention_backward(dout, q, k, v, o, lse, score_mod=fn, score_mod_grads=[table])
    o2, lse2 = reference.attention(q, k, v, return_lse=True, bias=bias)
    *_, dbias = reference.attention_backward(dout, q, k, v, o2, lse2, bias=bias, bias_grad=True)
    want = np.zeros_like(dtable)
    for r in range(2 * reach + 1):   # the table's gradient: the bias gradient summed where it was read
        want[:, r] = dbias[0][:, index == r].sum(axis=-1)
    np.testing.assert_allclose(dtable, want, rtol=1e-10, atol=1e-10)


def test_gallery_runs_every_example():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 40, 8)) for _ in range(3))
    examples = gallery.gallery(2, 3, 40)
    assert len(examples) == 8
    for name, fns in examples.items():
        out = reference.attention(q, k, v, **fns)
        assert out.shape == v.shape and np.isfinite(out).all(), name


def test_refused_float64_table_names_it():
    table = np.zeros((2, 5))   # float64: the GPU reads float32 or 16-bit tables
    with pytest.raises(TypeError, match="table has dtype float64"):
        reference.attention(*(np.zeros((1, 2, 3, 4)),) * 3, score_mod=gallery.relative_position(table))
