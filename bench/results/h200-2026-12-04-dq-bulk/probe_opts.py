"""pytest plugin: compile the kernels with -DCUFLASH_PROBE=$CUFLASH_PROBE."""
import os
from cuflash import _compile
_base = _compile._common_options
_compile._common_options = lambda: _base() + (f"-DCUFLASH_PROBE={os.environ.get('CUFLASH_PROBE', '0')}",)
