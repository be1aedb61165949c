"""The backward against cuDNN's own deterministic algorithm.

torch SDPA's cuDNN backend runs cuDNN's default SDPA backward, which adds dq up in any order
(it repeats only to within rounding); cuflash's default backward repeats bit for bit. cuDNN
has a deterministic algorithm too, which torch does not ask for: cudnn-frontend's graph API
selects it with ``use_deterministic_algorithm=True``. This script times, at the grid's shapes
(batch 16384 / N, heads 2048 / D, layout (B, H, N, D)), the backward of

- cuflash (deterministic, the default) and cuflash with ``deterministic=False``,
- torch SDPA's cuDNN backend (autograd, as bench_attention.py times it),
- cudnn-frontend's SDPA backward graph, its default algorithm and its deterministic one
  (out and stats from cudnn-frontend's forward graph on the same inputs),

and checks whether each cuDNN graph gives the same dq twice. Needs torch and the frontend's
Python package (``nvidia-cudnn-frontend``, imported after torch so that both use one libcudnn).

    python bench/cudnn_deterministic.py [--dtype float16] [--head-dims 64 128 256]
        [--seqlens 2048 16384] [--causal 0 1] [--repeat 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402

try:
    cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
except RuntimeError as err:
    sys.exit(f"cudnn_deterministic.py: {err}")

import bench_attention as ba  # noqa: E402, I001  (this directory)


def cudnn_graphs(cudnn, torch, q, k, v, do, causal):
    """cudnn-frontend's forward graph and its backward graphs (default and deterministic
    algorithm) for these torch tensors; each backward is None where cuDNN has no plan."""
    io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[q.dtype]
    scale = 1.0 / math.sqrt(q.shape[-1])

    def new_graph():
        return cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                             compute_data_type=cudnn.data_type.FLOAT)

    def build(graph):
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        return graph

    out = torch.empty_like(q)
    stats = torch.empty(q.shape[:-1] + (1,), dtype=torch.float32, device=q.device)
    fwd = new_graph()
    tq, tk, tv = (fwd.tensor_like(x) for x in (q, k, v))
    to, ts = fwd.sdpa(name="sdpa", q=tq, k=tk, v=tv, is_inference=False, attn_scale=scale,
                      use_causal_mask=causal)
    to.set_output(True).set_dim(out.size()).set_stride(out.stride())
    ts.set_output(True).set_dim(stats.size()).set_stride(stats.stride()).set_data_type(cudnn.data_type.FLOAT)
    forward = (build(fwd), {tq: q, tk: k, tv: v, to: out, ts: stats})

    grads = tuple(torch.empty_like(x) for x in (q, k, v))
    backwards = {}
    for deterministic in (False, True):
        try:
            g = new_graph()
            bq, bk, bv, bo, bdo, bs = (g.tensor_like(x) for x in (q, k, v, out, do, stats))
            dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bs,
                                         attn_scale=scale, use_causal_mask=causal,
                                         use_deterministic_algorithm=deterministic)
            for t, x in zip((dq, dk, dv), grads):
                t.set_output(True).set_dim(x.size()).set_stride(x.stride())
            pack = {bq: q, bk: k, bv: v, bo: out, bdo: do, bs: stats, dq: grads[0], dk: grads[1], dv: grads[2]}
            backwards[deterministic] = (build(g), pack)
        except Exception as err:   # no plan for this cell
            ba.log(f"  cudnn-fe deterministic={deterministic}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            backwards[deterministic] = None
    return forward, backwards, grads[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["float16"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[2048, 16384])
    ap.add_argument("--causal", nargs="+", type=int, choices=(0, 1), default=[0, 1])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    if ba.torch is None:
        sys.exit("cudnn_deterministic.py: needs torch")
    torch = ba.torch
    try:
        import cudnn   # after torch: the frontend opens the libcudnn torch loaded
    except ImportError as err:
        sys.exit(f"cudnn_deterministic.py: needs cudnn-frontend's Python package (nvidia-cudnn-frontend): {err}")

    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    rows = []
    names = ("cuflash", "cuflash-any", "torch-cudnn", "cudnn-fe", "cudnn-fe-det")
    print("| dtype | D | causal | N | " + " | ".join(names) + " | det / det | det / torch-cudnn | any / torch-cudnn"
          " | cudnn-fe repeats (default, det) |")
    print("|" + "---|" * (4 + len(names) + 4))
    for dt in args.dtype:
        for d in args.head_dims:
            for n in args.seqlens:
                for causal in map(bool, args.causal):
                    b, h = 16384 // n, 2048 // d
                    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                    data = ba.make_inputs(b, h, n, d, dt)
                    ms = {"cuflash": ba.time_attention(cuflash, data, causal, "bwd", args.repeat),
                          "cuflash-any": ba.time_attention(cuflash, data, causal, "bwd", args.repeat,
                                                           deterministic=False),
                          "torch-cudnn": ba.time_torch(ba.TORCH_BACKENDS["torch-cudnn"], data, causal, "bwd",
                                                       args.repeat)}
                    sets = [tuple(torch.from_dlpack(x) for x in item) for item in data]
                    built = [cudnn_graphs(cudnn, torch, *s, causal) for s in sets]
                    workspace_size = max(g.get_workspace_size() for f, bw, _ in built
                                         for g, _ in [f] + [x for x in bw.values() if x])
                    workspace = torch.empty(workspace_size, device="cuda", dtype=torch.uint8)
                    for (graph, pack), _, _ in built:
                        graph.execute(pack, workspace, handle=handle)
                    repeats = {}
                    for deterministic, name in ((False, "cudnn-fe"), (True, "cudnn-fe-det")):
                        if any(bw[deterministic] is None for _, bw, _ in built):
                            continue
                        runs = [bw[deterministic] for _, bw, _ in built]
                        ms[name] = ba.median_ms(lambda g, pack, ws=workspace: g.execute(pack, ws, handle=handle),
                                                runs, args.repeat)
                        graph, pack = runs[0]
                        dq = built[0][2]
                        graph.execute(pack, workspace, handle=handle)
                        first = dq.clone()
                        graph.execute(pack, workspace, handle=handle)
                        repeats[name] = bool(torch.equal(first, dq))
                    tf = {k_: flops / v_ / 1e9 for k_, v_ in ms.items()}
                    row = {"dtype": dt, "D": d, "causal": causal, "N": n, "B": b, "H": h, "tflops": tf,
                           "cudnn_fe_repeats": repeats}
                    rows.append(row)

                    def ratio(a, c):
                        return f"{tf[a] / tf[c]:.2f}" if a in tf and c in tf else ""

                    print(f"| {dt} | {d} | {int(causal)} | {n} | "
                          + " | ".join(f"{tf[k_]:.0f}" if k_ in tf else "no plan" for k_ in names)
                          + f" | {ratio('cuflash', 'cudnn-fe-det')} | {ratio('cuflash', 'torch-cudnn')}"
                          f" | {ratio('cuflash-any', 'torch-cudnn')}"
                          f" | {repeats.get('cudnn-fe', '')}, {repeats.get('cudnn-fe-det', '')} |", flush=True)
                    del data, sets, built, workspace
                    ba.free()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": ba.run_meta(args.repeat, cudnn_frontend=cudnn.__version__,
                                           cudnn_backend=cudnn.backend_version()), "rows": rows}, f, indent=1)
    cudnn.destroy_handle(handle)


if __name__ == "__main__":
    main()
