"""The single PyTorch reference for every op, plus test-data and timing helpers.

Shared by the test suite, the benchmarks and ``python -m cupy_act``. The
reference is PyTorch eager itself, as the registry (``cupy_act._registry``)
spells it for each op: forward is the torch expression (the same code the CPU
path runs), the mask is the predicate its backward branches on, and the
backward is autograd of the forward expression (independent of the masks).
``tests/conformance_rows.py`` adds hand-written PyTorch expressions as a check
independent of the registry. Needs torch; importing ``cupy_act`` never imports
this.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._reference import bits as _bits
from ._reference import pre, reference
from ._registry import OPS
from ._timing import interleaved_median_ms as interleaved_median_ms  # (the benchmarks')
from ._timing import median_ms as median_ms

INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def forward(op, x, slope=0.01, divisor=None, bias=None):
    """PyTorch eager forward of ``op``."""
    return reference(op, x, slope, divisor, bias)[0]


def mask_bits(op, x, divisor=None, bias=None):
    """The boolean per element that the backward branches on (one mask bit)."""
    with torch.no_grad():
        return _bits(op, pre(op, x, divisor, bias))


def cases(slopes=(0.01, -0.5, 0.0), divided=((0.01, 2.0), (0.3, -1.7))):
    """(op, slope, divisor) for every registry op: ops with a divisor take each
    (slope, divisor) of ``divided``; others each of ``slopes`` if they take a
    slope, else 0.01 (unused); divisor None where the op takes none."""
    out = []
    for name, op in OPS.items():
        if op.divisor:
            out += [(name, s if op.slope else 0.01, d) for s, d in divided]
        else:
            out += [(name, s, None) for s in (slopes if op.slope else (0.01,))]
    return out


def case_id(case) -> str:
    op, slope, divisor = case
    return f"{op}-s{slope}-d{divisor}"


def op_kwargs(op, slope=0.01, divisor=None) -> dict:
    """The scalars the registry says ``op`` takes, as its public functions' keywords."""
    spec = OPS[op]
    return {
        **({"divisor": divisor} if spec.divisor else {}),
        **({"negative_slope": slope} if spec.slope else {}),
    }


def call(module, op, x, slope=0.01, divisor=None, **kw):
    """The public function of ``op`` in ``cupy_act`` or ``cupy_act.torch``."""
    return getattr(module, op)(x, **op_kwargs(op, slope, divisor), **kw)


def backward(op, x, dy, slope=0.01, divisor=None, bias=None):
    """PyTorch autograd's gradient of ``forward`` w.r.t. x for upstream ``dy``."""
    xr = x.detach().clone().requires_grad_(True)
    y = forward(op, xr, slope, divisor, None if bias is None else bias.detach())
    (dx,) = torch.autograd.grad(y, xr, dy)
    return dx


class ConvDivLeakyReLUModel(torch.nn.Module):
    """The reference model ``leaky_relu(conv2d(x) / divisor, negative_slope)`` in plain
    torch, with ``self.conv`` an ``nn.Conv2d``: the parameters and ``state_dict`` keys
    that ``cupy_act.torch.ConvDivLeakyReLU`` shares."""

    def __init__(self, in_channels, out_channels, kernel_size, divisor, negative_slope=0.01):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, out_channels, kernel_size)
        self.divisor, self.negative_slope = divisor, negative_slope

    def forward(self, x):
        return F.leaky_relu(self.conv(x) / self.divisor, self.negative_slope)


def saved_sizes(fn, *args, held=()):
    """``(fn(*args), [(dtype, numel) of each tensor autograd saved during the call])``.

    Recorded through saved_tensors_hooks. Only sizes are kept: holding the saved
    tensors themselves past the call keeps the whole graph alive after its
    output is gone (measured: the peak memory of scripts/train.py grew by the
    probe's activations). Tensors sharing storage with one of ``held`` (the
    input and parameters, which the caller keeps anyway) are left out.
    """
    sizes = []
    kept = {t.untyped_storage().data_ptr() for t in held}

    def pack(t):
        if t.untyped_storage().data_ptr() not in kept:
            sizes.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sizes


