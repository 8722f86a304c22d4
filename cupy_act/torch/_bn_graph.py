"""Inductor's joint graph around the BatchNorm op: what a compiled graph does
next to the op, folded in where that saves a pass over the tensor.

An opaque op ends Inductor's fusion, so two neighbours that Inductor fuses
into its own BatchNorm kernels cost whole passes beside ours (cspdarknet53,
batch 32, float32, H200, reduce-overhead, 2026-11-29: about 0.33 ms of
separate add kernels and 0.44 ms of ATen copies in a 17.4 ms step):

* **The shortcut after the activation** (timm's DarkBlock, and any
  ``act(bn(x)) + s``): ``add(op(...)[0], s)`` becomes the op with
  ``post=s``, whose forward adds s as it writes (a pass that read y and s
  and wrote their sum, gone; s read once by the op instead). The bits are
  the add's (``cuda/batchnorm.cu``). Only where the op saves x (the default
  memory mode): the in-place mode inverts the op's output, which the add
  would change.
* **A channel slice of the op's output fed to a convolution** (a CSP
  stage's split): the slice is not dense, so the convolution's ATen path
  copies it, in the forward and again in the weight gradient, with a
  generic strided copy (about 1.8 TB/s). A ``clone`` of the slice in the
  graph lets Inductor write it dense with one generated kernel that every
  user of the slice then shares. The backward's copy: where the op is in
  place (it saves its output anyway), the clone is recomputed from that
  output, not saved beside it (half the output again); in the default mode
  the partitioner saves the dense half (a slice of y saved instead would
  keep all of y).

The pass runs on the joint forward + backward graph (before the
partitioner, so the backward reads what the forward now makes) and only
changes graphs that hold the op. ``install`` chains it after whatever
``torch._inductor.config.joint_custom_post_pass`` already held, once
Inductor is in the process (``_bn_lowering.register``, from the op's fake
kernels). ``set_compiled_folding(False)`` turns it off (Dynamo guards on the
setting and the pass's cache key holds it, so a change compiles anew).
"""

from __future__ import annotations

import contextlib
import operator
import threading

import torch

FOLD = True  # (read under Dynamo's tracing by _bn_ops.takes: Dynamo guards on it)
_state = {"installed": False}
_lock = threading.Lock()


def set_compiled_folding(on: bool) -> bool:
    """Whether compiled graphs fold a shortcut add and a convolution's slice
    of the BatchNorm op's output into the op's neighbourhood (see the module
    docstring); returns the previous setting. Dynamo recompiles on a change."""
    global FOLD
    previous, FOLD = FOLD, bool(on)
    return previous


def install() -> bool:
    """Chain the pass into Inductor's joint-graph hook once; whether it is in."""
    if _state["installed"]:
        return True
    with _lock:
        if not _state["installed"]:
            try:
                from torch._inductor import config
                from torch._inductor.custom_graph_pass import CustomGraphPass
            except ImportError:  # pragma: no cover - torch version
                return False
            config.joint_custom_post_pass = _make_pass(CustomGraphPass,
                                                       config.joint_custom_post_pass)  # fmt: skip
            _state["installed"] = True
    return True


def _make_pass(base, inner):
    # (base: Inductor's CustomGraphPass, imported only once Inductor is in use;
    # inner: the hook's previous value, None, one pass or a list of them)
    inners = [p for p in (inner if isinstance(inner, (list, tuple)) else (inner,)) if p is not None]

    class FoldBatchNormNeighbours(base):  # type: ignore[valid-type,misc]
        """cupy_act's pass, after the hook's previous passes."""

        def __call__(self, graph) -> None:
            for p in inners:
                p(graph)
            if FOLD:
                fold(graph)

        def uuid(self):
            from torch._inductor.custom_graph_pass import get_hash_for_files

            inner_ids = tuple(str(getattr(p, "uuid", lambda: repr(p))()) for p in inners)
            return (get_hash_for_files((__file__,)), FOLD, inner_ids)

    return FoldBatchNormNeighbours()


def _op():
    return torch.ops.cupy_act.batchnorm_act.default


