"""fuse_batchnorm_act_fx: BatchNorm -> activation pairs found in a traced graph
(torchvision-style blocks that call their layers from forward)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as tf
from torch import nn

import cupy_act.torch as ct
from cupy_act import testing


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck, shape for shape: one activation module
    shared by three calls, the last after the residual add."""

    def __init__(self, cin: int, mid: int, cout: int, act: nn.Module, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = act
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    """A stem and two bottlenecks, then the functional forms: F.leaky_relu with
    a slope (positional and keyword), torch.relu, Tensor.relu_, and a
    BatchNorm read twice (not fused)."""

    def __init__(self, act: type = nn.ReLU):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act()
        self.layer1 = nn.Sequential(Bottleneck(8, 4, 16, act(), 2), Bottleneck(16, 4, 16, act()))
        self.conv_f, self.bn_f = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv_g, self.bn_g = nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16)
        self.bn_t, self.bn_m, self.bn_h = (nn.BatchNorm2d(16) for _ in range(3))
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        x = tf.leaky_relu(self.bn_f(self.conv_f(x)), 0.2)
        g = self.conv_g(x)
        x = tf.leaky_relu(self.bn_g(g), negative_slope=0.3) + g  # (conv_g's output read twice)
        x = torch.relu(self.bn_t(x))
        x = self.bn_m(x).relu_()
        h = self.bn_h(x)
        x = tf.relu(h) + h  # (bn_h's output read twice: not fused)
        return self.fc(x.mean((2, 3)))


FUSED = {  # path -> (act, slope)
    "bn1": ("relu", 0.0),
    "layer1.0.bn1": ("relu", 0.0),
    "layer1.0.bn2": ("relu", 0.0),
    "layer1.1.bn1": ("relu", 0.0),
    "layer1.1.bn2": ("relu", 0.0),
    "bn_f": ("leaky_relu", 0.2),
    "bn_g": ("leaky_relu", 0.3),
    "bn_t": ("relu", 0.0),
    "bn_m": ("relu", 0.0),
    "layer1.0.bn3": ("relu", 0.0),  # (the residual tails: bn3(out) += identity; relu)
    "layer1.1.bn3": ("relu", 0.0),
}


