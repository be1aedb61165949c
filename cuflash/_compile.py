"""Run-time compilation of the CUDA kernels through NVRTC (``cupy.RawModule``).

The headers in ``kernels/`` (``arch/``: instruction wrappers; ``attention/``: parameters,
masks, softmax, tile configs, schedulers; ``prefill/`` and ``decode/``: the kernels) are
joined, in the fixed order of ``KERNEL_FILES``,
into one source string. CuPy's disk cache keys on that string and on the
options, so editing any kernel file recompiles what it touches. Each
specialization (one kernel template instantiation) is its own module,
compiled on first use and kept per device.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from pathlib import Path

from . import _params

KERNEL_FILES = (
    # arch/: instruction wrappers and element types
    "arch/common.cuh",
    "attention/params.cuh",
    "arch/smem.cuh",
    "arch/mma.cuh",
    "arch/wgmma.cuh",
    "arch/mbarrier.cuh",
    "arch/tma.cuh",
    "arch/grid_dependency.cuh",
    "arch/cluster.cuh",
    # attention/: what every kernel shares
    "attention/mask.cuh",
    "attention/softmax.cuh",
    "attention/dropout.cuh",
    "attention/score_path.cuh",
    "attention/tile_config.cuh",
    "attention/schedule.cuh",
    "attention/tile_queue.cuh",
    # prefill/ and decode/: the kernels
    "prefill/reduce.cuh",
    "decode/merge.cuh",
    "decode/decode.cuh",
    "prefill/attn_fwd.cuh",
    "prefill/attn_fwd_sm90.cuh",
    "prefill/attn_fwd_sm90_ws.cuh",
    "prefill/attn_bwd.cuh",
    "prefill/attn_bwd_sm90.cuh",
    "prefill/attn_bwd_sm90_ws.cuh",
)


def kernel_dir() -> Path:
    """Where the CUDA sources are: inside the installed package, else the source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / KERNEL_FILES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"cuflash kernel sources not found next to {here}")


@functools.lru_cache(maxsize=None)
def kernel_source() -> str:
    """The whole CUDA source as one self-contained translation unit."""
    root = kernel_dir()
    parts = [f"// ---- {name} ----\n{(root / name).read_text()}" for name in KERNEL_FILES]
    return "\n".join(parts)


def nvrtc_options(arch: str) -> tuple[str, ...]:
    """NVRTC options for a target such as ``"sm_80"`` or ``"sm_90a"``."""
    return (f"-arch={arch}",) + _common_options()


def _common_options() -> tuple[str, ...]:
    return (
        "--std=c++17",
        f"-DCUFLASH_PARAMS_BYTES={_params.PARAMS_DTYPE.itemsize}",
        f"-DCUFLASH_BWD_PARAMS_BYTES={_params.BWD_PARAMS_DTYPE.itemsize}",
        f"-DCUFLASH_DECODE_PARAMS_BYTES={_params.DECODE_PARAMS_DTYPE.itemsize}",
        f"-DCUFLASH_WS_PARAMS_BYTES={_params.WS_PARAMS_DTYPE.itemsize}",
        f"-DCUFLASH_SCHEDULE_THREADS={_params.SCHEDULE_THREADS}",
    )


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def target_arch(compute_capability: str) -> str:
    """The architecture to build for on a device of this compute capability.

    Hopper gets ``sm_90a`` (its own instructions) when NVRTC is 12.9 or newer,
    the first release that accepts a second ``-arch`` beside the one CuPy adds.
    """
    cc = int(compute_capability)
    if cc < 80:
        raise RuntimeError(
            f"cuflash needs a GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper); "
            f"this device has {cc // 10}.{cc % 10}"
        )
    if cc == 90 and nvrtc_version() >= (12, 9):
        return "sm_90a"
    return f"sm_{cc}"


def _module_options(arch: str) -> tuple[str, ...]:
    # CuPy adds its own -arch for the current device; NVRTC before 12.9
    # rejects a repeated option, so name the arch only where it is accepted.
    if nvrtc_version() >= (12, 9):
        return nvrtc_options(arch)
    return _common_options()


_lock = threading.Lock()
_functions: dict[tuple[int, str, str | None], object] = {}
_smem_limits: dict[tuple[int, str], int] = {}   # each function's dynamic shared-memory limit, as raised


_arch_by_device: dict[int, str] = {}


