"""SyncBatchNormAct2d: the module, its adoption (fusers, convert_sync_batchnorm)
and, in two processes under torchrun (tests/sync_worker.py), its statistics
and gradients over a process group."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act import testing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ACTS = {"relu": nn.ReLU, "leaky_relu": lambda: nn.LeakyReLU(0.2), "identity": nn.Identity}


def test_module_is_a_sync_batchnorm():
    """nn.SyncBatchNorm's class, constructor, process group and state_dict,
    plus BatchNormAct2d's activation options and their errors."""
    m = ct.SyncBatchNormAct2d(6, 1e-3, 0.2, process_group="g", act_layer="leaky_relu",
                              act_kwargs={"negative_slope": 0.3}, memory="inplace")  # fmt: skip
    ref = nn.SyncBatchNorm(6, 1e-3, 0.2, process_group="g")
    assert isinstance(m, nn.SyncBatchNorm) and m.process_group == "g"
    assert m.state_dict().keys() == ref.state_dict().keys()
    options = (m.eps, m.momentum, m.act, m.negative_slope, m.memory)
    assert options == (1e-3, 0.2, "leaky_relu", 0.3, "inplace")
    assert repr(m).endswith("act='leaky_relu', negative_slope=0.3, memory='inplace')"), repr(m)
    assert ct.SyncBatchNormAct2d(4, bias=False).bias is None
    assert ct.SyncBatchNormAct2d(4, apply_act=False).act == "identity"
    with pytest.raises(
        ValueError, match="SyncBatchNormAct2d: memory='inplace' needs an invertible"
    ):
        ct.SyncBatchNormAct2d(4, memory="inplace")
    with pytest.raises(ValueError, match="SyncBatchNormAct2d: act_layer='gelu' is not supported"):
        ct.SyncBatchNormAct2d(4, act_layer="gelu")
    with pytest.raises(TypeError, match="SyncBatchNormAct2d: residual must be a torch.Tensor"):
        ct.SyncBatchNormAct2d(4)(torch.randn(2, 4, 3, 3), 1.0)


@pytest.mark.parametrize("act", list(ACTS))
def test_outside_a_group_it_is_batchnorm_and_activation(act):
    """No process group: PyTorch's BatchNorm, the residual and the activation
    bit for bit, training and eval, the running statistics too."""
    kwargs = {"negative_slope": 0.2} if act == "leaky_relu" else None
    ours = ct.SyncBatchNormAct2d(5, act_layer=act, act_kwargs=kwargs)
    bn, fn = nn.BatchNorm2d(5), ACTS[act]()
    with torch.no_grad():
        ours.weight.uniform_(-2, 2)
        ours.bias.uniform_(-1, 1)
    bn.load_state_dict(ours.state_dict())
    for train in (True, True, False):
        ours.train(train)
        bn.train(train)
        x, r = torch.randn(4, 5, 6, 7), torch.randn(4, 5, 6, 7)
        testing.assert_bits_equal(ours(x, r), fn(bn(x) + r), f"train={train}")
    for a, e in zip(ours.buffers(), bn.buffers()):
        assert torch.equal(a, e)
    # other ranks than 4, as nn.SyncBatchNorm takes them (a converted BatchNorm1d): its path
    flat, bn1 = ct.SyncBatchNormAct2d(5, act_layer=act, act_kwargs=kwargs), nn.BatchNorm1d(5)
    x = torch.randn(8, 5)
    testing.assert_bits_equal(flat(x), fn(bn1(x)), "2-D input")
    with pytest.raises(ValueError, match="expected at least 2D input"):
        flat(torch.randn(5))


class SyncBatchNormAct(nn.SyncBatchNorm):
    """timm's SyncBatchNormAct's shape (an nn.SyncBatchNorm with act and drop)."""

    def __init__(self, c, act):
        super().__init__(c, process_group="timm-group")
        self.act, self.drop = act, nn.Identity()


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d's shape."""

    def __init__(self, c, act):
        super().__init__(c)
        self.act, self.drop = act, nn.Identity()


