"""The joint-graph pass that folds the BatchNorm op's neighbours in
(``_bn_graph``): a shortcut added after the activation becomes the op's
``post``, a convolution's channel slice of the op's output a dense clone.
The graphs on CPU (the ops as stand-ins); on CUDA the op's ``post`` against
the op and PyTorch's add, and compiled steps with the pass against those
without it."""

import copy

import pytest

torch = pytest.importorskip("torch")

from test_batchnorm import _layout, _same  # noqa: E402
from test_batchnorm_compiled import _train_steps, stand_ins  # noqa: E402, F401  (a fixture)
from test_compile_route import Recorder  # noqa: E402
from torch import nn  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act.torch import _bn_graph, _bn_ops, _impl  # noqa: E402

OP = "cupy_act.batchnorm_act.default"


class _Block(nn.Module):
    """A CSP stage in small: conv -> bn+act, split in two halves; the second
    through a dark block (conv -> bn+act -> conv -> bn+act, + the half); the
    halves concatenated."""

    def __init__(self, memory="default", c=8):
        super().__init__()
        self.conv_exp, self.bn_exp = nn.Conv2d(3, c, 1), self._bn(c, memory)
        self.conv1, self.bn1 = nn.Conv2d(c // 2, c // 2, 1), self._bn(c // 2, memory)
        self.conv2, self.bn2 = nn.Conv2d(c // 2, c // 2, 3, padding=1), self._bn(c // 2, memory)

    @staticmethod
    def _bn(c, memory):
        bn = ct.BatchNormAct2d(c, act_layer="leaky_relu", memory=memory)
        bn.after_conv = True
        return bn

    def forward(self, x):
        xs, xb = self.bn_exp(self.conv_exp(x)).split(self.bn1.num_features, dim=1)
        shortcut = xb
        xb = self.bn2(self.conv2(self.bn1(self.conv1(xb))))
        return torch.cat([xs, xb + shortcut], dim=1)


def _Joint():
    """A Recorder whose joint graph gets the pass first (while folding is on),
    as Inductor's hook gives it."""
    return Recorder(lambda graph: _bn_graph.FOLD and _bn_graph.fold(graph))


def _graphs(model, x, monkeypatch):
    monkeypatch.setattr(_impl, "on_gpu", lambda t: True)
    monkeypatch.setattr(_bn_ops, "POLICY", "after_conv")
    torch._dynamo.reset()
    rec = _Joint()
    step = torch.compile(lambda t: model(t).sum(), backend=rec, fullgraph=True)
    step(x).backward()
    torch._dynamo.reset()
    return rec.graphs


def _calls(g, target):
    """Calls of ``target``; of the op (OP) also those inside ``auto_functionalized``
    (a training forward's, which mutates the running statistics)."""
    if target == OP:
        return [n for n in g.graph.nodes if _bn_graph._is_op(n)]
    return [n for n in g.graph.nodes if n.op == "call_function" and str(n.target) == target]


def _adds_of_op(g):
    """The adds that take an op's output (not num_batches_tracked's)."""
    adds = _calls(g, "aten.add.Tensor")
    return [n for n in adds if any(isinstance(a, torch.fx.Node) and _bn_graph._output_of(a)
                                   for a in n.args)]  # fmt: skip


@pytest.mark.parametrize("memory", ["default", "inplace"])
def test_shortcut_add_folds_into_the_op(memory, monkeypatch, stand_ins):  # noqa: F811
    """The dark block's ``bn2(...) + shortcut`` becomes bn2's op with
    post=shortcut where bn2 saves x (the default mode), and no add of the
    op's output is left in the forward; in place (from_output, which inverts
    the op's output) the add stays."""
    fwd, bwd = _graphs(_Block(memory), torch.randn(2, 3, 6, 6), monkeypatch)
    ops = _calls(fwd, OP)
    assert len(ops) == 3
    folds = memory == "default"
    post = [_bn_graph._arg(n, _bn_graph._POST, "post") for n in ops]
    assert [p is not None for p in post] == [False, False, folds]
    inplace = [_bn_graph._arg(n, _bn_graph._FROM_OUTPUT, "from_output") for n in ops]
    assert inplace == [not folds] * 3
    assert len(_adds_of_op(fwd)) == (0 if folds else 1)
    assert len(_calls(bwd, "cupy_act.batchnorm_act_backward.default")) == 3


def test_slice_into_a_convolution_is_made_dense(monkeypatch, stand_ins):  # noqa: F811
    """conv1 reads a clone of the split's second half, and so does bn2's op
    that takes the same half as its shortcut (post): one copy for both (and
    the one the backward saves)."""
    fwd, _ = _graphs(_Block(), torch.randn(2, 3, 6, 6), monkeypatch)
    clones = _calls(fwd, "aten.clone.default")
    assert len(clones) == 1
    users = {OP if _bn_graph._is_op(u) else str(u.target) for u in clones[0].users}
    assert users - {"output"} == {"aten.convolution.default", OP}, users
    convs = _calls(fwd, "aten.convolution.default")
    assert sum(c.args[0] is clones[0] for c in convs) == 1


def _saved(g):
    """(name, shape) of the 4-D tensors a backward graph takes from the forward."""
    return [(n.name, tuple(n.meta["val"].shape)) for n in g.graph.find_nodes(op="placeholder")
            if not n.name.startswith("tangents") and n.meta["val"].dim() == 4]  # fmt: skip


def test_inplace_clone_is_recomputed_not_saved(monkeypatch, stand_ins):  # noqa: F811
    """In place, the op saves its output: the backward recomputes the dense
    half from it instead of taking the clone too, so the forward saves what
    it saved unfolded."""
    graphs = {}
    for on in (True, False):
        previous = ct.set_compiled_folding(on)
        try:
            graphs[on] = _graphs(_Block("inplace"), torch.randn(2, 3, 6, 6), monkeypatch)
        finally:
            ct.set_compiled_folding(previous)
    assert len(_calls(graphs[True][0], "aten.clone.default")) == 1
    assert len(_calls(graphs[True][1], "aten.clone.default")) == 1
    assert sorted(s for _, s in _saved(graphs[True][1])) == sorted(
        s for _, s in _saved(graphs[False][1])
    )


def test_folding_off_leaves_the_graph(monkeypatch, stand_ins):  # noqa: F811
    previous = ct.set_compiled_folding(False)
    try:
        assert previous is True
        fwd, _ = _graphs(_Block(), torch.randn(2, 3, 6, 6), monkeypatch)
    finally:
        ct.set_compiled_folding(previous)
    assert len(_adds_of_op(fwd)) == 1
    assert _calls(fwd, "aten.clone.default") == []
    assert all(_bn_graph._arg(n, _bn_graph._POST, "post") is None for n in _calls(fwd, OP))


def test_folding_switch_recompiles(monkeypatch, stand_ins):  # noqa: F811
    """Dynamo guards on set_compiled_folding: the same compiled step runs its
    graph again while the setting stands, and compiles anew (keeping the
    add) once it is off."""
    monkeypatch.setattr(_impl, "on_gpu", lambda t: True)
    monkeypatch.setattr(_bn_ops, "POLICY", "after_conv")
    torch._dynamo.reset()
    rec, model, x = _Joint(), _Block(), torch.randn(2, 3, 6, 6)
    step = torch.compile(lambda t: model(t).sum(), backend=rec, fullgraph=True)
    previous = ct.set_compiled_folding(True)
    try:
        step(x).backward()
        n = len(rec.graphs)
        step(x).backward()
        assert len(rec.graphs) == n
        ct.set_compiled_folding(False)
        step(x).backward()
    finally:
        ct.set_compiled_folding(previous)
        torch._dynamo.reset()
    assert len(rec.graphs) == 2 * n
    assert _adds_of_op(rec.graphs[0]) == [] and len(_adds_of_op(rec.graphs[n])) == 1


def test_add_of_another_shape_or_dtype_stays(monkeypatch, stand_ins):  # noqa: F811
    """A broadcasting add (a per-channel term), one that promotes the dtype,
    one after an op that adds a residual already, or one whose sum is laid
    out otherwise than the op's output (channels-last first) is not the
    op's post."""

    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.bn_a, self.bn_b, self.bn_c, self.bn_d = (
                _Block._bn(4, "default") for _ in range(4)
            )
            self.extra = nn.Parameter(torch.ones(4, 1, 1))

        def forward(self, x):
            x = self.conv(x)
            wide = torch.ones(x.shape, dtype=torch.float64)
            cl = x.contiguous(memory_format=torch.channels_last)
            return (self.bn_a(x) + self.extra, self.bn_b(x) + wide, self.bn_c(x, x * 2) + x,
                    cl + self.bn_d(x))  # fmt: skip

    model = Broadcast()
    fwd, _ = _graphs(lambda t: sum(o.sum() for o in model(t)), torch.randn(2, 3, 6, 6),
                     monkeypatch)  # fmt: skip
    assert len(_adds_of_op(fwd)) == 4
    assert all(_bn_graph._arg(n, _bn_graph._POST, "post") is None for n in _calls(fwd, OP))


def test_install_chains_the_hook_before_it(monkeypatch):
    """install() keeps a pass the user set on the hook, runs it first, and
    folds after it; the cache key names both."""
    from torch._inductor import config

    seen = []
    monkeypatch.setitem(_bn_graph._state, "installed", False)
    monkeypatch.setattr(_bn_graph, "fold", lambda g: seen.append(("fold", g)))
    # (the config's own patch: it puts the hook's previous value back after)
    with config.patch(joint_custom_post_pass=lambda g: seen.append(g)):
        assert _bn_graph.install() and _bn_graph.install()
        hook = config.joint_custom_post_pass
    hook("graph")
    assert seen == ["graph", ("fold", "graph")]
    key = hook.uuid()
    assert key[1] is True and len(key[2]) == 1
    monkeypatch.setattr(_bn_graph, "FOLD", False)
    assert hook.uuid() != key


def test_post_is_checked():
    x = torch.empty(2, 4, 3, 3, device="meta")
    args = (x, None, None, None, None, None, 1e-5, "leaky_relu", 0.1, False)
    with pytest.raises(ValueError, match=r"post has shape \(2, 4, 3\)"):
        _bn_ops._forward_fake(*args, False, True, x[..., 0])
    with pytest.raises(ValueError, match="from_output inverts the op's output"):
        _bn_ops._forward_fake(*args, True, True, x)
    with pytest.raises(ValueError, match="residual and post: the kernels take one"):
        _bn_ops._forward_fake(x, None, None, x, *args[4:], False, True, x)


# ---- CUDA ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "offset"])
@pytest.mark.parametrize("act,slope", [("relu", 0.0), ("leaky_relu", 0.1), ("identity", 0.0)])
@pytest.mark.parametrize("evaluate", [False, True])
def test_post_equals_the_op_then_add(act, slope, layout, dtype, evaluate):
    """op(..., post=s)[0] is op(...)[0] + s bit for bit (PyTorch's add: float,
    rounded once, subnormals kept), with the same statistics and mask."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (4, 16, 9, 7)
    x = _layout(torch.randn(shape, device="cuda", generator=gen).to(dtype) * 3, layout)
    s = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    tiny = torch.finfo(dtype).tiny  # (subnormal shortcuts and signed zeros: kept, not flushed)
    s.view(-1)[:64] = torch.tensor([tiny / 4, -tiny / 2, 0.0, -0.0] * 16, dtype=dtype)
    s = _layout(s, layout)
    w = torch.rand(16, device="cuda", generator=gen) + 0.5
    b = torch.randn(16, device="cuda", generator=gen)
    rm, rv = torch.randn(16, device="cuda"), torch.rand(16, device="cuda") + 0.5
    args = (x, w, b, None, rm, rv, 1e-5, act, slope, evaluate, False, True)
    y, stats, mask = torch.ops.cupy_act.batchnorm_act(*args)
    z, stats2, mask2 = torch.ops.cupy_act.batchnorm_act(*args, post=s)
    _same(z, y + s, "y + s")
    assert (z != y).any()
    _same(stats2, stats, "stats")
    assert torch.equal(mask2, mask)


@pytest.mark.gpu
def test_opcheck_post():
    from torch.library import opcheck

    x = torch.randn(4, 8, 6, 6, device="cuda")
    w, b = torch.rand(8, device="cuda") + 0.5, torch.randn(8, device="cuda")
    opcheck(torch.ops.cupy_act.batchnorm_act,
            (x, w, b, None, None, None, 1e-5, "relu", 0.0, False, False, True),
            {"post": torch.randn_like(x)})  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("dtype,layout", [(torch.float32, "contiguous"),
                                          (torch.bfloat16, "channels_last")], ids=str)  # fmt: skip
def test_compiled_folded_equals_unfolded(dtype, layout, mode, monkeypatch):
    """A CSP stage in small, compiled by Inductor with the pass and without
    it: outputs, gradients and buffers bit for bit the same (the folded op's
    bits are the op's and the add's; the dense slice a copy), with both
    rewrites made and no recompilation across steps."""
    monkeypatch.setattr(_bn_ops, "POLICY", "after_conv")
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = _Block(c=32).cuda().to(memory_format=fmt)
    for conv in (model.conv_exp, model.conv1, model.conv2):  # (the BatchNorms' float32)
        conv.to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [_layout(torch.randn(8, 3, 12, 12, device="cuda", generator=gen).to(dtype), layout)
          for _ in range(3)]  # fmt: skip
    gy = torch.randn(8, 32, 12, 12, device="cuda", generator=gen).to(dtype)
    folded = []
    real = _bn_graph.fold
    monkeypatch.setattr(_bn_graph, "fold", lambda g: folded.append(real(g)) or folded[-1])
    runs = []
    previous = ct.set_compiled_folding(True)
    try:
        for on in (True, False):
            ct.set_compiled_folding(on)
            torch._dynamo.reset()
            step = torch.compile(copy.deepcopy(model), mode=mode, dynamic=False)
            with torch._dynamo.config.patch(error_on_recompile=True):
                runs.append(_train_steps(step, xs, None, gy, 3, graphs=mode == "reduce-overhead"))
    finally:
        ct.set_compiled_folding(previous)
        torch._dynamo.reset()
    assert folded == [2], folded  # (the shortcut add and the dense slice; once: not unfolded)
    for i, (a, e) in enumerate(zip(*runs)):
        _same(a, e, f"output {i}")
