"""cuflash as an attention implementation of Hugging Face transformers
(cuflash.torch.register_transformers; docs/contract.md, "PyTorch adapter").

Without a GPU: the mask function and the attention function on their own against a mask that
transformers' own SDPA mask function builds (causal, sliding windows, padding, caches of every
kind, bidirectional, packed sequences), and tiny models built from configs with random weights
(nothing downloaded), Llama, Qwen2, Mistral, Gemma 2 and gpt-oss, whose logits and parameter
gradients with cuflash match those with transformers' own attention (SDPA, or eager where the
model's scores have a softcap or sinks) in float64 on the CPU, where cuflash runs its float64
reference: an unpadded batch, right- and left-padded batches against each sequence run alone,
sequences packed by their position ids, greedy generation with dynamic and static caches, a 4-dim
float or bool mask given to the model, a position bias, dropout in training (repeated by
torch.manual_seed); the masks and keywords cuflash cannot express raise NotImplementedError. On
a GPU: the same models in bfloat16 against SDPA / eager in bfloat16, both measured against a
float64 run, by the accuracy criterion.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
from conftest import requires_gpu

torch = pytest.importorskip("torch", reason="cuflash.torch needs PyTorch")
transformers = pytest.importorskip("transformers", reason="cuflash.transformers needs transformers")

import torch.nn.functional as F  # noqa: E402
from transformers import masking_utils  # noqa: E402

import cuflash.torch as ct  # noqa: E402
from cuflash import transformers as hf  # noqa: E402

NAME = ct.register_transformers()
real_attention = ct.attention   # the tests below spy on calls to it

# The models' float64 runs round to float32 in their RMSNorms (and eager Gemma 2 in its softmax),
# and cuflash's lse is float32, so the gradients through it are good to float32's precision:
# logits and gradients agree to 1e-5 of their scale (as tests/test_torch_adapter.py's CPU_TOL).
# test_the_comparison_sees_a_window_one_key_wider shows what one key of mask moves.
TOL = 1e-5


def test_importing_cuflash_torch_does_not_import_transformers():
    done = subprocess.run([sys.executable, "-c", "import sys, cuflash.torch; print('transformers' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_register_puts_both_functions_under_the_name():
    from transformers.modeling_utils import AttentionInterface

    assert NAME == hf.DEFAULT_NAME == "cufa"
    assert AttentionInterface._global_mapping[NAME] is hf.attention_forward
    assert masking_utils.AttentionMaskInterface._global_mapping[NAME] is hf.attention_mask
    assert ct.register_transformers("my_attention") == "my_attention"
    assert AttentionInterface._global_mapping["my_attention"] is hf.attention_forward


@pytest.mark.parametrize("name", ["cuflash_attention", "my_sdpa", "flex_attention", "paged|x", "eager"])
def test_register_refuses_names_transformers_reads_as_its_own(name):
    with pytest.raises(ValueError, match="choose another"):
        ct.register_transformers(name)


# The mask function and the attention function alone, against transformers' SDPA mask.

class Module:
    is_causal = True


def draw(shape, seed, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


def padding(lengths, width, side):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1 if side == "right" else 0
        if side == "left":
            mask[b, width - n:] = 1
    return mask


def masked_attention(q, k, v, allowed):
    """Attention in float64 over the keys `allowed` (B, 1, Nq, Nk) marks: rows with none give 0."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def sliding(w):
    return masking_utils.sliding_window_causal_mask_function(w)


