"""Deliberate bugs, one per name, applied from the test side: the product
carries no switch. ``scripts/mutants.py`` runs a family's tests once per
mutant (``CUPY_ACT_MUTANT=<name>[,<name>...]`` in the environment: ``conftest.py`` and
``conformance_rows.py`` call ``apply_from_env``) and requires each to be
caught by a failing test whose name says what it broke.

Two kinds:
- ``cpu``: a Python step replaced (the CPU path, the adapter, the checks);
- ``gpu``: a kernel's source text edited before NVRTC compiles it (every
  edit must match exactly once in the assembled source it targets, so a
  mutant that no longer applies fails loudly instead of testing nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV = "CUPY_ACT_MUTANT"


@dataclass(frozen=True)
class Mutant:
    name: str
    family: str
    kind: str  # "cpu" or "gpu"
    what: str  # the bug, in words
    words: tuple[str, ...]  # a failing test's id must hold one of these
    tests: tuple[str, ...]  # pytest arguments: the family's files and a -k filter
    edits: tuple[tuple[str, str, str], ...] = field(default=())  # gpu: (source, old, new)


def _cpu_slope_ignored():
    from cupy_act.torch import _impl

    for name in ("forward", "forward_mask_layout", "forward_mask_"):
        real = getattr(_impl, name)

        def ignoring(x, op, slope, divisor, bias, *rest, _real=real):
            return _real(x, op, 0.01, divisor, bias, *rest)

        setattr(_impl, name, ignoring)


def _cpu_bias_grad_scaled():
    from cupy_act.torch import _library

    real = _library.bias_grad
    _library.bias_grad = lambda dx: 3 * real(dx) + 1


def _cpu_mask_bit_order_reversed():
    import numpy

    from cupy_act.torch import _impl

    class BigEndianPacking:
        """numpy, but packbits puts the first element in the most significant bit."""

        def __getattr__(self, name):
            return getattr(numpy, name)

        @staticmethod
        def packbits(a, axis=None, bitorder="big"):
            return numpy.packbits(a, axis=axis, bitorder="big")

    _impl.numpy = BigEndianPacking()


def _cpu_backward_divisor_dropped():
    from cupy_act import _registry
    from cupy_act.torch import _impl

    def backward_from_bits(op, dy, bits, slope, divisor):
        spec = _registry.OPS[op]
        return spec.torch_backward(_impl.torch, dy, _impl.torch.empty_like(dy).copy_(bits),
                                   slope, None)  # fmt: skip

    def host_backward(op, dy, mask, slope, divisor, channels_last):
        return None  # (the general path below, without its division)

    _impl.backward_from_bits = backward_from_bits
    _impl._host_backward = host_backward


def _cpu_bn_channel_check_dropped():
    from cupy_act.torch import batchnorm

    batchnorm._check_channels = lambda *a: None


def _cpu_launcher_checks_dropped():
    from cupy_act import _batchnorm, _conv, _launch

    _launch.Launch.checked = lambda self, have, *args: self(*args)
    for module in (_conv.forward, _conv.wgrad, _conv.dgrad):
        module.check_extents = lambda *a: None
    _batchnorm._refuse = lambda *a: None


def _cpu_conv_dilation_ignored():
    from cupy_act import _conv

    real = _conv.shapes._geometry
    _conv.shapes._geometry = lambda fname, xs, ws, s, p, d: real(fname, xs, ws, s, p, 1)


def _cpu_conv_bias_check_dropped():
    from cupy_act.torch import _conv_checks, conv

    real = _conv_checks._check
    for module in (conv, _conv_checks):
        module._check = lambda x, w, b, *a: real(x, w, None, *a)


def _cpu_bn_grid_unrounded():
    from cupy_act import _batchnorm

    _batchnorm.elementwise_blocks = lambda s, width, cap: min(max(1, s.n // width // 256), cap)


def _cpu_bn_compiled_update_dropped():
    from cupy_act.torch import _bn_ops

    real = _bn_ops.BatchNormActFunction

    class Dropping(real):
        @staticmethod
        def forward(ctx, *args):  # (the running statistics not passed to update)
            return real.forward(ctx, *args[:12], None, None, 0.0)

    _bn_ops.BatchNormActFunction = Dropping


def _cpu_bn_lowering_dropped():
    from cupy_act.torch import _bn_lowering

    _bn_lowering.register = lambda: False


_CPU = {
    "slope_ignored": _cpu_slope_ignored,
    "bias_grad_scaled": _cpu_bias_grad_scaled,
    "mask_bit_order_reversed": _cpu_mask_bit_order_reversed,
    "backward_divisor_dropped": _cpu_backward_divisor_dropped,
    "bn_channel_check_dropped": _cpu_bn_channel_check_dropped,
    "launcher_checks_dropped": _cpu_launcher_checks_dropped,
    "conv_dilation_ignored": _cpu_conv_dilation_ignored,
    "conv_bias_check_dropped": _cpu_conv_bias_check_dropped,
    "bn_grid_unrounded": _cpu_bn_grid_unrounded,
    "bn_lowering_dropped": _cpu_bn_lowering_dropped,
    "bn_compiled_update_dropped": _cpu_bn_compiled_update_dropped,
}

ELEMENTWISE_CPU = (
    "tests/test_torch_adapter.py",
    "tests/test_conformance.py",
    "-k",
    "not cuda and not (test_row and not (first_backward or grad_only_on_bias or func_vjp))",
)
ELEMENTWISE_GPU = ("tests/test_ops_gpu.py", "-k", "not large and not 2_pow_31")

MUTANTS = [
    # ---- CPU: Python steps ----
    Mutant("slope_ignored", "elementwise", "cpu",
           "the adapter drops negative_slope (the default 0.01 instead)",
           ("leaky", "slope"), ELEMENTWISE_CPU),
    Mutant("bias_grad_scaled", "elementwise", "cpu",
           "the bias gradient is 3 x its sum + 1", ("bias",), ELEMENTWISE_CPU),
    Mutant("mask_bit_order_reversed", "elementwise", "cpu",
           "the CPU path packs mask bits most significant first", ("mask",),
           ("tests/test_torch_adapter.py",)),
    Mutant("backward_divisor_dropped", "elementwise", "cpu",
           "the CPU backward of div_leaky_relu does not divide by the divisor",
           ("div_leaky_relu", "backward"), ELEMENTWISE_CPU),
    Mutant("bn_channel_check_dropped", "batchnorm", "cpu",
           "BatchNormAct2d no longer checks the channel count against its tensors",
           ("mismatch",), ("tests/test_mismatched_inputs.py", "-k", "batchnorm or fused_model")),
    Mutant("launcher_checks_dropped", "launch", "cpu",
           "the launchers' size checks (the second line) do nothing",
           ("launcher_mismatch",), ("tests/test_mismatched_inputs.py", "-k", "launcher")),
    Mutant("conv_dilation_ignored", "conv", "cpu",
           "the convolution's geometry ignores the dilation", ("geometry", "dilation"),
           ("tests/test_conv.py", "-k", "geometry or mismatch")),
    Mutant("conv_bias_check_dropped", "conv", "cpu",
           "conv2d_div_leaky_relu no longer checks the bias against the weight",
           ("mismatch", "bias"),
           ("tests/test_mismatched_inputs.py", "tests/test_conv.py", "-k",
            "conv and (mismatch or errors)")),
    Mutant("bn_grid_unrounded", "batchnorm", "cpu",
           "channels-last elementwise grids not rounded to whole rows per trip",
           ("keep_their_channels",), ("tests/test_batchnorm_layouts.py", "-k", "not cuda")),
    Mutant("bn_lowering_dropped", "batchnorm", "cpu",
           "Inductor lowers the BatchNorm ops as plain fallbacks (dy and the residual in "
           "whatever order it picks)", ("order",),
           ("tests/test_batchnorm_layouts.py", "-m", "slow", "-k", "inductor")),
    Mutant("bn_compiled_update_dropped", "batchnorm", "cpu",
           "the compiled op is not given the running statistics to update",
           ("running_statistics",),
           ("tests/test_batchnorm_compiled.py", "-k", "running_statistics")),
    # ---- GPU: kernel sources ----
    Mutant("gpu_slope_ignored", "elementwise", "gpu",
           "the LeakyReLU functor multiplies by 0.01, not the slope", ("leaky", "slope"),
           ELEMENTWISE_GPU,
           (("elementwise.cu", "slope(scalar_from_bits<op_t>(p.slope))", "slope(op_t(0.01f))"),)),
    Mutant("gpu_mask_bit_order_reversed", "elementwise", "gpu",
           "the forward kernel stores each mask word bit-reversed", ("mask", "bit_exact"),
           ELEMENTWISE_GPU,
           (("elementwise.cu", "if (lane % G == u) mine = w;",
             "if (lane % G == u) mine = __brev(w);"),
            ("elementwise.cu", "if (lane == 0) p.mask[g] = w;",
             "if (lane == 0) p.mask[g] = __brev(w);"))),
    Mutant("gpu_running_var_biased", "batchnorm", "gpu",
           "the running variance is updated with the biased batch variance",
           ("running",), ("tests/test_batchnorm.py", "-k", "running"),
           (("batchnorm.cu", "m * var * count / (count - 1.0)", "m * var"),)),
    Mutant("gpu_inplace_affine_dropped", "batchnorm", "gpu",
           "the in-place backward inverts y without the bias (z - 0) / w",
           ("inplace",),
           ("tests/test_batchnorm.py", "-k", "accuracy and inplace and float32 and contiguous"),
           (("batchnorm.cu", "const float ctr = out ? bn_bias(p, c) : p.mean[c];",
             "const float ctr = out ? 0.f : p.mean[c];"),)),
    Mutant("gpu_residual_grad_undone", "batchnorm", "gpu",
           "the residual's gradient is dy, not passed back through the activation",
           ("residual",),
           ("tests/test_batchnorm_compiled.py", "-k", "residual_kernels and float32 and offset"),
           (("batchnorm.cu", "      d[j] = dz;", "      d[j] = d[j];"),)),
    Mutant("gpu_sync_count_local", "batchnorm", "gpu",
           "a synchronized forward normalizes the group's sums by its own process's count",
           ("statistics",),
           ("tests/test_syncbatchnorm.py", "-k", "statistics and cuda"),
           (("batchnorm.cu", "bn_finish_stats(p, c, a, b, p.partial[2 * p.channels]);",
             "bn_finish_stats(p, c, a, b, bn_count(p));"),)),
    Mutant("gpu_dy_slice_read_dense", "batchnorm", "gpu",
           "the backward reads a channel slice of dy as if it were dense (its skip ignored)",
           ("slice",), ("tests/test_batchnorm_layouts.py", "-k", "channel_slice_equals"),
           (("batchnorm.cu", "bn_load<T, V>(p.dy, i + outer * p.dy_skip, d);",
             "bn_load<T, V>(p.dy, i, d);"),
            ("batchnorm.cu", "bn_fetch<T, V, P, A>(p, i, i + img * p.dy_skip, in[0]);",
             "bn_fetch<T, V, P, A>(p, i, i, in[0]);"),
            ("batchnorm.cu", "bn_fetch<T, V, P, A>(p, i, i + ru * p.dy_skip, in[u]);",
             "bn_fetch<T, V, P, A>(p, i, i, in[u]);"),
            ("batchnorm.cu", "bn_fetch<T, V, P, A>(p, i, i + r * p.dy_skip, in[0]);",
             "bn_fetch<T, V, P, A>(p, i, i, in[0]);"))),
    Mutant("gpu_bn_rows_tail_dropped", "batchnorm", "gpu",
           "the channels-last reductions skip the rows left after the unrolled walk",
           ("channels_last",), ("tests/test_batchnorm.py", "-k", "accuracy and channels_last"),
           (("batchnorm.cu", "    for (; r < rows; r += stride) {",
             "    for (; r < 0; r += stride) {"),)),
    Mutant("gpu_bn_grad_subsums_short", "batchnorm", "gpu",
           "the gradient passes' float sums over an unrolled trip keep its last vector alone",
           ("channels_last",), ("tests/test_batchnorm.py", "-k", "accuracy and channels_last"),
           (("batchnorm.cu", "for (int u = 0; u < U; ++u) bn_add<T, V, P, A, K, float>",
             "for (int u = U - 1; u < U; ++u) bn_add<T, V, P, A, K, float>"),)),
    Mutant("gpu_bn_inplace_slope_kept", "batchnorm", "gpu",
           "the in-place backward undoes LeakyReLU with the slope itself, not its reciprocal",
           ("inplace",), ("tests/test_batchnorm.py", "-k", "accuracy and inplace"),
           (("batchnorm.cu", "const float inv_slope = __frcp_rn(p.slope);  // (loop-invariant",
             "const float inv_slope = p.slope;  // (loop-invariant"),
            ("batchnorm.cu", "  const float inv_slope = __frcp_rn(p.slope);\n  float4 q[V];",
             "  const float inv_slope = p.slope;\n  float4 q[V];"))),
    Mutant("gpu_bn_post_ignored", "batchnorm", "gpu",
           "the forward drops the shortcut added after the activation (post)", ("post",),
           ("tests/test_batchnorm_folding.py",),
           (("batchnorm.cu", "          if (p.post != nullptr)\n            v[j] = add_rn(",
             "          if (false)\n            v[j] = add_rn("),)),
    Mutant("gpu_bn_post_unrounded", "batchnorm", "gpu",
           "the shortcut is added to the activation's float value, not to y as stored", ("post",),
           ("tests/test_batchnorm_folding.py", "-k", "post_equals"),
           (("batchnorm.cu", "add_rn(Num<T>::to_op(Num<T>::from_op(v[j])), ",
             "add_rn(v[j], "),)),
    Mutant("gpu_conv_dilation_ignored", "conv", "gpu",
           "the convolution's patch rows and columns ignore the dilation", ("dilation",),
           ("tests/test_conv.py", "-k", "forward_with_dilation"),
           (("conv2d.cu", "return {ci * plane + s * p.dw, r * p.dh};",
             "return {ci * plane + s, r};"),)),
    Mutant("gpu_wgrad_last_split_missing", "conv", "gpu",
           "the weight gradient's final sum leaves out the last split",
           ("weight_gradient", "wgrad"),
           ("tests/test_conv_wgrad.py", "-k", "accuracy and (case3- or case17-) and dtype0"),
           (("conv2d_wgrad.cu", "k1 = min(p.splits, k0 + per);",
             "k1 = min(p.splits - 1, k0 + per);"),)),
]  # fmt: skip
BY_NAME = {m.name: m for m in MUTANTS}


def _apply_gpu(m: Mutant) -> None:
    """The source edits, through the one function every compile reads its
    source from (``_source.assembled_source``, also as ``_loader``'s name)."""
    from cupy_act import _loader, _source

    real = _source.assembled_source

    def mutated(name: str = _source.MAIN_SOURCE) -> str:
        text = real(name)
        for source, old, new in m.edits:
            if source == name or old in text:
                count = text.count(old)
                if count != 1:
                    raise RuntimeError(f"mutant {m.name}: {old!r} found {count} times in {name}")
                text = text.replace(old, new)
        return text

    _source.assembled_source = mutated
    _loader.assembled_source = mutated


def apply(name: str) -> Mutant:
    """Apply mutant ``name`` to this process."""
    m = BY_NAME[name]
    if m.kind == "cpu":
        _CPU[name]()
    else:
        _apply_gpu(m)
    return m


def apply_from_env() -> list[Mutant]:
    """Apply the mutants ``CUPY_ACT_MUTANT`` names (comma-separated), if any."""
    return [apply(name) for name in os.environ.get(ENV, "").split(",") if name]