def _steps(model, xs, ts):
    """Two SGD steps: outputs, gradients and the float buffers (the counts
    apart: num_batches_tracked)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for x, t in zip(xs, ts):
        opt.zero_grad(set_to_none=True)
        y = model(x)
        tf.cross_entropy(y, t).backward()
        opt.step()
        out += [y.detach(), *(p.grad for p in model.parameters())]
    counts = [float(b) for b in model.buffers() if not b.is_floating_point()]
    return out + [b for b in model.buffers() if b.is_floating_point()] + [torch.tensor(counts)]


def test_fuses_pairs_the_graph_shows_and_trains_as_before():
    """Every BatchNorm whose one use is a ReLU / LeakyReLU (module, function,
    method), or an addition feeding one (the bottlenecks' tails, which then
    take the identity as their residual), is fused, with its slope; the rest
    stay. The graph module shares
    the model's parameters, keeps its state_dict keys and trains bit for bit
    as the model (CPU: PyTorch's normalization, our activation); the model
    itself is unchanged."""
    torch.manual_seed(0)
    model = TinyResNet()
    reference = copy.deepcopy(model)
    gm, count = ct.fuse_batchnorm_act_fx(model)
    assert count == len(FUSED)
    fused = {n: m for n, m in gm.named_modules() if isinstance(m, ct.BatchNormAct2d)}
    assert {n: (m.act, m.negative_slope if m.act == "leaky_relu" else 0.0) for n, m in
            fused.items()} == FUSED  # fmt: skip
    assert all(m.memory == "default" for m in fused.values())
    assert type(gm.get_submodule("bn_h")) is nn.BatchNorm2d
    assert type(gm.get_submodule("layer1.0.downsample.1")) is nn.BatchNorm2d  # (the other addend)
    tails = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("bn3")]
    assert [len(n.args) for n in tails] == [2, 2]  # (input, residual)
    assert not any(n.op == "call_function" and "add" in str(n.target) for n in gm.graph.nodes
                   if n.target is not None and "layer1" in n.name)  # fmt: skip
    assert not any(isinstance(m, ct.BatchNormAct2d) for m in model.modules())
    assert list(gm.state_dict()) == list(model.state_dict())
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    xs = [torch.randn(4, 3, 12, 12) for _ in range(2)]
    ts = [torch.randint(0, 10, (4,)) for _ in range(2)]
    for i, (a, e) in enumerate(zip(_steps(gm, xs, ts), _steps(reference, xs, ts))):
        testing.assert_bits_equal(a, e, f"output {i}")


def test_inplace_mode_where_a_convolution_output_is_read_once():
    """memory="inplace" on LeakyReLU pairs whose BatchNorm reads a convolution
    output nothing else reads; a BatchNorm with a zero in its weight keeps the
    default, with a warning naming it; ReLU pairs keep the default (not
    invertible)."""
    model = TinyResNet(act=lambda: nn.LeakyReLU(0.1))
    with torch.no_grad():
        model.layer1[1].bn2.weight[3] = 0
    with pytest.warns(UserWarning, match=r"\(layer1\.1\.bn2\) keep memory='default', as they have"):
        gm, count = ct.fuse_batchnorm_act_fx(model, memory="inplace")
    assert count == len(FUSED)
    modes = {n: m.memory for n, m in gm.named_modules() if isinstance(m, ct.BatchNormAct2d)}
    assert modes == {
        "bn1": "inplace",
        "layer1.0.bn1": "inplace",
        "layer1.0.bn2": "inplace",
        "layer1.1.bn1": "inplace",
        "layer1.1.bn2": "default",  # (a zero weight)
        "bn_f": "inplace",
        "bn_g": "default",  # (conv_g's output is read twice)
        "bn_t": "default",  # (relu, and it reads a sum)
        "bn_m": "default",  # (relu)
        "layer1.0.bn3": "inplace",  # (LeakyReLU after the addition: invertible)
        "layer1.1.bn3": "inplace",
    }
    x = torch.randn(2, 3, 12, 12)
    testing.assert_bits_equal(gm(x), model(x))


def test_bad_inputs_are_named():
    class Untraceable(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x  # (data-dependent control flow)

    with pytest.raises(TypeError, match="cannot trace Untraceable"):
        ct.fuse_batchnorm_act_fx(Untraceable())
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        ct.fuse_batchnorm_act_fx(lambda x: x)
    with pytest.raises(ValueError, match="memory='half'"):
        ct.fuse_batchnorm_act_fx(TinyResNet(), memory="half")


def test_sync_batchnorm_fused_and_shared_modules_left():
    """A SyncBatchNorm -> ReLU pair becomes a SyncBatchNormAct2d (its process
    group kept); a BatchNorm module called at two places is not fused (one
    module cannot be both), with a warning naming it."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.sync = nn.BatchNorm2d(4), nn.SyncBatchNorm(4, process_group="pg")

        def forward(self, x):
            return torch.relu(self.bn(x)) + torch.relu(self.bn(x * 2)) + torch.relu(self.sync(x))

    model = Shared()
    with pytest.warns(UserWarning, match=r"1 BatchNorm\(s\) \(bn\) are not followed"):
        gm, count = ct.fuse_batchnorm_act_fx(model)
    assert count == 1 and type(gm.bn) is nn.BatchNorm2d
    assert type(gm.sync) is ct.SyncBatchNormAct2d and gm.sync.process_group == "pg"
    assert gm.sync.weight is model.sync.weight and gm.sync.act == "relu"
    assert "relu" not in gm.code.split("self.sync")[1].split("\n")[0]


@pytest.mark.gpu
def test_fused_graph_runs_the_kernels_on_cuda():
    """On CUDA the fused modules run the kernels (float32 accuracy, not bit
    equality) in both memory modes: two training steps' outputs, gradients
    and running statistics each within 1e-3 of the model's (relative to its
    largest value, plus 1e-6), the counts equal."""
    torch.manual_seed(0)
    model = TinyResNet(act=lambda: nn.LeakyReLU(0.1)).cuda()
    xs = [torch.randn(8, 3, 16, 16, device="cuda") for _ in range(2)]
    ts = [torch.randint(0, 10, (8,), device="cuda") for _ in range(2)]
    # (convolutions in float32, not TF32: the comparison is of the BatchNorms')
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    try:
        want = _steps(copy.deepcopy(model), xs, ts)
        runs = {}
        for memory in ("default", "inplace"):
            # (the residual blocks' last BatchNorms feed an addition: left, and said)
            with pytest.warns(UserWarning, match="not followed by an activation"):
                gm, _ = ct.fuse_batchnorm_act_fx(copy.deepcopy(model), memory=memory)
            calls = []
            apply = ct.batchnorm._apply_fused
            ct.batchnorm._apply_fused = lambda *a: calls.append(1) or apply(*a)
            try:
                runs[memory] = _steps(gm, xs, ts), len(calls)
            finally:
                ct.batchnorm._apply_fused = apply
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    for memory, (got, calls) in runs.items():
        assert calls == 2 * len(FUSED), memory
        assert len(got) == len(want)
        for i, (a, e) in enumerate(zip(got, want)):
            assert a.shape == e.shape, (memory, i)
            # (1e-6 absolute: gradients that are zero but for rounding, ~1e-8 here)
            err = (a.double() - e.double()).abs().max().item()
            assert err <= 1e-3 * e.abs().max().item() + 1e-6, (memory, i, err)
        assert torch.equal(got[-1], want[-1]), memory  # (num_batches_tracked)