# name: (batch size, Nq, Nk, q_offset, kv_offset, mask function, padding mask or None)
# the caches as transformers' layers report them (DynamicLayer, StaticLayer, DynamicSlidingWindowLayer)
MASK_CASES = {
    "causal, left padding": (3, 9, 9, 0, 0, masking_utils.causal_mask_function, padding([9, 4, 6], 9, "left")),
    "causal, right padding": (3, 9, 9, 0, 0, masking_utils.causal_mask_function, padding([9, 4, 6], 9, "right")),
    "window 4, left padding": (3, 9, 9, 0, 0, sliding(4), padding([9, 2, 6], 9, "left")),
    "window 4, right padding": (3, 9, 9, 0, 0, sliding(4), padding([9, 2, 6], 9, "right")),
    "decoding, left padding": (3, 1, 10, 9, 0, masking_utils.causal_mask_function, padding([10, 3, 7], 10, "left")),
    "chunk after a cache": (2, 3, 12, 9, 0, masking_utils.causal_mask_function, None),
    "static cache, prefill": (3, 6, 16, 0, 0, masking_utils.causal_mask_function, padding([6, 2, 5], 6, "left")),
    "static cache, decoding": (3, 1, 16, 8, 0, masking_utils.causal_mask_function, padding([9, 2, 5], 9, "left")),
    "static cache, no padding": (2, 1, 16, 8, 0, masking_utils.causal_mask_function, None),
    "full sliding cache, decoding": (3, 1, 4, 10, 7, sliding(4), padding([11, 2, 9], 11, "left")),
    "full sliding cache, chunk": (2, 3, 6, 10, 7, sliding(4), None),
    "bidirectional, holes": (2, 8, 8, 0, 0, masking_utils.bidirectional_mask_function,
                             torch.tensor([[1, 0, 1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0]])),
    "bidirectional window 2, right padding": (3, 8, 8, 0, 0, masking_utils.sliding_window_bidirectional_mask_function(2),
                                              padding([8, 5, 3], 8, "right")),
    # keys past the last query's reach: cuflash's window shifts to (2w, 0) on the keys it reads
    "bidirectional window 2, more keys": (2, 3, 20, 9, 0, masking_utils.sliding_window_bidirectional_mask_function(2),
                                          None),
    "causal, no padding": (2, 7, 7, 0, 0, masking_utils.causal_mask_function, None),
    "packed by position ids": (2, 10, 10, 0, 0, masking_utils.and_masks(
        masking_utils.causal_mask_function, masking_utils.packed_sequence_mask_function(
            torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]]))), None),
}


@pytest.mark.parametrize("case", MASK_CASES)
def test_masks_match_transformers_sdpa_mask(case, monkeypatch):
    b, nq, nk, q_off, kv_off, fn, pad = MASK_CASES[case]
    args = dict(batch_size=b, q_length=nq, kv_length=nk, q_offset=q_off, kv_offset=kv_off, mask_function=fn,
                attention_mask=None if pad is None else pad.bool())
    allowed = masking_utils.sdpa_mask(**args, allow_is_causal_skip=False)
    mask = hf.attention_mask(**args)
    q, k, v = draw((b, 4, nq, 16), 1), draw((b, 2, nk, 16), 2), draw((b, 2, nk, 8), 3)
    calls = []
    monkeypatch.setattr(ct, "attention", lambda *a, **kw: calls.append(kw) or real_attention(*a, **kw))
    out, weights = hf.attention_forward(Module(), q, k, v, mask)
    assert weights is None and out.shape == (b, nq, 4, 8)
    assert len(calls) == 1 and (calls[0].get("cu_seqlens_q") is not None) == (mask.rows is not None)
    want = masked_attention(q, k, v, allowed)
    # the rows of tokens (a query at a padding position gets 0), every row without a bound on kv - q
    own = q_off + torch.arange(nq)
    if pad is None or fn is masking_utils.bidirectional_mask_function:
        rows = torch.ones(b, nq, dtype=torch.bool)
    else:
        rows = torch.nn.functional.pad(pad.bool(), (0, max(0, int(own[-1]) + 1 - pad.shape[1])))[:, own]
        assert (out[~rows] == 0).all()
    assert rows.any()
    assert (out - want)[rows].abs().max().item() <= 1e-12



def test_no_mask_reads_is_causal_and_the_sliding_window():
    # a model that builds no mask: causal from module.is_causal, the window from the keyword (as
    # transformers' FlashAttention integration), the first Nq keys of an empty static cache
    q, k, v = draw((2, 4, 9, 16), 1), draw((2, 2, 12, 16), 2), draw((2, 2, 12, 16), 3)
    out, _ = hf.attention_forward(Module(), q, k, v, None, sliding_window=4)
    allowed = masking_utils.sdpa_mask(2, 9, 9, mask_function=sliding(4), allow_is_causal_skip=False)
    assert (out - masked_attention(q, k[:, :, :9], v[:, :, :9], allowed)).abs().max().item() <= 1e-12
    module = Module()
    module.is_causal = False
    out, _ = hf.attention_forward(module, q, k, v, None)
    assert (out - masked_attention(q, k, v, torch.ones(1, 1, 9, 12, dtype=torch.bool))).abs().max().item() <= 1e-12


