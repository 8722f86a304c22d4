"""Two-process checks of SyncBatchNormAct2d, run under torchrun by
tests/test_syncbatchnorm.py (each case in fresh processes):

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/sync_worker.py CASE DEVICE

Cases:
  standins  (cpu) the module's collectives and bookkeeping over gloo, the
            kernels' arithmetic replaced by float64 torch stand-ins
            (``_STANDINS``): outputs, every gradient and the running
            statistics against one float64 BatchNorm over the whole
            batch (all ranks' inputs concatenated).
  refused   (cpu) training in a group on CPU tensors: PyTorch's own error.
  kernels   (cuda) the CUDA kernels, against the same whole-batch float64
            reference: errors at most twice those of PyTorch's
            nn.SyncBatchNorm + activation on the same data, plus a floor.
  ddp       (cuda) 20 DDP training steps of a small network with every
            BatchNorm synchronized: losses against PyTorch's, beside
            PyTorch's own float32 noise (its channels-last run).

With two GPUs each rank takes its own over NCCL; with one, both share it
over gloo. Each case loops over uneven batch sizes (a rank with batch 1, a
rank with none), activations, memory modes, layouts, a residual and the
momentum's two rules. Rank 0 prints "PASS CASE DEVICE" last.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act.torch import _bn_kernels as _K  # noqa: E402
from cupy_act.torch import _impl  # noqa: E402
from cupy_act.torch import batchnorm as bnmod  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
ACTS = {
    "relu": lambda s: nn.ReLU(),
    "leaky_relu": nn.LeakyReLU,
    "identity": lambda s: nn.Identity(),
}
# (batch per rank, channels, H, W): a rank with one value per channel, a rank
# with none, uneven batches, 16-byte vectors (the first SYNC_WORKER_SHAPES, if
# set: the sanitizer's run)
SHAPES = [((1, 4), 5, 1, 1), ((0, 3), 4, 3, 3), ((3, 2), 6, 5, 7), ((2, 2), 16, 8, 8)]
SHAPES = SHAPES[: int(os.environ.get("SYNC_WORKER_SHAPES", len(SHAPES)))]
MODES = [  # act, slope, memory, layout, residual, momentum
    ("relu", 0.0, "default", "nchw", False, 0.1),
    ("leaky_relu", 0.1, "default", "channels_last", True, None),
    ("identity", 0.0, "default", "nchw", False, 0.3),
    ("leaky_relu", 0.1, "inplace", "nchw", True, 0.1),
    ("identity", 0.0, "inplace", "channels_last", False, 0.1),
    ("relu", 0.0, "default", "channels_last", True, 0.1),
]


def _setup(device: str) -> torch.device:
    """This rank's device, the process group started (gloo on the CPU or one
    shared GPU, NCCL with a GPU per rank)."""
    nccl = device == "cuda" and torch.cuda.device_count() >= WORLD
    dev = torch.device("cpu" if device == "cpu" else f"cuda:{RANK if nccl else 0}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if nccl else "gloo")
    return dev


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.contiguous(
        memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format
    )


# ---- float64 stand-ins for the kernels' four calls (the "standins" case) ----


def _act(t, act, slope):
    if act == "relu":
        return t.clamp_min(0)
    return torch.where(t > 0, t, t * slope) if act == "leaky_relu" else t


def _sums(x, mode):
    s = _K.shape_of(x, mode.act, _K.layout_of(x))
    xd, c = x.double(), x.shape[1]
    pairs = torch.stack([xd.sum((0, 2, 3)), (xd * xd).sum((0, 2, 3))], 1).flatten()
    return torch.cat([pairs, pairs.new_tensor([x.numel() / c])]), s


def _forward(x, w, b, r, rm, rv, count, factor, eps, mode, s, sums, out=None):
    c = s.channels
    n = sums[2 * c]
    mean = sums[0 : 2 * c : 2] / n
    var = (sums[1 : 2 * c : 2] / n - mean * mean).clamp_min(0)
    if rm is not None:
        rm.copy_((1 - factor) * rm + factor * mean)
        rv.copy_((1 - factor) * rv + factor * var * n / (n - 1))
    if count is not None:
        count.add_(1)
    invstd = (var + eps).rsqrt()
    t = (x.double() - mean.view(1, -1, 1, 1)) * (invstd * w).view(1, -1, 1, 1) + b.view(1, -1, 1, 1)
    t = t + r if r is not None else t
    y = torch.empty_like(x) if out is None else out
    y.copy_(_act(t, mode.act, mode.slope))
    mask = None if (mode.inplace or not mode.grad or mode.act == "identity") else t > 0
    return y, torch.cat([mean, invstd, n.view(1)]), mask


def _dz_xhat(src, gy, mask, w, b, stats, r, s, mode):
    c = s.channels
    mean, invstd = stats[:c].view(1, -1, 1, 1), stats[c : 2 * c].view(1, -1, 1, 1)
    v = src.double()
    if mode.inplace:  # invert the activation and the affine transform
        bit = v > 0
        z = torch.where(bit, v, v / mode.slope) if mode.act == "leaky_relu" else v
        z = z - r.double() if r is not None else z
        xhat = (z - b.view(1, -1, 1, 1)) / w.view(1, -1, 1, 1)
    else:
        bit, xhat = mask, (v - mean) * invstd
    g = gy.double()
    if mode.act == "relu":
        g = torch.where(bit, g, 0.0)
    elif mode.act == "leaky_relu":
        g = torch.where(bit, g, g * mode.slope)
    return g, xhat


def _grad_sums(src, gy, mask, w, b, stats, r, s, mode, need_w, need_b, skip=0):
    dz, xhat = _dz_xhat(src, gy, mask, w, b, stats, r, s, mode)
    sdz, sdzx = dz.sum((0, 2, 3)), (dz * xhat).sum((0, 2, 3))
    sums = torch.stack([sdz, sdzx], 1).flatten()
    return sums, sdzx.float() if need_w else None, sdz.float() if need_b else None


def _backward(src, gy, mask, w, b, stats, r, s, mode, sums, need_r, skip=0):
    c = s.channels
    dz, xhat = _dz_xhat(src, gy, mask, w, b, stats, r, s, mode)
    n, invstd = stats[2 * c], stats[c : 2 * c].view(1, -1, 1, 1)
    mdz, mdzx = (sums[0::2] / n).view(1, -1, 1, 1), (sums[1::2] / n).view(1, -1, 1, 1)
    dx = (dz - mdz - xhat * mdzx) * invstd * w.view(1, -1, 1, 1)
    return dx.to(src.dtype), dz.to(src.dtype) if need_r else None


_STANDINS = {"sync_sums": _sums, "sync_forward": _forward, "sync_grad_sums": _grad_sums,
             "sync_backward": _backward}  # fmt: skip


# ---- the whole-batch reference and the module's steps ----


def _data(sizes, c, h, w, step):
    g = torch.Generator().manual_seed(1000 * step + 7)
    total = (sum(sizes), c, h, w)
    x = torch.randn(total, generator=g, dtype=torch.float64) * 2 + 0.5
    return (
        x,
        torch.randn(total, generator=g, dtype=torch.float64),
        torch.randn(total, generator=g, dtype=torch.float64),
    )


def _reference(bn64, act, slope, x, dy, r):
    """Whole batch, float64: (y, dx, dr); the parameters' .grad set."""
    x = x.clone().requires_grad_(True)
    r = r.clone().requires_grad_(True) if r is not None else None
    t = bn64(x)
    y = _act(t + r if r is not None else t, act, slope)
    y.backward(dy)
    return y.detach(), x.grad, r.grad if r is not None else None