def current_arch() -> str:
    """The architecture kernels are built for on the current device."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    arch = _arch_by_device.get(device)
    if arch is None:
        arch = _arch_by_device[device] = target_arch(cupy.cuda.Device(device).compute_capability)
    return arch


DEFAULT_SMEM_LIMIT = 48 * 1024   # a kernel's dynamic shared-memory limit until raised


_building: dict = {}   # (id of a cache, key) -> Future of its build under way


def _once(cache: dict, key, build):
    """``cache[key]``, made by ``build()`` at the first call for ``key``: once, however many
    threads ask; a thread asking while another builds it waits for that build (builds of other
    keys go on beside it: NVRTC releases the GIL)."""
    fn = cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = cache.get(key)
        if fn is not None:
            return fn
        future = _building.get((id(cache), key))
        mine = future is None
        if mine:
            future = _building[id(cache), key] = concurrent.futures.Future()
    if not mine:
        return future.result()
    try:
        fn = build()
    except BaseException as error:
        with _lock:
            del _building[id(cache), key]
        future.set_exception(error)
        raise
    with _lock:
        cache[key] = fn
        del _building[id(cache), key]
    future.set_result(fn)
    return fn


_compiler_pool = None


def compile_soon(name_expressions, user) -> None:
    """Starts compiling the kernels ``name_expressions`` (with ``user``, as `get_function` takes
    it) for the current device on other threads, so that a later `get_function` of each finds it
    compiled or waits for its compile; one not ready later is then compiled where asked, and an
    error is raised there (here none)."""
    import cupy

    global _compiler_pool
    with _lock:
        if _compiler_pool is None:
            _compiler_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="cuflash-compile")
    device = cupy.cuda.runtime.getDevice()

    def compile_one(name):
        with cupy.cuda.Device(device):
            get_function(name, 0, user)

    for name in name_expressions:
        key = (device, name, None if user is None else user.key)
        if key not in _functions and (id(_functions), key) not in _building:
            _compiler_pool.submit(compile_one, name)


def user_kernel_source(source, fast: bool = False) -> str:
    """The kernels' source followed by a call's score and mask functions (_codegen.Source of
    user_mods_source), the block mask's lookup and the score path that calls them
    (kernels/user/block_tiles.cuh, user_scores.cuh); ``fast``: the functions' exp, log, tanh and
    division in the hardware's approximate forms (_codegen.PREAMBLE: CUFLASH_USER_FAST), for
    kernels of 16-bit inputs."""
    from . import _codegen

    user = kernel_dir() / "user"
    return (kernel_source() + ("#define CUFLASH_USER_FAST\n" if fast else "") + _codegen.PREAMBLE + source.text
            + (user / "block_tiles.cuh").read_text() + (user / "user_scores.cuh").read_text())


def get_function(name_expression: str, smem_bytes: int, user=None):
    """The compiled kernel for a template instantiation on the current device; ``user``: the
    call's score and mask functions (_codegen.Source), for a ``cuflash::UserScores`` kernel.

    Compiles on first use and raises the kernel's dynamic shared-memory limit to ``smem_bytes``
    where it is lower.
    """
    import cupy

    key = (cupy.cuda.runtime.getDevice(), name_expression, None if user is None else user.key)

    def build():
        # (the float32 kernels' functions keep the library's exact math)
        code = kernel_source() if user is None else user_kernel_source(user, "cuflash::f32" not in name_expression)
        module = cupy.RawModule(code=code, options=_module_options(current_arch()),
                                name_expressions=(name_expression,))
        _smem_limits[key] = DEFAULT_SMEM_LIMIT   # a new function's own limit
        return module.get_function(name_expression)

    fn = _once(_functions, key, build)
    if smem_bytes > _smem_limits[key]:
        with _lock:
            if smem_bytes > _smem_limits[key]:
                fn.max_dynamic_shared_size_bytes = smem_bytes
                _smem_limits[key] = smem_bytes
    return fn


_user_functions: dict[tuple[int, str, str], object] = {}


def get_user_function(name: str, header: str, source):
    """Kernel ``name`` (extern "C") of the kernel header ``header`` (under kernels/) after the
    generated functions ``source`` (_codegen.Source, behind _codegen.PREAMBLE), on the current
    device: compiled once per source and header, and cached on disk by CuPy like every kernel."""
    import cupy

    from . import _codegen

    def build():
        code = _codegen.PREAMBLE + source.text + (kernel_dir() / header).read_text()
        return cupy.RawModule(code=code, options=_module_options(current_arch())).get_function(name)

    return _once(_user_functions, (cupy.cuda.runtime.getDevice(), header, source.key), build)