# Tiny models from configs, random weights

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
              intermediate_size=96, max_position_embeddings=256, initializer_range=0.5, attention_dropout=0.0)
# name: (config class name, its own keywords, transformers' attention to compare with)
MODELS = {
    "llama": ("LlamaConfig", {}, "sdpa"),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1), "sdpa"),
    "mistral": ("MistralConfig", dict(sliding_window=5), "sdpa"),
    # softcap and a window on every other layer; eager: transformers' SDPA path has no softcap
    "gemma2": ("Gemma2Config", dict(sliding_window=5, head_dim=16, attn_logit_softcapping=2.0,
                                    query_pre_attn_scalar=16), "eager"),
    # sinks (eager: gpt-oss has no SDPA path) and a window on every other layer; YaRN's factor as the
    # positions imply (no warning)
    "gpt_oss": ("GptOssConfig", dict(sliding_window=5, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     max_position_embeddings=131072), "eager"),
}


def build(name, dtype=torch.float64, device="cpu", **overrides):
    """(model, the attention to compare with) in eval mode, weights from seed 0; gpt-oss's sinks
    drawn from N(0, 1) (they start at 0)."""
    config_name, extra, base = MODELS[name]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    kw = dict(experts_implementation="eager") if name == "gpt_oss" else {}   # grouped_mm takes no float64
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=base, dtype=dtype, **kw)
    if name == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(draw(layer.self_attn.sinks.shape, 7))
    return model.to(device).eval(), base


@pytest.fixture
def calls(monkeypatch):
    """The keywords of each cuflash.torch.attention call."""
    seen = []

    def spy(q, k, v, **kw):
        seen.append(dict(kw, q_shape=tuple(q.shape)))
        return real_attention(q, k, v, **kw)

    monkeypatch.setattr(ct, "attention", spy)
    return seen


def logits_and_grads(model, impl, weights, **inputs):
    """Logits and the parameters' gradients of sum(logits * weights) with attention `impl`."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(**inputs).logits
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(got, want, tol=TOL, where=None):
    """max |got - want| <= tol * max(1, max |want|), at the positions `where` if given."""
    if where is not None:
        got, want = got[where], want[where]
    assert got.shape == want.shape
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} > {tol} x {scale:.3g}"


def assert_grads_close(got, want):
    assert set(got) == set(want)
    for name in want:
        try:
            assert_close(got[name], want[name])
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def token_ids(b, n, seed):
    return torch.randint(0, COMMON["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed))


def expected_calls(model):
    """(causal, window) each layer should pass to cuflash: causal, the model's window of W keys
    as (W - 1, None) on its sliding layers."""
    out = []
    for layer in model.model.layers:
        w = getattr(layer.self_attn, "sliding_window", None)
        if type(model).__name__.startswith("Mistral"):
            w = model.config.sliding_window
        out.append((True, None if w is None else (w - 1, None)))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_unpadded_batch_logits_and_gradients_match(name, calls):
    model, base = build(name)
    ids = token_ids(3, 20, 1)
    weights = draw((3, 20, COMMON["vocab_size"]), 2)
    want = logits_and_grads(model, base, weights, input_ids=ids)
    assert not calls
    got = logits_and_grads(model, NAME, weights, input_ids=ids)
    assert [(c["causal"], c["window"]) for c in calls] == expected_calls(model)
    assert all(c.get("cu_seqlens_q") is None and c["enable_gqa"] for c in calls)
    if name == "gemma2":
        assert {c["softcap"] for c in calls} == {2.0} and {c["scale"] for c in calls} == {16 ** -0.5}
    if name == "gpt_oss":
        assert all(c["sinks"].dtype == torch.float32 and c["sinks"].requires_grad for c in calls)
        assert model.model.layers[0].self_attn.sinks.grad.abs().max() > 0
    assert_close(got[0], want[0])
    assert_grads_close(got[1], want[1])


def test_the_comparison_sees_a_window_one_key_wider():
    """The tolerance tells masks one key apart: Mistral with a window of 5 keys against 6."""
    model, base = build("mistral")
    wider, _ = build("mistral", sliding_window=6)
    ids, weights = token_ids(3, 20, 1), draw((3, 20, COMMON["vocab_size"]), 2)
    got = logits_and_grads(model, NAME, weights, input_ids=ids)
    want = logits_and_grads(wider, base, weights, input_ids=ids)
    with pytest.raises(AssertionError, match="max error"):
        assert_close(got[0], want[0])
    scale = max(1.0, want[0].abs().max().item())
    assert (got[0] - want[0]).abs().max().item() > 1e3 * TOL * scale


def each_alone(model, impl, weights, ids, spans):
    """Logits (0 elsewhere) and the parameters' gradients of sum(logits * weights) with attention
    `impl`, each span (row, start, end) of `ids` run alone as a batch of one."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = torch.zeros(weights.shape, dtype=model.dtype, device=weights.device)
    for b, start, end in spans:
        out = model(input_ids=ids[b:b + 1, start:end]).logits
        (out * weights[b:b + 1, start:end]).sum().backward()
        logits[b, start:end] = out[0].detach()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def token_spans(mask):
    """(row, start, end) of each row's tokens in a padding mask (one run per row)."""
    return [(b, int(row.argmax()), int(row.argmax()) + int(row.sum())) for b, row in enumerate(mask.cpu())]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", MODELS)