def _mine(full: torch.Tensor, sizes) -> slice:
    start = sum(sizes[:RANK])
    return full[start : start + sizes[RANK]]


def _steps(model, sizes, c, h, w, residual, layout, dev, dtype, reference=False):
    """Two training steps then one eval step: this rank's outputs and input
    (and residual) gradients, then the parameters' gradients summed over the
    ranks (what data parallelism averages), then the buffers; all float64."""
    out = []
    for step, train in enumerate((True, True, False)):
        model.train(train)
        x, dy, r = _data(sizes, c, h, w, step)
        if reference:
            y, dx, dr = _reference(
                model, model.act_name, model.slope, x, dy, r if residual else None
            )
            out += [_mine(y, sizes), _mine(dx, sizes)] + ([_mine(dr, sizes)] if residual else [])
        else:
            xr = _layout(_mine(x, sizes).to(dev, dtype), layout).requires_grad_(True)
            rr = (
                _layout(_mine(r, sizes).to(dev, dtype), layout).requires_grad_(True)
                if residual
                else None
            )
            y = (
                model(xr * 1, rr)
                if isinstance(model, ct.SyncBatchNormAct2d)
                else _torch_call(model, xr * 1, rr)
            )
            y.backward(_mine(dy, sizes).to(dev, dtype))
            out += [y.detach().double().cpu(), _grad(xr)]
            out += [_grad(rr)] if residual else []
        for p in model.parameters():
            g = _grad(p).to(p.device)
            if not reference:
                dist.all_reduce(g)
            out.append(g.cpu())
        model.zero_grad(set_to_none=True)
    out += [b.detach().double().cpu() for b in model.buffers()]
    return out


