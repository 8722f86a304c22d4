"""The kernel instantiations: which C++ template each call launches.

Every kernel is ``cupy_act::act_kernel<Op<T>, Kind, HasBias, Unroll>`` from
``cuda/elementwise.cu``; the ops, their functors and launch shapes come from
the registry (``_registry.OPS``). Instantiations are grouped in one module per
(op, dtype), compiled on first use (see ``_loader``).
"""

from __future__ import annotations

from ._registry import KINDS, OPS

# dtype name (numpy / torch spelling) -> C++ storage type
CTYPES = {
    "float32": "float",
    "float64": "double",
    "float16": "cupy_act::half_t",
    "bfloat16": "cupy_act::bfloat16_t",
}
DTYPES = tuple(CTYPES)
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


def unroll(op: str, dtype: str, kind: str) -> int:
    """16-byte vectors per thread and trip of the kernel's loop."""
    return OPS[op].unroll[kind][ITEMSIZE[dtype]]


def kernel_name(op: str, dtype: str, kind: str, bias: bool = False) -> str:
    """The C++ name expression of one instantiation."""
    return (
        f"cupy_act::act_kernel<cupy_act::{OPS[op].functor}<{CTYPES[dtype]}>, "
        f"{KINDS.index(kind)}, {'true' if bias else 'false'}, {unroll(op, dtype, kind)}>"
    )


def module_keys(op: str, dtype: str) -> tuple[tuple[str, str, str, bool], ...]:
    """(op, dtype, kind, bias) of the instantiations in (op, dtype)'s module.

    Only ops with a divisor take a bias, and only going forward."""
    keys = []
    for kind in KINDS:
        keys.append((op, dtype, kind, False))
        if OPS[op].divisor and kind != "backward":
            keys.append((op, dtype, kind, True))
    return tuple(keys)


def all_kernel_keys() -> tuple[tuple[str, str, str, bool], ...]:
    """(op, dtype, kind, bias) of every instantiation the library launches, in a fixed order."""
    return tuple(key for op in OPS for dtype in DTYPES for key in module_keys(op, dtype))


def all_kernel_names() -> tuple[str, ...]:
    """The name expressions of ``all_kernel_keys()``, in the same order."""
    return tuple(kernel_name(*key) for key in all_kernel_keys())