def test_padded_batch_matches_each_sequence_alone(name, side, calls):
    # transformers' own attention on each sequence alone, against cuflash on the padded batch (the
    # tokens' positions from the mask, as generate counts them); the loss only on tokens
    model, base = build(name)
    mask = padding((20, 13, 7), 20, side)
    ids = token_ids(3, 20, 3)
    weights = draw((3, 20, COMMON["vocab_size"]), 4) * mask[..., None]
    got = logits_and_grads(model, NAME, weights, input_ids=ids, attention_mask=mask,
                           position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    assert len(calls) == len(model.model.layers)
    assert all(c["cu_seqlens_q"].tolist() == [0, 20, 33, 40] for c in calls)
    want = each_alone(model, base, weights, ids, token_spans(mask))
    assert_close(got[0], want[0], where=mask.bool())
    assert_grads_close(got[1], want[1])


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_sequences_packed_by_position_ids_match_each_alone(name, calls):
    model, base = build(name)
    ids = token_ids(1, 20, 5)
    positions = torch.cat([torch.arange(n) for n in (5, 9, 6)])[None]
    weights = draw((1, 20, COMMON["vocab_size"]), 6)
    got = logits_and_grads(model, NAME, weights, input_ids=ids, position_ids=positions, use_cache=False)
    assert all(c["cu_seqlens_q"].tolist() == [0, 5, 14, 20] for c in calls)
    want = each_alone(model, base, weights, ids, [(0, 0, 5), (0, 5, 14), (0, 14, 20)])
    assert_close(got[0], want[0])
    assert_grads_close(got[1], want[1])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_greedy_generation_of_a_left_padded_batch_matches_each_prompt_alone(name, cache, calls):
    model, base = build(name)
    lengths, n, steps = (12, 5, 9), 12, 6
    mask = padding(lengths, n, "left")
    ids = token_ids(3, n, 7) * mask
    options = dict(max_new_tokens=steps, do_sample=False, cache_implementation=cache, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=0)
    model.set_attn_implementation(NAME)
    got = model.generate(ids, attention_mask=mask, **options)
    assert len(calls) == steps * len(model.model.layers)
    model.set_attn_implementation(base)
    for b, length in enumerate(lengths):
        want = model.generate(ids[b:b + 1, n - length:], **options)
        assert torch.equal(got.sequences[b, n:], want.sequences[0, length:])
        for a, w in zip(got.logits, want.logits):
            assert_close(a[b], w[0])


def test_torch_compile_fullgraph_gives_the_same_logits_and_gradients():
    # aot_eager traces the model, the mask function and the custom ops as inductor would, without
    # compiling C++
    model, _ = build("llama")
    model.set_attn_implementation(NAME)
    ids, weights = token_ids(2, 16, 8), draw((2, 16, COMMON["vocab_size"]), 9)
    want = logits_and_grads(model, NAME, weights, input_ids=ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.zero_grad()
    logits = compiled(input_ids=ids).logits
    (logits * weights).sum().backward()
    assert torch.equal(logits, want[0])
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want[1][name]), name


# What cuflash cannot express raises, naming it

@pytest.mark.parametrize("kind", ["float", "bool"])
def test_a_4d_mask_given_to_the_model_is_its_bias(kind, calls):
    # transformers hands a 4-dim mask to the attention as it is: cuflash adds a float one to the scores,
    # its gradient flowing back to it, and leaves out the keys a bool one marks False, as SDPA does
    model, _ = build("llama")
    b, n = 2, 10
    allowed = torch.ones(n, n, dtype=torch.bool).tril().repeat(b, 1, 1, 1)
    allowed[1, :, 3:, 1] = False
    mask = allowed if kind == "bool" else draw((b, 1, n, n), 3).masked_fill(~allowed, torch.finfo(torch.float64).min)
    mask.requires_grad_(kind == "float")
    ids, weights = token_ids(b, n, 1), draw((b, n, COMMON["vocab_size"]), 2)
    results = {}
    for impl in ("sdpa", NAME):
        mask.grad = None
        logits, grads = logits_and_grads(model, impl, weights, input_ids=ids, attention_mask=mask)
        results[impl] = logits, grads, mask.grad
    assert len(calls) == len(model.model.layers)
    assert all(c["bias"].shape == (b, 1, n, n) and not c["causal"] and c["window"] is None for c in calls)
    assert_close(results[NAME][0], results["sdpa"][0])
    assert_grads_close(results[NAME][1], results["sdpa"][1])
    if kind == "float":
        assert_close(results[NAME][2], results["sdpa"][2])


def test_padding_with_holes_raises():
    model, _ = build("llama")
    model.set_attn_implementation(NAME)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 3] = 0
    with pytest.raises(NotImplementedError, match="row 1 has holes"):
        model(input_ids=token_ids(2, 8, 1), attention_mask=mask)