def _grad(t: torch.Tensor) -> torch.Tensor:
    """t's gradient, float64 on the CPU (zeros where none came: PyTorch's
    module gives none to a rank with an empty batch)."""
    return (t.grad if t.grad is not None else torch.zeros_like(t)).detach().double().cpu()


def _torch_call(seq, x, r):
    t = seq[0](x)
    return seq[1](t + r if r is not None else t)


def _models(sizes, c, act, slope, memory, momentum, dev):
    torch.manual_seed(c)
    kwargs = {"negative_slope": slope} if act == "leaky_relu" else None
    ours = ct.SyncBatchNormAct2d(
        c, momentum=momentum, act_layer=act, act_kwargs=kwargs, memory=memory
    ).to(dev)
    with (
        torch.no_grad()
    ):  # |w| in [0.5, 2], b small: the in-place inversion's amplification bounded
        ours.weight.copy_((torch.rand(c) * 1.5 + 0.5) * torch.where(torch.rand(c) > 0.3, 1.0, -1.0))
        ours.bias.copy_(torch.randn(c) * 0.3)
    bn64 = nn.BatchNorm2d(c, momentum=momentum).double()
    bn64.load_state_dict(ours.state_dict())
    bn64.act_name, bn64.slope = act, slope
    theirs = nn.Sequential(nn.SyncBatchNorm(c, momentum=momentum), ACTS[act](slope)).to(dev)
    theirs[0].load_state_dict(ours.state_dict())
    return ours, bn64, theirs


def _compare(got, exact, theirs, what, floor, extra=0.0):
    assert len(got) == len(exact), (what, len(got), len(exact))
    for i, (a, e) in enumerate(zip(got, exact)):
        assert a.shape == e.shape, (what, i, a.shape, e.shape)
        if e.numel() == 0:
            continue
        scale = e.abs().max().item() + 1e-30
        err = (a - e).abs().max().item() / scale
        bound = floor + extra + (2 * (theirs[i] - e).abs().max().item() / scale if theirs else 0.0)
        assert err <= bound, f"rank {RANK} {what}, output {i}: error {err:.2e} over {bound:.2e}"


def _amplification(sizes, c, h, w, model) -> float:
    """max over channels of max |xhat| + 2 |b / w| (the in-place inversion's, test_batchnorm)."""
    x = _data(sizes, c, h, w, 0)[0]
    dims = (0, 2, 3)
    xhat = (x - x.mean(dims, keepdim=True)).abs().amax(dims) / x.var(dims, unbiased=False).sqrt()
    return (
        (
            xhat
            + 2 * (model.bias.detach().double().cpu() / model.weight.detach().double().cpu()).abs()
        )
        .max()
        .item()
    )


def _cases(dev, with_torch: bool, dtype=torch.float32):
    for sizes, c, h, w in SHAPES:
        for act, slope, memory, layout, residual, momentum in MODES:
            what = f"sizes {sizes} C {c} {act} {memory} {layout} r {residual} momentum {momentum}"
            ours, bn64, theirs = _models(sizes, c, act, slope, memory, momentum, dev)
            exact = _steps(bn64, sizes, c, h, w, residual, layout, dev, dtype, reference=True)
            got = _steps(ours, sizes, c, h, w, residual, layout, dev, dtype)
            want = (
                _steps(theirs, sizes, c, h, w, residual, layout, dev, dtype) if with_torch else None
            )
            inverted = memory == "inplace"
            extra = 8 * 2.0**-24 * _amplification(sizes, c, h, w, ours) if inverted else 0.0
            yield what, got, exact, want, extra


def standins(device):
    _setup(device)
    for name, fn in _STANDINS.items():
        setattr(_K, name, fn)
    real = bnmod._fused_tensors

    def fused_tensors(m, x, synced=False):  # (synchronized calls: the kernels' path on CPU)
        if not synced:
            return None
        on_gpu, _impl.on_gpu = _impl.on_gpu, lambda x: True
        try:
            return real(m, x, synced)
        finally:
            _impl.on_gpu = on_gpu

    bnmod._fused_tensors = fused_tensors
    ran = 0
    for what, got, exact, _, extra in _cases(torch.device("cpu"), with_torch=False):
        _compare(got, exact, None, what, floor=2e-6, extra=extra)
        ran += 1
    assert ran == len(SHAPES) * len(MODES)
    _compiled(torch.device("cpu"))


