"""``conv2d_div_leaky_relu``'s ``"auto"``: the candidates timed once per kind
of call (forward alone, or forward and backward for the inputs that need a
gradient), interleaved round by round, the fastest kept."""

from __future__ import annotations

import functools

import torch

from .. import _timing
from . import _impl

_choices: dict[tuple, str] = {}


def candidates(dtype: torch.dtype, allow_tf32: bool) -> tuple[str, ...]:
    """The algorithms "auto" may pick: FP32-accurate ones, plus TF32 ones when allowed.

    For 16-bit inputs every algorithm multiplies exactly and accumulates in
    float32, so all are candidates ("fused_tf32" is "fused" there).
    """
    if dtype != torch.float32:
        return ("exact", "channels_last", "fused")
    tf32_cudnn = torch.backends.cudnn.allow_tf32
    out = ["exact", "fused"]
    if allow_tf32 or not tf32_cudnn:
        out.append("channels_last")
    if allow_tf32:
        out.append("fused_tf32")
    return tuple(out)


def choose(
    call, x, weight, bias, divisor, slope, stride, checked, dilation, padding, allow_tf32, grads
) -> str:
    """The cached or newly measured fastest candidate of ``call``
    (``conv2d_div_leaky_relu``) for this call's shape: forward alone
    (``grads`` None), or forward and backward for the inputs that need a
    gradient (``grads``: which of x, weight, bias; each set is a choice of
    its own, since the backward's kernels differ: a first layer, whose x
    needs none, skips the input gradient). ``checked``: the call's
    ``_checked``, which says where the fused kernel runs.

    Under torch.compile the choice is eager's for the same call
    (``_compiled_choice``: looked up, or measured on tensors of the call's
    kind when Dynamo first traces it) and becomes a constant of the graph."""
    if not _impl.on_gpu(x):
        return "exact"
    if torch.compiler.is_compiling():
        return _compiled_choice(
            call, tuple(x.shape), x.dtype, x.device, _impl.is_channels_last(x),
            tuple(weight.shape), bias is not None, divisor, slope, stride, padding, dilation,
            allow_tf32, grads,
        )  # fmt: skip
    # What the choice depends on beyond the call's kind (``checked``'s key:
    # shapes, dtype, device, hyper-parameters), looked up there first: a
    # per-call cost of its own on every call of "auto".
    cl, cudnn_tf32 = _impl.is_channels_last(x), _cudnn_allow_tf32()
    choice = checked.choices.get((cl, allow_tf32, cudnn_tf32, grads))
    if choice is not None:
        return choice
    key = (
        x.device,
        x.dtype,
        tuple(x.shape),
        cl,
        tuple(weight.shape),
        bias is not None,
        str(stride),
        str(padding),
        str(dilation),
        allow_tf32,
        cudnn_tf32,
        grads,
    )
    choice = _choices.get(key)
    if choice is None:
        fusable = dict(zip(("fused", "fused_tf32"), checked.fusable))
        # No timing while capturing a graph: the fused kernel, if it applies.
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return "fused" if fusable["fused"] else "exact"
        names = [a for a in candidates(x.dtype, allow_tf32) if fusable.get(a, True)]
        if grads is not None:
            args = (call, x, weight, bias, divisor, slope, stride, padding, dilation)
            times = _timing.interleaved_median_ms({a: _training_step(*args, a) for a in names})
        else:
            runs = {
                a: functools.partial(
                    call, x, weight, bias, divisor, slope, stride, padding, dilation, algorithm=a
                )
                for a in names
            }
            with torch.no_grad():
                times = _timing.interleaved_median_ms(runs)
        choice = _choices[key] = min(times, key=times.__getitem__)
    checked.choices[(cl, allow_tf32, cudnn_tf32, grads)] = choice
    return choice


try:  # cudnn.allow_tf32 without its property's Python layers (1 us of each call)
    _cudnn_allow_tf32 = torch._C._get_cudnn_allow_tf32
except AttributeError:  # pragma: no cover - the public property

    def _cudnn_allow_tf32() -> bool:
        return torch.backends.cudnn.allow_tf32


def _training_step(call, x, weight, bias, divisor, slope, stride, padding, dilation, algorithm):
    """A forward and backward of ``call`` with ``algorithm`` on detached views of the
    inputs (the caller's .grad untouched), for the inputs that need a
    gradient, from a random upstream gradient in the output's layout (drawn
    from a generator of its own: the caller's random state is untouched)."""
    xl, wl = (t.detach().requires_grad_(t.requires_grad) for t in (x, weight))
    bl = None if bias is None else bias.detach().requires_grad_(bias.requires_grad)
    wrt = [t for t in (xl, wl, bl) if t is not None and t.requires_grad]
    run = functools.partial(
        call, xl, wl, bl, divisor, slope, stride, padding, dilation,
        algorithm=algorithm,
    )  # fmt: skip
    with torch.no_grad():
        y = run()
        gy = torch.empty_like(y).normal_(generator=torch.Generator(y.device).manual_seed(0))

    def step():
        with torch.enable_grad():
            torch.autograd.grad(run(), wrt, gy)

    return step


def _compiled_choice(call, x_shape, dtype, device, channels_last, w_shape, with_bias, divisor,
                     slope, stride, padding, dilation, allow_tf32, grads) -> str:  # fmt: skip
    """What eager "auto" picks for a call of this kind, run by Dynamo as plain
    Python while it traces (``assume_constant_result``: the graph keeps the
    answer): eager's own call on fresh tensors of the same shapes, dtype,
    layout and gradient needs, which times the candidates where nothing is
    cached yet (outside any graph: Dynamo traces before running) and caches
    the choice for both. torch.compile's flag is lowered for that call
    (``torch.compiler._is_compiling_flag``, private: without it, the cached
    choice or "fused")."""
    gen = torch.Generator(device).manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    needs = grads or (False, False, False)
    x = torch.randn(x_shape, dtype=dtype, device=device, generator=gen)
    x = x.contiguous(memory_format=fmt).requires_grad_(needs[0])
    w = torch.randn(w_shape, dtype=dtype, device=device, generator=gen).requires_grad_(needs[1])
    b = None
    if with_bias:
        b = torch.randn(w_shape[:1], dtype=dtype, device=device, generator=gen)
        b.requires_grad_(needs[2])
    flag = getattr(torch.compiler, "_is_compiling_flag", None)
    if flag is not None:  # (the call as eager makes it: its own paths, its own timing)
        torch.compiler._is_compiling_flag = False
        try:
            with torch.set_grad_enabled(grads is not None):
                call(x, w, b, divisor, slope, stride, padding, dilation, algorithm="auto",
                     allow_tf32=allow_tf32)  # fmt: skip
        finally:
            torch.compiler._is_compiling_flag = flag
    key = (device, dtype, tuple(x_shape), channels_last, tuple(w_shape), with_bias, str(stride),
           str(padding), str(dilation), allow_tf32, _cudnn_allow_tf32(), grads)  # fmt: skip
    # (where torch has no such flag and nothing is cached: the fused kernel,
    # which the compiled graph then runs if it applies, else "exact")
    return _choices.get(key, "fused")


# torch.compiler.assume_constant_result(_compiled_choice), as that function
# does it: the decorator itself imports torch._dynamo (seconds at import, and
# an import that fails where a private torch API it reaches for is missing),
# and sets only this mark. tests/test_conv_compiled.py sees it work.
_compiled_choice._dynamo_marked_constant = True  # type: ignore[attr-defined]


def auto_choices() -> dict[tuple, str]:
    """What "auto" picked so far, by shape key (a copy; for logs and benchmarks)."""
    return dict(_choices)
