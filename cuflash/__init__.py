"""cuflash: exact FlashAttention for CuPy arrays.

``cuflash.attention`` runs fused, tiled CUDA kernels compiled at run time;
``cuflash.reference`` is the same function in NumPy float64 and needs no GPU.
Importing cuflash does not import CuPy. ``cuflash.where``, ``exp``, ``log``, ``tanh``, ``sqrt``,
``abs``, ``minimum``, ``maximum`` and ``floor`` are the functions that user-defined score and mask
functions may call (docs/contract.md).
"""

from . import naive, reference
from ._api import attention, attention_backward, attention_kvcache, attention_vjp, merge_attention
from ._block_mask import block_mask
from ._checks import require_gpu
from ._trace import abs, exp, floor, log, maximum, minimum, sqrt, tanh, where  # noqa: A004 - as NumPy's

__version__ = "0.1.0"
__all__ = [
    "attention", "attention_backward", "attention_kvcache", "attention_vjp", "block_mask", "merge_attention", "require_gpu", "naive", "reference", "__version__",
    "abs", "exp", "floor", "log", "maximum", "minimum", "sqrt", "tanh", "where",
]
