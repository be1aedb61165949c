"""Small forward and backward calls over every dtype, head dim and mask, for compute-sanitizer.

    bash tools/sanitize.sh [OUTDIR]        # memcheck, racecheck, initcheck, synccheck
    compute-sanitizer --tool memcheck python3 tools/sanitize_cases.py [GROUP ...]

GROUPs (default all): plain, kvcache, modifiers.

Covers float16, bfloat16 and float32; D in {64, 128, 256}; no mask, causal and a window;
odd lengths (Nq = 67, Nk = 93); Nq > Nk with causal (rows that see no key) and with a
window; a GQA broadcast (k, v shared by 3 query heads); D != Dv (40 and 72, both padded
to the 96 head-dim bucket) on strided (B, N, H, D) -> (B, H, N, D) views; head dims that are
not a multiple of 8 (59 and 13, zero-padded into copies); packed variable-length sequences
(empty ones, ones without keys, GQA with groups split over blocks), many short sequences
(forward blocks that run several tiles each), the Hopper forward's longer tiles (three
computing warpgroups, 176-key blocks, head dim 256 through maps) and packed calls with
bad offsets under check=False (the backward given initialized out and lse, since rows no
sequence owns are left unwritten by the forward), and the backward with deterministic=False
where it adds dq up in the dk/dv pass. Each case runs the forward and the backward
(attention_vjp).

CuPy's memory pool is switched off, so that every array is its own cudaMalloc: memcheck
then sees an access past the end of any array, and initcheck a read of bytes nothing
wrote (a pool hands out blocks that earlier arrays initialized). Exits 1 if any output
or gradient is not finite.
"""

import itertools
import sys

import cupy
import ml_dtypes  # noqa: F401
import numpy as np

import cuflash

cupy.cuda.set_allocator(None)
rng = np.random.default_rng(0)


def randn(shape, dtype):
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def run_case(label, q, k, v, deterministic=True, **mask):
    """Forward and backward; True when out, dq, dk, dv (and dbias, dsinks where asked) are all finite."""
    out, vjp = cuflash.attention_vjp(q, k, v, deterministic=deterministic, **mask)
    grads = vjp(randn(out.shape, q.dtype))
    cupy.cuda.Device().synchronize()
    names = ("out", "dq", "dk", "dv") + ("dbias",) * bool(mask.get("bias_grad")) + ("dsinks",) * ("sinks" in mask) \
        + tuple(f"d(array {i})" for i in range(len(mask.get("score_mod_grads") or ())))
    assert len(names) == 1 + len(grads), f"{label}: {len(grads)} gradients, not {len(names) - 1}"
    bad = [
        name
        for name, x in zip(names, (out,) + tuple(grads))
        if not bool(cupy.isfinite(x.astype(np.float32)).all())
    ]
    print(f"{label:58s} {'finite' if not bad else 'NOT FINITE: ' + ', '.join(bad)}", flush=True)
    return not bad


MASKS = (("no mask", {}), ("causal", {"causal": True}), ("window (17, 5)", {"window": (17, 5)}))


