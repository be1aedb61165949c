"""cuflash: exact FlashAttention for CuPy arrays.

``cuflash.attention`` runs fused, tiled CUDA kernels compiled at run time;
``cuflash.reference`` is the same function in NumPy float64 and needs no GPU.
Importing cuflash does not import CuPy.
"""

from . import naive, reference
from ._api import attention, attention_backward, attention_kvcache, attention_vjp, merge_attention
from ._checks import require_gpu

__version__ = "0.1.0"
__all__ = [
    "attention", "attention_backward", "attention_kvcache", "attention_vjp", "merge_attention", "require_gpu", "naive", "reference", "__version__",
]
