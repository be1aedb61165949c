"""Streams, threads and devices: the kernels run where CuPy says, and give the same bits there.

- cuflash launches on CuPy's current stream: work queued before it on that stream (a spin
  kernel, then the copies that write q, k, v) finishes before it reads its inputs.
- Other streams busy with large matmuls change nothing in the results.
- Many Python threads calling cuflash at once, compiling every kernel on first use, get
  correct results (the accuracy criterion of docs/contract.md) and the same bits as a serial run.
- Arrays on device 1 run on device 1; arrays on two devices are refused before any launch.
"""

from __future__ import annotations

import re
import threading
import traceback

import numpy as np
import pytest
from conftest import (
    GPU_MISSING,
    assert_close_to_reference,
    assert_lse_close,
    poisoned_allocations,
    random_array,
    requires_gpu,
    spin,
)

pytestmark = requires_gpu

if GPU_MISSING is None:
    import cupy
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    import cuflash
    from cuflash import _compile, naive, reference

N_DEVICES = cupy.cuda.runtime.getDeviceCount() if GPU_MISSING is None else 0
needs_two_gpus = pytest.mark.skipif(N_DEVICES < 2, reason="needs 2 GPUs")

DTYPES = ("float16", "bfloat16", "float32")

def forward_backward(q, k, v, dout, **mask):
    """(out, lse, dq, dk, dv), all enqueued on CuPy's current stream."""
    out, lse = cuflash.attention(q, k, v, return_lse=True, **mask)
    return (out, lse) + tuple(cuflash.attention_backward(dout, q, k, v, out, lse, **mask))


NAMES = ("out", "lse", "dq", "dk", "dv")


