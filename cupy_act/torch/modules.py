"""``nn.Module`` drop-ins for ``nn.ReLU``, ``nn.LeakyReLU`` and the conv epilogue."""

from __future__ import annotations

import torch
from torch import nn

from . import conv
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

    ``algorithm`` is one of ``conv.ALGORITHMS`` (see
    ``cupy_act.torch.conv2d_div_leaky_relu``). The default, "exact", runs the
    convolution in PyTorch without its bias, then bias, division, LeakyReLU and
    the mask in one fused pass: bit-identical to the eager model (PyTorch's CUDA
    convolution adds its bias in a separate pass; on the CPU, where it adds it
    inside, the bias stays there). "channels_last" does the same in
    channels-last layout (cuDNN may use TF32 as ``torch.backends.cudnn.allow_tf32``
    permits, as torch.compile's choice of layout does); ``channels_last=True``
    is kept as its older spelling. "fused" computes everything in one kernel
    at FP32 accuracy. Grouped convolutions and padding modes other than zeros
    always take the "exact" path.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        divisor: float,
        negative_slope: float = 0.01,
        channels_last: bool = False,
        algorithm: str = "exact",
        allow_tf32: bool = False,
        **conv_kwargs,
    ) -> None:
        super().__init__()
        if algorithm not in conv.ALGORITHMS:
            raise ValueError(
                f"ConvDivLeakyReLU: algorithm={algorithm!r}; expected one of {conv.ALGORITHMS}"
            )
        if channels_last and algorithm not in ("exact", "channels_last"):
            raise ValueError(
                f"ConvDivLeakyReLU: channels_last=True is the older spelling of "
                f"algorithm='channels_last' and cannot be combined with algorithm={algorithm!r} "
                f"(the fused algorithms keep the input's own layout: pass a channels-last input)"
            )
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, **conv_kwargs)
        self.divisor = divisor
        self.negative_slope = negative_slope
        self.algorithm = "channels_last" if channels_last and algorithm == "exact" else algorithm
        self.allow_tf32 = allow_tf32

    @property
    def channels_last(self) -> bool:
        """The older switch: True exactly when ``algorithm == "channels_last"``."""
        return self.algorithm == "channels_last"

    @channels_last.setter
    def channels_last(self, value: bool) -> None:
        if value:
            self.algorithm = "channels_last"
        elif self.algorithm == "channels_last":
            self.algorithm = "exact"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.conv
        if c.groups == 1 and c.padding_mode == "zeros":
            return conv.conv2d_div_leaky_relu(
                x,
                c.weight,
                c.bias,
                self.divisor,
                self.negative_slope,
                c.stride,
                c.padding,
                c.dilation,
                self.algorithm,
                self.allow_tf32,
            )
        weight = c.weight
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
            weight = weight.contiguous(memory_format=torch.channels_last)
        if not x.is_cuda:  # (see conv._unfused)
            pre = c._conv_forward(x, weight, c.bias)
            return F.div_leaky_relu(pre, self.divisor, self.negative_slope)
        pre = c._conv_forward(x, weight, None)
        return F.div_leaky_relu(pre, self.divisor, self.negative_slope, bias=c.bias)

    def extra_repr(self) -> str:
        return f"divisor={self.divisor}, negative_slope={self.negative_slope}" + (
            f", algorithm={self.algorithm!r}" if self.algorithm != "exact" else ""
        )