def test_a_mask_function_it_cannot_read_raises():
    model, _ = build("llama")
    model.set_attn_implementation(NAME)
    embeds = torch.zeros(2, 8, COMMON["hidden_size"], dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="or_masks"):
        masking_utils.create_causal_mask(model.config, embeds, None, None,
                                         or_mask_function=lambda b, h, q, kv: kv < 2)
    chunked = masking_utils.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="chunked_overlay"):
        hf.attention_mask(2, 8, 8, mask_function=chunked)


def test_dropout_in_training_is_cuflashs_dropout(calls):
    # the config's attention dropout in training, with seeds from torch's generator: torch.manual_seed
    # repeats a step bitwise (cuflash.torch's tests check the mask itself)
    model, _ = build("llama", attention_dropout=0.1)
    ids, weights = token_ids(2, 8, 1), draw((2, 8, COMMON["vocab_size"]), 2)
    evaluated = logits_and_grads(model, NAME, weights, input_ids=ids)   # eval: no dropout
    model.train()
    steps = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        steps.append(logits_and_grads(model, NAME, weights, input_ids=ids))
    layers = len(model.model.layers)
    assert [c["dropout_p"] for c in calls] == [0.0] * layers + [0.1] * 3 * layers
    assert torch.equal(steps[0][0], steps[1][0])
    assert all(torch.equal(steps[0][1][name], steps[1][1][name]) for name in steps[0][1])
    assert not torch.equal(steps[0][0], steps[2][0]) and not torch.equal(steps[0][0], evaluated[0])


class GroupedModule(Module):
    num_key_value_groups = 2   # what transformers' SDPA integration reads for GQA