def assert_same_bits(name, a, b):
    a, b = cupy.asnumpy(a), cupy.asnumpy(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    differ = a.view(np.uint8) != b.view(np.uint8)
    if differ.any():
        nan = int(np.isnan(a.astype(np.float32)).sum())
        raise AssertionError(f"{name}: {int(differ.sum())} bytes differ from the reference run ({nan} NaN)")


def poisoned_like(x):
    """An uninitialized array like x, every byte 0xFF (NaN in every float dtype)."""
    y = cupy.empty_like(x)
    y.view(cupy.uint8).fill(255)
    return y


def copy_into(dst, src):
    dst.view(cupy.uint8)[...] = src.view(cupy.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_run_on_the_current_stream(dtype):
    """On a non-blocking stream: spin 0.3 s, then write q, k, v, dout, then call cuflash.
    A kernel launched on any other stream would start at once and read NaN."""
    rng = np.random.default_rng(11)
    q0 = random_array(rng, (2, 4, 300, 128), dtype)
    k0 = random_array(rng, (2, 4, 333, 128), dtype)
    v0 = random_array(rng, (2, 4, 333, 128), dtype)
    dout0 = random_array(rng, (2, 4, 300, 128), dtype)
    sources = (q0, k0, v0, dout0)
    # Compile everything this test launches now: a compile inside the stream section
    # would take longer than the spin.
    forward_backward(*(x[:1] for x in sources), causal=True)
    spin(0.0)
    q, k, v, dout = targets = tuple(cupy.empty_like(x) for x in sources)
    for dst, src in zip(targets, sources):
        copy_into(dst, src)
    # The destinations hold NaN until the stream's copies run.
    for dst in targets:
        dst.view(cupy.uint8).fill(255)
    cupy.cuda.Device().synchronize()

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        spin(0.3)
        for dst, src in zip(targets, sources):
            copy_into(dst, src)
        result = forward_backward(q, k, v, dout, causal=True)
        pending = not stream.done
    stream.synchronize()
    assert pending, "the stream finished before the host had queued everything: the test did not overlap"

    expected = forward_backward(q0, k0, v0, dout0, causal=True)  # default stream, afterwards
    for name, got, want in zip(NAMES, result, expected):
        assert_same_bits(name, got, want)
    assert np.isfinite(cupy.asnumpy(result[0]).astype(np.float32)).all()


def test_right_results_with_other_work_in_flight():
    """Three streams run large float32 matmuls while attention and its backward run on a
    fourth; the results are bitwise those of a quiet run."""
    rng = np.random.default_rng(12)
    q, k, v, dout = (random_array(rng, (2, 8, 1024, 128), "float16") for _ in range(4))
    quiet = forward_backward(q, k, v, dout, causal=True)
    cupy.cuda.Device().synchronize()

    busy = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
    keep = []
    for s in busy:
        with s:
            a = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32)
            b = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32)
            keep += [a, b] + [a @ b for _ in range(4)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        loud = forward_backward(q, k, v, dout, causal=True)
    in_flight = [not s.done for s in busy]
    stream.synchronize()
    for s in busy:
        s.synchronize()
    del keep
    assert any(in_flight), "the matmuls had finished before attention was queued: nothing overlapped"
    for name, got, want in zip(NAMES, loud, quiet):
        assert_same_bits(name, got, want)


# (dtype, head dim, causal): eight threads, three of them on one specialization
THREAD_CASES = (
    ("float16", 64, False),
    ("float16", 64, True),
    ("float16", 64, False),
    ("bfloat16", 128, True),
    ("bfloat16", 128, False),
    ("float32", 96, True),
    ("float32", 64, False),
    ("float16", 128, True),
)


def _thread_case(barrier, dtype, d, causal, seed):
    """One thread: inputs on its own stream, then (with every other thread at once) the
    first cuflash call of the process, checked against the float64 reference."""
    rng = np.random.default_rng(seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q = random_array(rng, (2, 2, 97, d), dtype)
        k = random_array(rng, (2, 2, 131, d), dtype)
        v = random_array(rng, (2, 2, 131, d), dtype)
        dout = random_array(rng, (2, 2, 97, d), dtype)
        stream.synchronize()
        barrier.wait()
        result = forward_backward(q, k, v, dout, causal=causal)
        n_out, _ = naive.attention(q, k, v, return_lse=True, causal=causal)
        out, lse = (cupy.asnumpy(x) for x in result[:2])
        n_out = cupy.asnumpy(n_out)
        hq, hk, hv = (cupy.asnumpy(x) for x in (q, k, v))
    r_out, r_lse = reference.attention(hq, hk, hv, return_lse=True, causal=causal)
    assert_close_to_reference("out", out, n_out, r_out, q.dtype, c=2)
    assert_lse_close(lse, r_lse)
    return (q, k, v, dout), result


def test_many_threads_compiling_at_once():
    _compile._functions.clear()  # every thread's first call compiles (or loads) its kernels
    n = len(THREAD_CASES)
    barrier = threading.Barrier(n, timeout=300)
    results = [None] * n
    errors = []

    def worker(i, case):
        try:
            results[i] = _thread_case(barrier, *case, seed=100 + i)
        except BaseException:  # noqa: BLE001  (reported below, with the traceback)
            barrier.abort()  # nobody waits forever for a thread that died
            errors.append(f"thread {i} {case}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=worker, args=(i, c), name=f"cuflash-{i}") for i, c in enumerate(THREAD_CASES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, "\n".join(errors)

    # the same calls again, one at a time on the default stream: the same bits
    for (dtype, d, causal), (inputs, result) in zip(THREAD_CASES, results):
        again = forward_backward(*inputs, causal=causal)
        for name, got, want in zip(NAMES, result, again):
            assert_same_bits(f"{dtype} D={d} causal={causal} {name}", got, want)


def _check_gradients(host, grads, naive_grads, r_out, r_lse, mask):
    """test_backward's criterion: c = 3, the ulps of dq and dk at the scale of the terms
    that cancel in ds = p (dp - delta)."""
    hq, hk, hv, hdo = host
    refs = reference.attention_backward(hdo, hq, hk, hv, r_out, r_lse, **mask)
    f = [np.asarray(x, dtype=np.float64) for x in host]
    scale = 1 / np.sqrt(hq.shape[-1])
    cancel = scale * (np.abs(f[3] @ np.swapaxes(f[2], -1, -2)).max() + np.abs((f[3] * r_out).sum(-1)).max())
    term_scales = (cancel * np.abs(f[1]).max(), cancel * np.abs(f[0]).max(), 0.0)
    for name, got, nv, ref, ts in zip(("dq", "dk", "dv"), grads, naive_grads, refs, term_scales):
        assert_close_to_reference(name, got, nv, ref, hq.dtype, c=3, term_scale=ts)


@needs_two_gpus
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_non_zero_device(dtype):
    rng = np.random.default_rng(13)
    mask = {"causal": True}
    with cupy.cuda.Device(1):
        q = random_array(rng, (2, 3, 150, 64), dtype)
        k = random_array(rng, (2, 3, 190, 64), dtype)
        v = random_array(rng, (2, 3, 190, 64), dtype)
        dout = random_array(rng, (2, 3, 150, 64), dtype)
        result = forward_backward(q, k, v, dout, **mask)
        n_out, _ = naive.attention(q, k, v, return_lse=True, **mask)
        n_grads = naive.attention_backward(dout, q, k, v, result[0], result[1], **mask)
        n_out, n_grads = cupy.asnumpy(n_out), [cupy.asnumpy(g) for g in n_grads]
        cupy.cuda.Device(1).synchronize()
    for name, x in zip(NAMES, result):
        assert x.device.id == 1, f"{name} is on device {x.device.id}, its inputs on device 1"

    host = [cupy.asnumpy(x) for x in (q, k, v, dout)]
    out, lse, *grads = (cupy.asnumpy(x) for x in result)
    r_out, r_lse = reference.attention(*host[:3], return_lse=True, **mask)
    assert_close_to_reference("out", out, n_out, r_out, q.dtype, c=2)
    assert_lse_close(lse, r_lse)
    _check_gradients(host, grads, n_grads, r_out, r_lse, mask)

    # called with device 0 current: runs on device 1 all the same, with the same bits
    assert cupy.cuda.Device().id == 0
    again = forward_backward(q, k, v, dout, **mask)
    for name, got, want in zip(NAMES, again, result):
        assert got.device.id == 1, f"{name} is on device {got.device.id} when device 0 was current"
        assert_same_bits(name, got, want)


@needs_two_gpus
def test_arrays_on_different_devices_are_refused(monkeypatch):
    rng = np.random.default_rng(14)
    with cupy.cuda.Device(0):
        q, v = (random_array(rng, (2, 64, 64), "float16") for _ in range(2))
        k0 = random_array(rng, (2, 64, 64), "float16")
        out, lse = cuflash.attention(q, k0, v, return_lse=True)
    with cupy.cuda.Device(1):
        k = random_array(rng, (2, 64, 64), "float16")
        dout1 = random_array(rng, (2, 64, 64), "float16")
    cupy.cuda.Device(0).synchronize()
    cupy.cuda.Device(1).synchronize()

    launched = []
    get_function = _compile.get_function

    def spy(*args, **kwargs):  # every launch fetches its kernel here first
        launched.append(args)
        return get_function(*args, **kwargs)

    monkeypatch.setattr(_compile, "get_function", spy)

    with pytest.raises(ValueError) as info:
        cuflash.attention(q, k, v)
    message = str(info.value)
    assert "device" in message, message
    assert re.search(r"\bq\b[^,;]*\b0\b", message), f"does not say q is on device 0: {message}"
    assert re.search(r"\bk\b[^,;]*\b1\b", message), f"does not say k is on device 1: {message}"

    with pytest.raises(ValueError) as info:
        cuflash.attention_backward(dout1, q, k0, v, out, lse)
    message = str(info.value)
    assert "dout" in message and "device" in message, message

    assert launched == [], f"kernels were fetched for launch before the error: {launched}"


def test_forward_without_lse_in_a_cuda_graph_and_on_two_streams():
    """Forwards without return_lse (their lse written to memory kept for the device) captured
    in a CUDA graph on a fresh stream and queued on two streams at once: the same out as
    one forward run alone."""
    rng = np.random.default_rng(11)
    problems = [tuple(random_array(rng, (2, 4, 300, 64), "float16") for _ in range(3)) for _ in range(2)]
    alone = [cupy.asnumpy(cuflash.attention(q, k, v, causal=True)) for q, k, v in problems]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    with streams[0]:
        streams[0].begin_capture()
        captured = cuflash.attention(*problems[0], causal=True)
        graph = streams[0].end_capture()
        captured.fill(np.nan)
    streams[0].synchronize()   # the poison in place before the graph writes it from the other stream
    outs = [[], []]
    for _ in range(10):
        for i, ((q, k, v), stream) in enumerate(zip(problems, streams)):
            with stream:
                outs[i].append(cuflash.attention(q, k, v, causal=True))
        with streams[1]:
            graph.launch()
    for stream in streams:
        stream.synchronize()
    assert np.array_equal(cupy.asnumpy(captured), alone[0])
    for i in range(2):
        for out in outs[i]:
            assert np.array_equal(cupy.asnumpy(out), alone[i])


def test_no_kernel_reads_the_lse_of_calls_without_return_lse(monkeypatch):
    """Issue 49: the lse of calls without return_lse goes to one buffer per device, shared by
    every stream (_launch.lse_sink), safe only while no kernel reads it back (the forward only
    writes it; split decoding merges its splits' lse from its stream's own workspace or on
    chip, and writes only the merged lse there). Here NaN goes over the whole buffer after
    every kernel launched (as a call on another stream may write it at any time), on two
    streams at once and in a CUDA graph (which holds those writes) replayed on a third:
    forwards, and decodings of 17 splits (merged through global memory, on Hopper too) and
    of 4 (on Hopper, merged in a cluster where the split model picks one); every output,
    poisoned before, against the float64 reference."""
    from cuflash import _launch

    rng = np.random.default_rng(23)
    q, k, v = (random_array(rng, (2, 4, 300, 64), "float16") for _ in range(3))
    cache_q = random_array(rng, (2, 2, 4, 1, 128), "bfloat16", 2.0)
    cache_k, cache_v = (random_array(rng, (2, 2, 1, 17 * 64, 128), "bfloat16") for _ in range(2))
    decoding = (cache_q, cache_k, cache_v)

    def calls():
        return (cuflash.attention(q, k, v, causal=True), cuflash.attention_kvcache(*decoding, num_splits=17),
                cuflash.attention_kvcache(*decoding, num_splits=4))

    refs = (reference.attention(*(cupy.asnumpy(x) for x in (q, k, v)), causal=True),
            reference.attention_kvcache(*(cupy.asnumpy(x) for x in decoding)))
    naives = (naive.attention(q, k, v, causal=True), naive.attention(*decoding))
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]   # eager, eager, graph
    for stream in streams:
        with stream:
            calls()   # (compiles; sizes the buffer; each stream's workspace)
    cupy.cuda.Device().synchronize()
    sink, (nbytes,) = _launch._sinks[cupy.cuda.Device().id]
    launched = []
    run = _launch.Launch.run

    def run_then_scribble(self, *args, **kwargs):
        run(self, *args, **kwargs)
        cupy.cuda.runtime.memsetAsync(sink, 0xFF, nbytes, cupy.cuda.get_current_stream().ptr)
        launched.append(self)

    monkeypatch.setattr(_launch.Launch, "run", run_then_scribble)
    with streams[2]:
        streams[2].begin_capture()
        graphed = calls()
        graph = streams[2].end_capture()
    assert len(launched) >= 3
    outs = []
    with poisoned_allocations():
        for _ in range(3):
            for i, stream in enumerate(streams):   # (the graph's on the stream it was captured on)
                with stream:
                    if i < 2:
                        outs.append(calls())
                        continue
                    for out in graphed:
                        out.fill(np.nan)
                    graph.launch()
                    outs.append(tuple(out.copy() for out in graphed))
    cupy.cuda.Device().synchronize()
    assert _launch._sinks[cupy.cuda.Device().id] == (sink, (nbytes,))
    for out, dec17, dec4 in outs:
        for name, x, n, ref in (("attention", out, *naives[:1], refs[0]),
                                ("splits 17", dec17, naives[1], refs[1]), ("splits 4", dec4, naives[1], refs[1])):
            assert_close_to_reference(name, cupy.asnumpy(x), cupy.asnumpy(n), ref, x.dtype, c=2)


def _counter_words(pointer):
    """The two words of a tile counter (kernels/attention/tile_queue.cuh) at ``pointer``."""
    memory = cupy.cuda.UnownedMemory(pointer, 8, None)
    return cupy.asnumpy(cupy.ndarray((2,), cupy.uint32, cupy.cuda.MemoryPointer(memory, 0))).tolist()


def test_the_persistent_forward_draws_every_tile_and_leaves_its_counter_at_zero():
    """A causal forward with many more tiles than blocks (the loading-warpgroup forward on
    Hopper, whose blocks draw their tiles from the stream's counter): the same bits call
    after call, the counter back at zero after each; captured in a CUDA graph, which gets a
    counter of its own, and replayed on another stream while the capturing stream runs the
    same call: every output still whole."""
    from cuflash import _launch

    rng = np.random.default_rng(19)
    q, k, v = (random_array(rng, (4, 16, 1024, 128), "float16") for _ in range(3))
    alone = cupy.asnumpy(cuflash.attention(q, k, v, causal=True))
    assert not np.isnan(alone.astype(np.float32)).any()
    device = cupy.cuda.Device().id
    for _ in range(3):
        assert np.array_equal(cupy.asnumpy(cuflash.attention(q, k, v, causal=True)), alone)
        for pointer, _sizes in list(_launch._tile_counters.values()):
            assert _counter_words(pointer) == [0, 0]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    with streams[0]:
        cuflash.attention(q, k, v, causal=True)   # the stream's own counter, before the capture
        eager_counter = _launch.tile_counter(cupy, device)
        streams[0].begin_capture()
        captured = cuflash.attention(q, k, v, causal=True)
        graph = streams[0].end_capture()
        captured.fill(np.nan)
    streams[0].synchronize()
    outs = []
    for _ in range(10):
        with streams[0]:
            outs.append(cuflash.attention(q, k, v, causal=True))
        with streams[1]:
            graph.launch()
    for stream in streams:
        stream.synchronize()
    assert np.array_equal(cupy.asnumpy(captured), alone)
    for out in outs:
        assert np.array_equal(cupy.asnumpy(out), alone)
    assert _counter_words(eager_counter) == [0, 0]
