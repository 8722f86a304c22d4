"""cupy_act: bit-exact, memory-roofline activation kernels for CuPy and PyTorch.

The array-level API below works on CuPy arrays and any GPU array exporting
DLPack or ``__cuda_array_interface__``. The PyTorch adapter (autograd with 1-bit
masks, modules, custom ops) lives in ``cupy_act.torch``; importing ``cupy_act``
alone never imports torch.
"""

from ._arrays import mask_nbytes
from .ops import (
    div_leaky_relu,
    div_leaky_relu_backward,
    div_leaky_relu_with_mask,
    leaky_relu,
    leaky_relu_backward,
    leaky_relu_with_mask,
    relu,
    relu_backward,
    relu_with_mask,
    unpack_mask,
)

__version__ = "0.1.0"

__all__ = [
    "relu",
    "leaky_relu",
    "div_leaky_relu",
    "relu_with_mask",
    "leaky_relu_with_mask",
    "div_leaky_relu_with_mask",
    "relu_backward",
    "leaky_relu_backward",
    "div_leaky_relu_backward",
    "mask_nbytes",
    "unpack_mask",
]