@pytest.mark.parametrize("mask", ["causal", "none", "4d bool"])
def test_a_position_bias_is_added_to_the_scores_as_sdpa_adds_it(mask):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = draw((2, 4, 9, 16), 1), draw((2, 2, 9, 16), 2), draw((2, 2, 9, 8), 3)
    position_bias = draw((1, 4, 9, 9), 4)
    xs = [x.requires_grad_() for x in (q, k, v, position_bias)]
    module = GroupedModule()
    ours = theirs = None   # the masks: ours from cuflash's mask function, theirs as transformers' SDPA takes it
    if mask == "none":
        module.is_causal = False
    elif mask == "causal":
        ours = hf.attention_mask(2, 9, 9)
    else:
        ours = theirs = torch.ones(9, 9, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
        ours[0, :, 4:, :2] = False
    dout = draw((2, 9, 4, 8), 5)
    got, _ = hf.attention_forward(module, q, k, v, ours, position_bias=position_bias)
    want, _ = sdpa_attention_forward(module, q, k, v, theirs, position_bias=position_bias)
    for a, w in zip((got, *torch.autograd.grad(got, xs, dout)), (want, *torch.autograd.grad(want, xs, dout))):
        assert_close(a, w)


def test_a_position_bias_with_padding_raises():
    q = draw((3, 2, 9, 8), 1)
    mask = hf.attention_mask(3, 9, 9, attention_mask=padding([9, 4, 6], 9, "left"))
    with pytest.raises(NotImplementedError, match="position_bias to the scores of a padded batch"):
        hf.attention_forward(Module(), q, q, q, mask, position_bias=torch.zeros(1, 2, 9, 9, dtype=torch.float64))


def test_an_alibi_tensor_raises():
    q = draw((1, 2, 4, 8), 1)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        hf.attention_forward(Module(), q, q, q, None, alibi=torch.zeros(2, 1, 4))


# On a GPU: bfloat16 against transformers' own attention in bfloat16, both measured against a
# float64 run of the same weights (transformers' attention), by the accuracy criterion: c = 2 for
# the logits, 3 for the gradients, plus 4 ulps of bfloat16 at the scale of the result.

def gpu_criterion(name, ours, theirs, ref, c):
    eps = torch.finfo(torch.bfloat16).eps
    err, their_err = ((x.double() - ref).abs().max().item() for x in (ours, theirs))
    bound = c * their_err + 4 * eps * max(1.0, ref.abs().max().item())
    assert err <= bound, f"{name}: max error {err:.3g} > {c} x {their_err:.3g} + 4 ulps"


GPU_SIZES = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024,
                 initializer_range=0.05)


def check_bfloat16(name, padded, calls, device):
    overrides = dict(GPU_SIZES, head_dim=64) if name != "llama" else dict(GPU_SIZES)
    ref_model, base = build(name, device=device, **overrides)
    model = copy.deepcopy(ref_model).to(torch.bfloat16)   # the same weights, rounded
    b, n = 2, 256
    ids = token_ids(b, n, 1).to(device)
    mask = (padding((n, 173), n, "right") if padded else torch.ones(b, n, dtype=torch.long)).to(device)
    weights = draw((b, n, COMMON["vocab_size"]), 2, device=device) * mask[..., None]
    inputs = dict(input_ids=ids, attention_mask=mask)
    # the reference runs each sequence alone: eager float64 has NaN on padding rows that see no key
    ref = each_alone(ref_model, base, weights, ids, token_spans(mask))
    theirs = logits_and_grads(model, base, weights.bfloat16(), **inputs)
    ours = logits_and_grads(model, NAME, weights.bfloat16(), **inputs)
    assert len(calls) == len(model.model.layers) and all(c["q_shape"][0] == (n + 173 if padded else b) for c in calls)
    tokens = mask.bool()
    gpu_criterion("logits", ours[0][tokens], theirs[0][tokens], ref[0][tokens], 2)
    for key in ref[1]:
        gpu_criterion(key, ours[1][key], theirs[1][key], ref[1][key], 3)


@requires_gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_gpu_bfloat16_as_accurate_as_transformers_attention(name, padded, calls):
    check_bfloat16(name, padded, calls, "cuda")
