"""cupy_act: bit-exact, memory-roofline activation kernels for CuPy and PyTorch.

The array-level API below works on CuPy arrays and any GPU array exporting
DLPack or ``__cuda_array_interface__``. The PyTorch adapter (autograd with 1-bit
masks, modules, custom ops) lives in ``cupy_act.torch``; importing ``cupy_act``
alone never imports torch.
"""

from . import ops
from .conv import conv2d_div_leaky_relu
from .ops import *  # noqa: F401,F403  (the public array-level API, listed in ops.__all__)

__version__ = "0.1.0"

__all__ = [*ops.__all__, "conv2d_div_leaky_relu"]