def nbytes(sizes) -> int:
    """Total bytes of ``(dtype, numel)`` pairs."""
    return sum(numel * dtype.itemsize for dtype, numel in sizes)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-for-bit comparison."""
    return t.contiguous().view(INT_VIEW[t.dtype])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Assert identical shapes, dtypes and bits; report the first differences."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = bits(actual).flatten(), bits(expected).flatten()
    bad = (a != e).nonzero().flatten()
    if bad.numel():
        i = bad[:5].tolist()
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} elements differ; first at {i}: "
            f"got {[hex(v) for v in a[i].tolist()]} expected {[hex(v) for v in e[i].tolist()]}"
        )


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Signed zeros, infinities, NaNs with payloads, subnormals, extremes."""
    # fmt: off
    ibits = {
        torch.float32: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                        0x7F800001, 0x7FC12345, 0xFFFFFFFF, 1, 0x80000001, 0x007FFFFF,
                        0x807FFFFF, 0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF,
                        0x3F800000, 0xBF800000, 0x00012345, 0x80054321, 0x01000000],
        torch.float64: [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, 0x7FF8 << 48,
                        0xFFF8 << 48, (0x7FF0 << 48) | 1, (0x7FF8 << 48) | 0x1234,
                        (1 << 64) - 1, 1, (1 << 63) | 1, (1 << 52) - 1, 1 << 52,
                        0x7FEFFFFFFFFFFFFF, 0x3FF0 << 48, 0xBFF0 << 48],
        torch.float16: [0, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7E55,
                        0xFFFF, 1, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x8400, 0x7BFF,
                        0xFBFF, 0x3C00, 0xBC00, 0x0123],
        torch.bfloat16: [0, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FD5,
                         0xFFFF, 1, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080, 0x7F7F,
                         0xFF7F, 0x3F80, 0xBF80, 0x0123],
    }[dtype]
    # fmt: on
    itype = INT_VIEW[dtype]
    width = torch.iinfo(itype).bits
    signed = [b - (1 << width) if b >= 1 << (width - 1) else b for b in ibits]
    return torch.tensor(signed, dtype=itype).view(dtype)


def make_input(n: int, dtype: torch.dtype, device="cuda", seed: int = 0) -> torch.Tensor:
    """Test data of n elements: half normal values of mixed scales, a quarter
    random bit patterns (every class of float, subnormals and NaNs included),
    a quarter special values; never all zeros."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = x * torch.pow(10.0, torch.randint(-8, 9, (n,), generator=g).double())
    x = x.to(dtype)
    itype = INT_VIEW[dtype]
    info = torch.iinfo(itype)
    rand_bits = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(itype)
    which = torch.randint(0, 4, (n,), generator=g)
    xb = x.view(itype)
    xb = torch.where(which == 1, rand_bits, xb)
    sv = special_values(dtype).view(itype)
    pick = sv[torch.randint(0, sv.numel(), (n,), generator=g)]
    xb = torch.where(which == 2, pick, xb)
    return xb.view(dtype).to(device)


def make_grad(n: int, dtype: torch.dtype, device="cuda", seed: int = 0) -> torch.Tensor:
    """An upstream gradient of n finite values (normal, times powers of two
    from 2^-4 to 2^4: in range for every dtype, sums of thousands finite):
    for the sums a test compares (a bias gradient), which ``make_input``'s
    special values would make NaN everywhere."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = x * torch.pow(2.0, torch.randint(-4, 5, (n,), generator=g).double())
    return x.to(dtype).to(device)


def make_inputs(device, dtype=torch.float32, shape=(2, 3, 4, 5), seed: int = 0):
    """(x, bias, dy, t): x of ``shape``, a per-channel bias of ``(shape[1],)`` and
    two more tensors of x's shape (an upstream gradient, a tangent), each from
    ``make_input`` with its own seed."""
    n = math.prod(shape)
    x = make_input(n, dtype, device, seed).view(shape)
    b = make_input(shape[1], dtype, device, seed + 1)
    dy = make_input(n, dtype, device, seed + 2).view(shape)
    t = make_input(n, dtype, device, seed + 3).view(shape)
    return x, b, dy, t
