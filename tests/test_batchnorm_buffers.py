"""The fused BatchNorm passes get each array at the parameter-block field
named for it, with the bytes to the end of its buffer beside it (what the
launch's second line of size checks compares): the eager autograd Function's
passes and the compiled route's ops, on CPU tensors with the launch recorded."""

import pytest
from conftest import record_bn_launches

torch = pytest.importorskip("torch")

from cupy_act import _batchnorm  # noqa: E402
from cupy_act.torch import _bn_kernels as K  # noqa: E402
from cupy_act.torch import _bn_ops, _impl  # noqa: E402

FIELDS = _batchnorm.Buffers._fields
_SET = 4096  # (the stubbed address of the zeroed counters: record_bn_launches)


@pytest.fixture
def runs(monkeypatch):
    """(pass, Buffers, have) of each ``_batchnorm.run``, none launched."""
    record_bn_launches(monkeypatch)
    monkeypatch.setattr(_impl, "on_gpu", lambda x: True)
    made = []
    monkeypatch.setattr(
        _batchnorm, "run", lambda ps, stream, b, have, *a: made.append((ps, b, have))
    )
    return made


def _check(run, named: dict, stats) -> None:
    """Every field of ``named`` (field -> tensor) points at its tensor's start
    and has the bytes to its end; the statistics' fields are at their offsets
    in ``stats``; the work area's partial sums and coef one buffer; every
    other field 0."""
    ps, b, have = run
    b, have = dict(zip(FIELDS, b)), dict(zip(FIELDS, have))
    c = ps.shape.channels
    if stats is not None:
        for field, offset in (("mean", 0), ("invstd", 4 * c), ("moments", ps.moments)):
            named[field] = (stats, offset)
    for field, t in named.items():
        t, offset = t if isinstance(t, tuple) else (t, 0)
        assert b.pop(field) == t.data_ptr() + offset, field
        assert have.pop(field) == t.nbytes - offset, field
    if "partial" in b:
        partial, bytes_ = b.pop("partial"), have.pop("partial")
        if partial:  # (the work area: partial sums, then coef)
            assert bytes_ == 8 * ps.work
            assert b.pop("coef") == partial + ps.coef and have.pop("coef") == bytes_ - ps.coef
    arrivals = _batchnorm.arrivals(ps.shape) and ps.need.partial  # (evaluation: no reduction)
    assert b.pop("arrivals") == (_SET if arrivals else 0)
    assert have.pop("arrivals") == (4 * 65536 if arrivals else 0)
    assert not any(b.values()), {k: v for k, v in b.items() if v}
    assert not any(have.values()), {k: v for k, v in have.items() if v}


def _tensors(layout: str, c: int = 8):
    fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
    x = torch.randn(4, c, 5, 6).contiguous(memory_format=fmt)
    w, b = torch.rand(c) + 0.5, torch.randn(c)
    return x, w, b, torch.randn_like(x), torch.zeros(c), torch.ones(c)


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("inplace", [False, True], ids=["default", "inplace"])
def test_eager_passes_get_each_buffer_where_it_is_named(layout, inplace, runs):
    x, w, b, res, rm, rv = _tensors(layout)
    count = torch.zeros((), dtype=torch.long)
    mode = K.Mode("leaky_relu", 0.1, False, inplace, True)
    src = x.clone()
    y, stats, mask, s = K.forward(src, w, b, res, rm, rv, count, 0.1, 1e-5, mode,
                                  out=src if inplace else None)  # fmt: skip
    named = {"x": src, "y": y, "weight": w, "bias": b, "running_mean": rm, "running_var": rv,
             "num_batches": count, "residual": res}  # fmt: skip
    if not inplace:
        named["mask"] = mask
    _check(runs[-1], named, stats)
    gy = torch.randn_like(x)
    dx, gw, gb, gr = K.backward(y if inplace else src, gy, mask, w, b, stats,
                                res if inplace else None, s, mode, True, True, True)  # fmt: skip
    named = {"x": y if inplace else src, "dy": gy, "y": dx, "weight": w, "bias": b,
             "grad_weight": gw, "grad_bias": gb, "grad_residual": gr}  # fmt: skip
    named.update({"residual": res} if inplace else {"mask": mask})
    stats_part = {"mean": (stats, 0), "invstd": (stats, 4 * s.channels)}
    _check(runs[-1], {**named, **stats_part}, None)


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_compiled_ops_get_each_buffer_where_it_is_named(layout, runs):
    x, w, b, res, rm, rv = _tensors(layout)
    # a training forward updating the running statistics, then its backward
    y, stats, mask = _bn_ops._forward_impl(x, w, b, None, None, None, 1e-5, "relu", 0.0, False,
                                           False, True, None, rm, rv, 0.1)  # fmt: skip
    _check(runs[-1], {"x": x, "y": y, "mask": mask, "weight": w, "bias": b,
                      "running_mean": rm, "running_var": rv}, stats)  # fmt: skip
    gy = torch.randn_like(x)
    dx, gw, gb, gr = _bn_ops._backward_impl(x, gy, mask, w, b, stats, None, "relu", 0.0, False,
                                            False, True, True, False)  # fmt: skip
    named = {"x": x, "dy": gy, "y": dx, "mask": mask, "weight": w, "bias": b,
             "grad_weight": gw, "grad_bias": gb,
             "mean": (stats, 0), "invstd": (stats, 4 * 8)}  # fmt: skip
    _check(runs[-1], named, None)
    assert gr.numel() == 0
    # in place with a residual: the backward from y reads the residual back
    y, stats, _ = _bn_ops._forward_impl(x, None, b, res, None, None, 1e-5, "leaky_relu", 0.2,
                                        False, True, True)  # fmt: skip
    _check(runs[-1], {"x": x, "y": y, "bias": b, "residual": res}, stats)
    empty = torch.empty(0, dtype=torch.int32)
    dx, gw, gb, gr = _bn_ops._backward_impl(y, gy, empty, None, b, stats, res, "leaky_relu", 0.2,
                                            False, True, False, True, True)  # fmt: skip
    named = {"x": y, "dy": gy, "y": dx, "bias": b, "grad_bias": gb, "residual": res,
             "grad_residual": gr, "mean": (stats, 0), "invstd": (stats, 4 * 8)}  # fmt: skip
    _check(runs[-1], named, None)
    # evaluation with the running statistics, and a tensor added after the activation
    y, stats, _ = _bn_ops._forward_impl(x, w, None, None, rm, rv, 1e-5, "relu", 0.0, True, False,
                                        False, res)  # fmt: skip
    _check(runs[-1], {"x": x, "y": y, "weight": w, "running_mean": rm, "running_var": rv,
                      "post": res}, stats)  # fmt: skip