def _compiled(dev):
    """Under torch.compile a synchronized call runs eagerly (a graph break per
    layer, said once in a warning): the eager module's results bit for bit."""
    import warnings

    torch._dynamo.reset()
    ours = _models((3, 2), 6, "leaky_relu", 0.1, "inplace", 0.1, dev)[0]  # (its weight: no zero)
    twin = copy.deepcopy(ours)
    compiled = torch.compile(ours, backend="aot_eager")
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for model in (compiled, compiled, twin, twin):
            x = torch.randn(4, 6, 5, 5, device=dev, generator=torch.Generator().manual_seed(RANK))
            x.requires_grad_(True)
            y = model(x * 1)
            y.backward(torch.ones_like(y))
            results += [
                y.detach(),
                x.grad,
                ours.weight.grad if model is compiled else twin.weight.grad,
            ]
    said = [w for w in caught if "SyncBatchNormAct2d under torch.compile" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    for i, (a, e) in enumerate(zip(results[:6], results[6:])):
        assert torch.equal(a, e), f"rank {RANK}: compiled against eager, result {i}"


def refused(device):
    _setup(device)
    x = torch.randn(2, 3, 4, 4)
    for m in (ct.SyncBatchNormAct2d(3), nn.SyncBatchNorm(3)):
        try:
            m(x)
        except ValueError as e:
            assert "SyncBatchNorm expected input tensor to be on GPU" in str(e), e
        else:
            raise AssertionError(f"{type(m).__name__} ran on CPU tensors in a group")
    # eval, and a one-process group, are local: the plain path on CPU
    m = ct.SyncBatchNormAct2d(3).eval()
    torch.testing.assert_close(
        m(x),
        torch.relu(nn.functional.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias)),
    )


def kernels(device):
    dev = _setup(device)
    launched = []
    real = _K.sync_sums
    _K.sync_sums = lambda *a: launched.append(1) or real(*a)
    for what, got, exact, want, extra in _cases(dev, with_torch=True):
        _compare(got, exact, want, what, floor=2e-6, extra=extra)
    assert len(launched) == 2 * len(SHAPES) * len(MODES), "the kernels ran each training step"


def ddp(device):
    from torch.nn.parallel import DistributedDataParallel

    dev = _setup(device)

    def net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.LeakyReLU(0.1),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.LeakyReLU(0.1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )  # fmt: skip

    def losses(kind, memory_format=torch.contiguous_format):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(net())
        if kind == "ours":
            model, count = ct.fuse_batchnorm_act(model, memory="inplace")
            assert (
                count == 3
                and type(model[1]) is ct.SyncBatchNormAct2d
                and model[1].memory == "inplace"
            )
        model = DistributedDataParallel(model.to(dev, memory_format=memory_format))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + RANK)
        out = []
        for _ in range(20):
            x = torch.randn(6 + 2 * RANK, 3, 16, 16, generator=g).to(
                dev, memory_format=memory_format
            )
            t = torch.randint(0, 10, (x.shape[0],), generator=g).to(dev)
            loss = nn.functional.cross_entropy(model(x), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach().double().cpu())
        return torch.stack(out)

    ours, theirs, noise_run = losses("ours"), losses("torch"), losses("torch", torch.channels_last)
    diff = ((ours - theirs).abs() / theirs.abs()).max().item()
    noise = ((noise_run - theirs).abs() / theirs.abs()).max().item()
    if RANK == 0:
        print(f"ddp losses over 20 steps: ours vs PyTorch's max relative {diff:.2e}; "
              f"PyTorch channels-last vs NCHW {noise:.2e}")  # fmt: skip
    assert diff <= max(4 * noise, 1e-4), (diff, noise)


CASES = {"standins": standins, "refused": refused, "kernels": kernels, "ddp": ddp}


def main(argv) -> int:
    case, device = argv
    import mutants  # (a deliberate bug where CUPY_ACT_MUTANT names one: tests/mutants.py)

    mutants.apply_from_env()
    CASES[case](device)
    dist.barrier()
    dist.destroy_process_group()
    if RANK == 0:
        print(f"PASS {case} {device}", flush=True)
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    # (as conformance_rows.py: leave without C++ static destructors, which
    # aborted a rank that had passed once gloo's threads were still joinable)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