def plain_cases():
    ok = True
    for dtype in ("float16", "bfloat16", "float32"):
        for d in (64, 128, 256):
            for name, mask in MASKS:
                q, k, v = randn((2, 67, d), dtype), randn((2, 93, d), dtype), randn((2, 93, d), dtype)
                ok &= run_case(f"{dtype} D={d} Nq=67 Nk=93 {name}", q, k, v, **mask)
        # Nq > Nk: with causal the first 26 rows see no key (out 0, zero gradients)
        for name, mask in (("causal", {"causal": True}), ("window (9, 3)", {"window": (9, 3)})):
            q, k, v = randn((2, 93, 64), dtype), randn((2, 67, 64), dtype), randn((2, 67, 64), dtype)
            ok &= run_case(f"{dtype} D=64 Nq=93 Nk=67 {name}", q, k, v, **mask)
        # GQA: (B, Hkv, G, N, D) queries against (B, Hkv, 1, N, D) keys and values
        q = randn((2, 2, 3, 67, 64), dtype)
        k, v = randn((2, 2, 1, 93, 64), dtype), randn((2, 2, 1, 93, 64), dtype)
        ok &= run_case(f"{dtype} D=64 GQA 2x3 heads causal", q, k, v, causal=True)
        # head dim 64 with more than 128 keys (on Hopper the forward with a loading warpgroup)
        q, k, v = randn((2, 67, 64), dtype), randn((2, 300, 64), dtype), randn((2, 300, 64), dtype)
        ok &= run_case(f"{dtype} D=64 Nq=67 Nk=300 window (17, 5)", q, k, v, window=(17, 5))
        # D = 40, Dv = 72 (both padded to the 96 bucket), (B, N, H, D) storage read as (B, H, N, D)
        q = randn((2, 67, 3, 40), dtype).transpose(0, 2, 1, 3)
        k = randn((2, 93, 3, 40), dtype).transpose(0, 2, 1, 3)
        v = randn((2, 93, 3, 72), dtype).transpose(0, 2, 1, 3)
        ok &= run_case(f"{dtype} D=40 Dv=72 strided window (30, None)", q, k, v, window=(30, None))
        # D = 59, Dv = 13: zero-padded copies (to 64 and 16), the padding sliced off the results
        q, k, v = randn((2, 67, 59), dtype), randn((2, 93, 59), dtype), randn((2, 93, 13), dtype)
        ok &= run_case(f"{dtype} D=59 Dv=13 (padded) causal", q, k, v, causal=True)

    # packed sequences: lengths with zeros, GQA 4:1, causal; and groups split over blocks (MQA, few keys)
    for dtype in ("float16", "bfloat16", "float32"):
        lengths_q, lengths_k = [70, 0, 5, 130, 64], [70, 9, 0, 200, 1]
        cu_q = cupy.asarray(np.cumsum([0] + lengths_q), dtype=cupy.int32)
        cu_k = cupy.asarray(np.cumsum([0] + lengths_k), dtype=cupy.int32)
        q = randn((2, 4, sum(lengths_q), 128), dtype)
        k, v = randn((2, 1, sum(lengths_k), 128), dtype), randn((2, 1, sum(lengths_k), 128), dtype)
        ok &= run_case(f"{dtype} D=128 packed GQA 2x4 causal", q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        q, k, v = randn((1, 16, 256, 64), dtype), randn((1, 1, 256, 64), dtype), randn((1, 1, 256, 64), dtype)
        ok &= run_case(f"{dtype} D=64 MQA 16:1 split groups causal", q, k, v, causal=True)

    # many short sequences, more tiles than fit at once: at D = 128 each block of the forward runs
    # several in turn; at D = 64 with at most 128 keys, blocks of one warpgroup run one each
    for d, n, mask in ((64, 100, {"causal": True}), (128, 190, {})):
        q, k, v = (randn((64, 8, n, d), "bfloat16") for _ in range(3))
        ok &= run_case(f"bfloat16 D={d} 64x8 heads N={n} many short tiles {mask}", q, k, v, **mask)

    # head dim 64 from 2048 queries: on Hopper the dk/dv pass with a loading warpgroup
    for mask in ({"causal": True}, {"window": (300, 20)}):
        q = randn((1, 2, 2100, 64), "bfloat16")
        k, v = randn((1, 2, 2050, 64), "bfloat16"), randn((1, 2, 2050, 64), "bfloat16")
        ok &= run_case(f"bfloat16 D=64 Nq=2100 Nk=2050 {mask}", q, k, v, **mask)
        # and with dq added up by that pass (deterministic=False: rows in multiples of 16)
        ok &= run_case(f"bfloat16 D=64 Nq=2064 Nk=2050 {mask} any order", q[:, :, :2064], k, v, False, **mask)
    # and at head dim 128 (three stages of queries there; a strided view, grouped queries 2:1)
    q = randn((1, 1, 2, 2080, 128), "float16")
    k, v = randn((1, 1, 1, 2050, 128), "float16"), randn((1, 1, 1, 2050, 128), "float16")
    ok &= run_case("float16 D=128 Nq=2064 Nk=2050 GQA 2:1 causal any order", q[..., :2064, :], k, v, False, causal=True)

    # the Hopper forward's longer tiles: three computing warpgroups at D = 64 from 2048 keys,
    # 176-key blocks at D = 128 under a causal mask from 8192 keys, D = 256 through maps
    for d, (nq, nk), mask in ((64, (2100, 2100), {}), (64, (2100, 2100), {"causal": True}),
                              (128, (300, 8300), {"causal": True}), (256, (600, 600), {"causal": True})):
        q = randn((1, 2, nq, d), "float16")
        k, v = randn((1, 2, nk, d), "float16"), randn((1, 2, nk, d), "float16")
        ok &= run_case(f"float16 D={d} Nq={nq} Nk={nk} {mask}", q, k, v, **mask)

    # bad offsets, check=False: wrong rows, but no access outside the arrays
    for cu, d in itertools.product(([0, 300, 100, 5000], [-7, 120, 2**31 - 1], [0, 2**31 - 1, 0, 2**31 - 1]), (64, 128)):
        cu = cupy.asarray(cu, dtype=cupy.int32)
        q, k, v, dout = (randn((2, 400, d), "float16") for _ in range(4))
        seqs = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "check": False}
        cuflash.attention(q, k, v, causal=True, **seqs)
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)   # every row written
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **seqs)
        cupy.cuda.Device().synchronize()
        print(f"bad offsets {cu.get().tolist()} D={d} check=False: ran", flush=True)

    return ok