def _is_op(node) -> bool:
    """A call of the op: direct, or (a training forward, which mutates the
    running statistics) inside functionalization's ``auto_functionalized``
    wrapper, whose kwargs are the op's arguments and whose items start with
    the op's outputs."""
    if node.op != "call_function":
        return False
    if node.target is _op():
        return True
    return "auto_functionalized" in str(node.target) and node.args[:1] == (_op(),)


# the op's residual, from_output and post arguments (its schema: _bn_ops)
_RESIDUAL, _FROM_OUTPUT, _POST = 3, 10, 12


def _arg(node, i: int, name: str, default=None):
    """The op's argument ``name`` (position i) at a call (a wrapped call has them by name)."""
    if node.target is _op() and len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _output_of(node):
    """The op node whose output (item 0) ``node`` is, else None."""
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        src = node.args[0]
        if _is_op(src):
            return src
    return None


def _val(node):
    return node.meta.get("val")


def fold(graph) -> int:
    """Apply both rewrites to an FX graph; how many were made."""
    return _dense_slices(graph) + _post_adds(graph)


# -- a channel slice of the op's output that a convolution reads --


def _is_view(node) -> bool:
    """A channel split or slice (or an item of a split)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    a = torch.ops.aten
    return node.target in (a.split.Tensor, a.split_with_sizes.default, a.slice.Tensor,
                           a.narrow.default)  # fmt: skip


def _base(node):
    """The op node whose output ``node`` is a view chain of, else None."""
    while node is not None:
        op = _output_of(node)
        if op is not None:
            return op
        if not _is_view(node):
            return None
        node = node.args[0]
    return None


def _dense(t) -> bool:
    cl = t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    return t.is_contiguous() or cl


def _dense_slices(graph) -> int:
    conv = torch.ops.aten.convolution.default
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not conv:
            continue
        v = node.args[0]
        val = _val(v)
        if val is None or _dense(val) or _output_of(v) is not None or _base(v) is None:
            continue
        with graph.inserting_after(v):
            c = graph.call_function(torch.ops.aten.clone.default, (v,))
        with getattr(val, "fake_mode", None) or contextlib.nullcontext():
            c.meta["val"] = torch.ops.aten.clone.default(val)
        if _arg(_base(v), _FROM_OUTPUT, "from_output"):
            _recompute(c)
        v.replace_all_uses_with(c, delete_user_cb=lambda user: user is not c)
        done += 1
    return done


def _recompute(node) -> None:
    """Have the partitioner recompute ``node`` in the backward rather than
    save it (the tag selective activation checkpointing sets): for a clone
    of the in-place op's output, which the op saves anyway, saving the clone
    too would cost half of that output again."""
    from torch.utils.checkpoint import CheckpointPolicy

    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


# -- add(op(...)[0], s) --


def _post_adds(graph) -> int:
    add = torch.ops.aten.add.Tensor
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not add or len(node.args) != 2:
            continue
        if node.kwargs.get("alpha", 1) != 1:
            continue
        for y, s in (node.args, node.args[::-1]):
            op = _output_of(y) if isinstance(y, torch.fx.Node) else None
            if op is None or not isinstance(s, torch.fx.Node) or len(y.users) != 1:
                continue
            if _arg(op, _FROM_OUTPUT, "from_output") or _arg(op, _POST, "post") is not None:
                continue
            if _arg(op, _RESIDUAL, "residual") is not None:  # (the kernels take one of the two)
                continue
            vy, vs, vz = _val(y), _val(s), _val(node)
            if vy is None or vs is None or vz is None or order[s] > order[op]:
                continue
            if vs.shape != vy.shape or vs.dtype != vy.dtype or vz.dtype != vy.dtype:
                continue
            if vz.stride() != vy.stride():  # (the graph after it was traced with the add's)
                continue
            if vs.device != vy.device:
                continue
            # (a wrapped op: args holds the op alone, kwargs its arguments)
            args, kwargs = op.args, {**op.kwargs, "post": s}
            if len(args) > _POST:  # (post given by position)
                args, kwargs = (*args[:_POST], s, *args[_POST + 1 :]), op.kwargs
            with graph.inserting_before(op):
                fused = graph.call_function(op.target, args, kwargs)
            fused.meta.update(op.meta)
            order[fused] = order[op]
            op.replace_all_uses_with(fused)
            node.replace_all_uses_with(y)
            graph.erase_node(node)
            graph.erase_node(op)
            done += 1
            break
    return done