def test_fusers_take_sync_batchnorm_pairs():
    """fuse_batchnorm_act: an nn.SyncBatchNorm -> activation pair in an
    nn.Sequential and timm's SyncBatchNormAct become SyncBatchNormAct2d,
    holding the same parameters and buffers and their process group; the
    in-place mode applies after a convolution."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4, process_group="g"), nn.LeakyReLU(0.1),
        SyncBatchNormAct(4, nn.ReLU()),
    )  # fmt: skip
    sync, timm_like = model[1], model[3]
    model, count = ct.fuse_batchnorm_act(model, memory="inplace")
    assert count == 2 and type(model[2]) is nn.Identity
    first, second = model[1], model[3]
    assert type(first) is type(second) is ct.SyncBatchNormAct2d
    options = (first.process_group, first.memory, first.act, first.negative_slope)
    assert options == ("g", "inplace", "leaky_relu", 0.1)
    assert (second.process_group, second.memory, second.act) == ("timm-group", "default", "relu")
    assert first.weight is sync.weight and first.running_var is sync.running_var
    assert second.bias is timm_like.bias


def test_convert_sync_batchnorm_keeps_the_activation():
    """ct.convert_sync_batchnorm: a BatchNormAct2d becomes a SyncBatchNormAct2d
    (parameters, buffers, activation, memory mode, training flag kept), any
    other BatchNorm nn.SyncBatchNorm. PyTorch's own converter would drop the
    fused activation: the reason this one exists."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.LeakyReLU(0.1), nn.BatchNorm2d(4)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the last BatchNorm has no activation)
        model, _ = ct.fuse_batchnorm_act(model, memory="inplace")
        pair, _ = ct.fuse_batchnorm_act(nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()))
    fused = model[1]
    model.eval()
    lost = nn.SyncBatchNorm.convert_sync_batchnorm(pair)
    assert type(lost[0]) is nn.SyncBatchNorm and type(lost[1]) is nn.Identity  # (no ReLU left)
    model = ct.convert_sync_batchnorm(model, process_group="g")
    new = model[1]
    assert type(new) is ct.SyncBatchNormAct2d and new.process_group == "g" and not new.training
    assert (new.act, new.negative_slope, new.memory) == ("leaky_relu", 0.1, "inplace")
    assert new.weight is fused.weight and new.num_batches_tracked is fused.num_batches_tracked
    assert type(model[3]) is nn.SyncBatchNorm and model[3].process_group == "g"
    single = ct.convert_sync_batchnorm(ct.BatchNormAct2d(3, act_layer="identity"))
    assert type(single) is ct.SyncBatchNormAct2d and single.process_group is None
    timm_like = ct.convert_sync_batchnorm(nn.Sequential(BatchNormAct2d(3, nn.LeakyReLU(0.3))))
    assert type(timm_like[0]) is ct.SyncBatchNormAct2d
    assert (timm_like[0].act, timm_like[0].negative_slope) == ("leaky_relu", 0.3)