def kvcache_cases():
    ok = True
    # the KV cache: appends and decoding, contiguous and paged (page size 7: rows across pages;
    # 16: runs of 16 rows, each copied by threads of its own, under 8 and 32 query rows per block),
    # GQA, forced splits (merged in clusters and not); then bad lengths and pages under check=False
    # (clamped, inside the arrays)
    for dtype in ("float16", "bfloat16", "float32"):
        q = randn((3, 2, 4, 2, 64), dtype)
        k, v = randn((3, 2, 1, 300, 64), dtype), randn((3, 2, 1, 300, 64), dtype)
        kn, vn = randn((3, 2, 1, 2, 64), dtype), randn((3, 2, 1, 2, 64), dtype)
        lengths = cupy.asarray([0, 150, 298], dtype=cupy.int32)
        for splits in (1, 3):
            out = cuflash.attention_kvcache(q, k, v, k_new=kn, v_new=vn, cache_seqlens=lengths, causal=True,
                                            num_splits=splits)
            ok &= bool(cupy.isfinite(out.astype(cupy.float32)).all())
        # (on Hopper, 3 splits merge in a cluster; 32, past the largest cluster, in clusters and
        # then through global memory; 17, a prime past it, through global memory alone)
        for splits, nk in ((32, 4096), (17, 17 * 128)):
            long_k, long_v = randn((1, 2, 1, nk, 64), dtype), randn((1, 2, 1, nk, 64), dtype)
            out = cuflash.attention_kvcache(q[:1], long_k, long_v, num_splits=splits)
            ok &= bool(cupy.isfinite(out.astype(cupy.float32)).all())
        bad = cupy.asarray([-9, 5000, 2**31 - 1], dtype=cupy.int32)
        for page_size, rows in ((7, q), (16, q), (16, randn((3, 2, 8, 4, 64), dtype))):
            per_seq = -(-300 // page_size)
            pages = (randn((3 * per_seq + 11, 2, 1, page_size, 64), dtype),
                     randn((3 * per_seq + 11, 2, 1, page_size, 64), dtype))
            table = cupy.asarray(np.random.default_rng(0).permutation(3 * per_seq).reshape(3, per_seq), dtype=cupy.int32)
            out = cuflash.attention_kvcache(rows, *pages, k_new=kn, v_new=vn, cache_seqlens=lengths, block_table=table)
            ok &= bool(cupy.isfinite(out.astype(cupy.float32)).all())
            bad_table = cupy.asarray(np.full((3, per_seq), 7, dtype=np.int32) * np.array([[-1], [1], [99]], dtype=np.int32))
            cuflash.attention_kvcache(rows, *pages, k_new=kn, v_new=vn, cache_seqlens=bad, block_table=bad_table,
                                      check=False)
        cuflash.attention_kvcache(q, k, v, k_new=kn, v_new=vn, cache_seqlens=bad, check=False)
        cupy.cuda.Device().synchronize()
        print(f"{dtype} KV cache: appends, decoding, paged, splits, bad lengths with check=False: ran", flush=True)

    return ok


def modifier_cases():
    """softcap, ALiBi and sinks together on each dtype, head dim and mask; one at a time on
    grouped queries (values per query head), rows that see no key, padded and strided head
    dims and packed sequences; a bias broadcast over the batch with its gradient (read from
    global memory, and through shared memory), dropout, and dropout on packed sequences, on
    each dtype; score and mask functions, forward and backward (and the gradient of a table the
    score function reads), and a block mask; the Hopper kernels' longer tiles with all
    three; and the KV cache with all three."""
    ok = True

    def slopes_and_sinks(shape):
        return {"alibi_slopes": cupy.asarray(rng.uniform(0.01, 0.5, shape).astype(np.float32)),
                "sinks": cupy.asarray(rng.normal(0, 2, shape).astype(np.float32))}

    for dtype in ("float16", "bfloat16", "float32"):
        for d in (64, 128, 256):
            for name, mask in MASKS:
                q, k, v = randn((2, 67, d), dtype), randn((2, 93, d), dtype), randn((2, 93, d), dtype)
                mods = {"softcap": 30.0, **slopes_and_sinks((2,))}
                ok &= run_case(f"{dtype} D={d} Nq=67 Nk=93 {name} softcap+alibi+sinks", q, k, v, **mask, **mods)
        q = randn((2, 2, 3, 67, 64), dtype)
        k, v = randn((2, 2, 1, 93, 64), dtype), randn((2, 2, 1, 93, 64), dtype)
        for key, value in slopes_and_sinks((2, 3)).items():   # (Hkv, G) values, broadcast over B
            ok &= run_case(f"{dtype} D=64 GQA 2x3 heads causal {key}", q, k, v, causal=True, **{key: value})
        q, k, v = randn((2, 93, 128), dtype), randn((2, 67, 128), dtype), randn((2, 67, 128), dtype)
        ok &= run_case(f"{dtype} D=128 Nq=93 Nk=67 causal sinks", q, k, v, causal=True, **slopes_and_sinks((2,)))
        q = randn((2, 67, 3, 40), dtype).transpose(0, 2, 1, 3)
        k = randn((2, 93, 3, 40), dtype).transpose(0, 2, 1, 3)
        v = randn((2, 93, 3, 72), dtype).transpose(0, 2, 1, 3)
        ok &= run_case(f"{dtype} D=40 Dv=72 strided window (30, None) softcap", q, k, v, window=(30, None), softcap=2.0)
        q, k, v = randn((2, 67, 59), dtype), randn((2, 93, 59), dtype), randn((2, 93, 13), dtype)
        ok &= run_case(f"{dtype} D=59 Dv=13 (padded) causal alibi", q, k, v, causal=True,
                       alibi_slopes=slopes_and_sinks((2,))["alibi_slopes"])
        lengths_q, lengths_k = [70, 0, 5, 130, 64], [70, 9, 0, 200, 1]
        cu_q = cupy.asarray(np.cumsum([0] + lengths_q), dtype=cupy.int32)
        cu_k = cupy.asarray(np.cumsum([0] + lengths_k), dtype=cupy.int32)
        for d in (64, 128):
            q = randn((2, 4, sum(lengths_q), d), dtype)
            k, v = randn((2, 1, sum(lengths_k), d), dtype), randn((2, 1, sum(lengths_k), d), dtype)
            ok &= run_case(f"{dtype} D={d} packed GQA 2x4 causal softcap+alibi+sinks", q, k, v, causal=True,
                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softcap=30.0, **slopes_and_sinks((4,)))
        # dropout on packed sequences (positions in the packed arrays), with ALiBi and sinks, on the
        # D = 128 arrays of the last pass
        ok &= run_case(f"{dtype} D=128 packed GQA 2x4 causal dropout 0.3+alibi+sinks", q, k, v, causal=True,
                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, dropout_p=0.3, seed=2**64 - 1, **slopes_and_sinks((4,)))
        # a bias of the inputs' dtype broadcast over B, (H, Nq, Nk), with its gradient (summed over B)
        # under a window; dropout under a causal mask with a seed over 64 bits
        q, k, v = randn((2, 3, 67, 64), dtype), randn((2, 3, 93, 64), dtype), randn((2, 3, 93, 64), dtype)
        ok &= run_case(f"{dtype} D=64 Nq=67 Nk=93 window (17, 5) bias (3, Nq, Nk) with dbias", q, k, v,
                       window=(17, 5), bias=randn((3, 67, 93), dtype), bias_grad=True)
        ok &= run_case(f"{dtype} D=64 Nq=67 Nk=93 causal dropout 0.2", q, k, v, causal=True, dropout_p=0.2,
                       seed=0x9E3779B97F4A7C15)
        # the bias through shared memory (keys a multiple of 8, rows on 16-byte boundaries) at D 128
        q, k, v = randn((2, 3, 67, 128), dtype), randn((2, 3, 96, 128), dtype), randn((2, 3, 96, 128), dtype)
        ok &= run_case(f"{dtype} D=128 Nq=67 Nk=96 causal bias (3, Nq, Nk) staged, with dbias", q, k, v,
                       causal=True, bias=randn((3, 67, 96), dtype), bias_grad=True)
        if dtype != "float32":   # score and mask functions, forward and backward, reading a captured table
            table = cupy.asarray(rng.standard_normal((3, 67 + 96 - 1)).astype(np.float32))
            ok &= run_case(f"{dtype} D=128 Nq=67 Nk=96 score_mod (table) + mask_mod", q, k, v,
                           score_mod=lambda s, b, h, i, j: s + table[h, i - j + 95],
                           mask_mod=lambda b, h, i, j: (j <= i + 29) & ((i + j) % 5 != 0))
            # with the table's gradient (the dq pass's atomic adds), at D 128 and 64 (the portable
            # passes on Hopper there)
            for dd in (128, 64):
                ok &= run_case(f"{dtype} D={dd} Nq=67 Nk=96 score_mod (table) with its gradient", q[..., :dd],
                               k[..., :dd], v[..., :dd], score_mod=lambda s, b, h, i, j: s + table[h, i - j + 95],
                               score_mod_grads=[table], causal=True)
            # its block mask, broadcast over B, of blocks that do not line up with the kernels' tiles
            blocks = cuflash.block_mask(lambda b, h, i, j: (j <= i - 20 * h) | (j < 3), (1, 3), 67, 96, block=(24, 40))
            ok &= run_case(f"{dtype} D=128 Nq=67 Nk=96 block mask (1, 3) of 24 x 40 blocks", q, k, v, block_mask=blocks)
    # the Hopper kernels' longer tiles: the forward on a loading warpgroup at D = 64 past 128
    # keys and 176-key blocks at D = 128 from 8192 keys, D = 256 through maps; the dk/dv pass
    # on a loading warpgroup at D = 64 from 2048 queries
    for d, (nq, nk), mask in ((64, (2100, 2100), {}), (64, (2100, 2050), {"causal": True}),
                              (128, (300, 8300), {"causal": True}), (256, (600, 600), {"causal": True})):
        q = randn((1, 2, nq, d), "float16")
        k, v = randn((1, 2, nk, d), "float16"), randn((1, 2, nk, d), "float16")
        mods = {"softcap": 30.0, **slopes_and_sinks((2,))}
        ok &= run_case(f"float16 D={d} Nq={nq} Nk={nk} {mask} softcap+alibi+sinks", q, k, v, **mask, **mods)
    # the KV cache with all three (values per query head of GQA 2x4): appends, an empty cache,
    # contiguous and paged (7 rows: read row by row; 16: run by run), causal, splits 1 and 3
    for dtype in ("float16", "bfloat16", "float32"):
        q = randn((3, 2, 4, 2, 64), dtype)
        kn, vn = randn((3, 2, 1, 2, 64), dtype), randn((3, 2, 1, 2, 64), dtype)
        lengths = cupy.asarray([0, 150, 298], dtype=cupy.int32)
        mods = {"softcap": 30.0, **slopes_and_sinks((2, 4))}
        for page_size in (None, 7, 16):
            paged, shape = {}, (3, 2, 1, 300, 64)
            if page_size is not None:
                per_seq = -(-300 // page_size)
                table = np.random.default_rng(1).permutation(3 * per_seq).reshape(3, per_seq)
                paged, shape = {"block_table": cupy.asarray(table, dtype=cupy.int32)}, (3 * per_seq + 5, 2, 1, page_size, 64)
            k, v = randn(shape, dtype), randn(shape, dtype)
            for splits in (1, 3):
                out = cuflash.attention_kvcache(q, k, v, k_new=kn, v_new=vn, cache_seqlens=lengths, causal=True,
                                                num_splits=splits, **paged, **mods)
                ok &= bool(cupy.isfinite(out.astype(cupy.float32)).all())
        cupy.cuda.Device().synchronize()
        print(f"{dtype} KV cache softcap+alibi+sinks: contiguous, paged, splits 1 and 3: "
              f"{'finite' if ok else 'NOT FINITE'}", flush=True)
    return ok


GROUPS = {"plain": plain_cases, "kvcache": kvcache_cases, "modifiers": modifier_cases}
if __name__ == "__main__":
    unknown = [g for g in sys.argv[1:] if g not in GROUPS]
    if unknown:
        sys.exit(f"sanitize_cases.py: no group {unknown[0]!r} (groups: {' '.join(GROUPS)})")
    ok = all([GROUPS[g]() for g in (sys.argv[1:] or GROUPS)])
    print("all outputs finite" if ok else "SOME OUTPUTS ARE NOT FINITE", flush=True)
    sys.exit(0 if ok else 1)
