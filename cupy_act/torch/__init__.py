"""PyTorch adapter: functional ops, nn modules and torch.library custom ops.

Autograd saves a 1-bit mask per element instead of the input or output (32x
less saved memory than eager PyTorch in float32); results and gradients are
bit for bit PyTorch's. CUDA tensors run the cupy_act kernels on torch's
current stream; CPU tensors run a plain-torch implementation of the same ops.
"""

from . import (
    _library,  # noqa: F401  (registers the cupy_act:: custom ops)
    adopt,
    batchnorm,
    batchnorm_fuse,
    batchnorm_fx,
    functional,
    modules,
    syncbatchnorm,
)
from .adopt import *  # noqa: F403  (replace_activations, activations_mode)
from .batchnorm import *  # noqa: F403  (BatchNormAct2d, set_compiled_batchnorm, ...)
from .batchnorm_fuse import *  # noqa: F403  (fuse_batchnorm_act, convert_sync_batchnorm)
from .batchnorm_fx import *  # noqa: F403  (fuse_batchnorm_act_fx)
from .conv import conv2d_div_leaky_relu, set_compiled_epilogue
from .functional import *  # noqa: F403  (the public functions, listed in functional.__all__)
from .modules import *  # noqa: F403  (the nn.Modules, listed in modules.__all__)
from .syncbatchnorm import *  # noqa: F403  (SyncBatchNormAct2d)

__all__ = [
    *functional.__all__,
    "conv2d_div_leaky_relu",
    "set_compiled_epilogue",
    *modules.__all__,
    *adopt.__all__,
    *batchnorm.__all__,
    *batchnorm_fuse.__all__,
    *batchnorm_fx.__all__,
    *syncbatchnorm.__all__,
]