def _torchrun(case: str, device: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests" / "sync_worker.py"), case, device],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and f"PASS {case} {device}" in proc.stdout, out[-8000:]
    print(proc.stdout)


@pytest.mark.parametrize("case", ["standins", "refused"])
def test_statistics_over_two_processes_on_cpu(case):
    """gloo, two processes: the module's collectives, count weighting,
    running statistics and gradients (kernels' arithmetic stood in for),
    and PyTorch's error for CPU tensors in a group (sync_worker.py)."""
    _torchrun(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["kernels", "ddp"])
def test_statistics_over_two_processes_on_cuda(case):
    """The CUDA kernels in two processes (NCCL over two GPUs, else gloo on
    one): against a float64 whole-batch reference and PyTorch's
    nn.SyncBatchNorm; DDP training losses (sync_worker.py)."""
    _torchrun(case, "cuda")


@pytest.mark.parametrize("memory", ["default", "inplace"])
@pytest.mark.parametrize("shape,layout", [
    ((4, 6, 5, 7), "nchw"), ((3, 5, 4, 4), "channels_last"), ((0, 6, 3, 3), "nchw"),
    ((2, 16, 1, 1), "channels_last"),
])  # fmt: skip
def test_launch_plan_of_the_synchronized_passes(shape, layout, memory, monkeypatch):
    """The four calls' launches on CPU tensors, recorded, not made: the local
    passes write their sums where the all-reduce reads them (flag SUMS), the
    finishing passes read the totals and keep the count after the moments;
    every buffer as large as its pass indexes (an empty batch launches no
    local pass); a sums buffer without the count is refused before any launch."""
    from conftest import record_bn_launches

    from cupy_act import _batchnorm, _launch
    from cupy_act.torch import _bn_kernels as K

    recorded = record_bn_launches(monkeypatch)
    inplace = memory == "inplace"
    mode = K.Mode("leaky_relu", 0.1, False, inplace, True)
    x = torch.randn(shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[1]
    w, b, rm, rv = torch.rand(c) + 0.5, torch.randn(c), torch.zeros(c), torch.ones(c)
    sums, s = K.sync_sums(x, mode)
    assert sums.numel() == 2 * c + 1 and s.channels_last == K.layout_of(x)
    y, stats, mask = K.sync_forward(x, w, b, None, rm, rv, None, 0.1, 1e-5, mode, s, sums)
    gy = torch.randn_like(x)
    src = y if inplace else x
    gsums, gw, gb = K.sync_grad_sums(src, gy, mask, w, b, stats, None, s, mode, True, True)
    dx, _ = K.sync_backward(src, gy, mask, w, b, stats, None, s, mode, gsums, False)
    assert gsums.numel() == 2 * c and dx.shape == x.shape and (gw.numel(), gb.numel()) == (c, c)
    finish = ["bn_finalize"] if s.channels_last else []
    local = [] if x.numel() == 0 else ["bn_reduce", *finish]
    fields = len(_batchnorm.Buffers._fields)
    launched = [
        (name.split("<")[0].split("::")[1], _batchnorm.Buffers(*f[:fields]), f[-1])
        for name, f in recorded
    ]
    names = [n for n, _, _ in launched]
    assert names == local + ["bn_finish_sums", "bn_forward"] + local + [
        "bn_finish_sums",
        "bn_backward",
    ]
    ps = _batchnorm.prepare(s, 0, "forward_sync")
    stats_moments = stats.data_ptr() + ps.moments
    by_pass = iter(launched)
    for kernel, buffers, flags in by_pass:
        if kernel == "bn_finish_sums":
            break
        assert buffers.moments == sums.data_ptr() and flags & _batchnorm.SUMS  # (forward, local)
    assert buffers.partial == sums.data_ptr() and buffers.moments == stats_moments
    assert buffers.running_mean == rm.data_ptr() and not flags & _batchnorm.SUMS
    rest = [t for t in by_pass][1:]  # (after the forward's elementwise pass)
    for _, buffers, flags in rest[: len(local)]:
        assert buffers.moments == gsums.data_ptr() and flags & _batchnorm.SUMS
        assert (
            buffers.grad_weight == gw.data_ptr() and bool(flags & _batchnorm.FROM_OUTPUT) == inplace
        )
    kernel, buffers, flags = rest[len(local)]
    assert kernel == "bn_finish_sums" and buffers.partial == gsums.data_ptr()
    assert buffers.moments == stats_moments and buffers.grad_weight == 0  # (the count; gw local)
    launched.clear()
    with pytest.raises(_launch.SizeMismatch, match="partial has"):
        K.sync_forward(x, w, b, None, rm, rv, None, 0.1, 1e-5, mode, s, sums[: 2 * c])
    assert launched == []
