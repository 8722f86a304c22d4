"""``nn.Module`` drop-ins for ``nn.ReLU``, ``nn.LeakyReLU`` and the conv epilogue."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as F

__all__ = ["ReLU", "LeakyReLU", "DivLeakyReLU", "ConvDivLeakyReLU"]


def _inplace_repr(inplace: bool) -> str:
    return ", inplace=True" if inplace else ""


class ReLU(nn.Module):
    """Drop-in for ``nn.ReLU``; saves a 1-bit mask for backward."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.relu(input, inplace=self.inplace)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class LeakyReLU(nn.Module):
    """Drop-in for ``nn.LeakyReLU``; in place works for any slope under autograd."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__()
        self.negative_slope = negative_slope
        self.inplace = inplace

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(input, self.negative_slope, self.inplace)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}{_inplace_repr(self.inplace)}"


class DivLeakyReLU(nn.Module):
    """``leaky_relu(x / divisor, negative_slope)`` in one pass."""

    def __init__(self, divisor: float, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__()
        self.divisor = divisor
        self.negative_slope = negative_slope
        self.inplace = inplace

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.div_leaky_relu(input, self.divisor, self.negative_slope, self.inplace)

    def extra_repr(self) -> str:
        return (
            f"divisor={self.divisor}, negative_slope={self.negative_slope}"
            f"{_inplace_repr(self.inplace)}"
        )


class ConvDivLeakyReLU(nn.Module):
    """Drop-in for ``leaky_relu(conv2d(x) / divisor, negative_slope)`` written with
    ``self.conv = nn.Conv2d(...)``: same parameters, same ``state_dict`` keys
    (``conv.weight``, ``conv.bias``), loadable either way.

    On CUDA the convolution runs in PyTorch without its bias; bias, division,
    LeakyReLU and the mask follow in one fused pass (PyTorch's CUDA convolution
    adds its bias in a separate pass, so this is bit-identical to the eager
    model). On the CPU, where the convolution adds the bias itself, it keeps it.
    ``channels_last=True`` runs the convolution in channels-last
    layout (where cuDNN may use TF32 tensor cores as
    ``torch.backends.cudnn.allow_tf32`` permits, as torch.compile's choice of
    layout does) and returns a channels-last output.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        divisor: float,
        negative_slope: float = 0.01,
        channels_last: bool = False,
        **conv_kwargs,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, **conv_kwargs)
        self.divisor = divisor
        self.negative_slope = negative_slope
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.conv.weight
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
            weight = weight.contiguous(memory_format=torch.channels_last)
        if not x.is_cuda:
            # CPU convolutions add their bias inside the kernel, with other
            # rounding than a separate add: keep it there to stay bit-exact.
            pre = self.conv._conv_forward(x, weight, self.conv.bias)
            return F.div_leaky_relu(pre, self.divisor, self.negative_slope)
        pre = self.conv._conv_forward(x, weight, None)
        return F.div_leaky_relu(pre, self.divisor, self.negative_slope, bias=self.conv.bias)

    def extra_repr(self) -> str:
        return f"divisor={self.divisor}, negative_slope={self.negative_slope}" + (
            ", channels_last=True" if self.channels_last else ""
        )
