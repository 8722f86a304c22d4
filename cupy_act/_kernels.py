"""The table of kernel instantiations: which C++ template each call launches.

Every kernel is ``cupy_act::act_kernel<Op<T>, Kind, HasBias>`` from
``cuda/elementwise.cu``. This module maps (op, dtype, kind, bias) to that name
expression and lists all of them for one ``RawModule``.
"""

from __future__ import annotations

import itertools

# dtype name (numpy / torch spelling) -> C++ storage type
CTYPES = {
    "float32": "float",
    "float64": "double",
    "float16": "cupy_act::half_t",
    "bfloat16": "cupy_act::bfloat16_t",
}
DTYPES = tuple(CTYPES)
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}

# op name -> C++ functor in cuda/activations.cuh
FUNCTORS = {
    "relu": "Relu",
    "leaky_relu": "LeakyRelu",
    "div_leaky_relu": "DivLeakyRelu",
}
OPS = tuple(FUNCTORS)

# kind name -> the Kind enum value in cuda/elementwise.cu
KINDS = {"forward": 0, "forward_mask": 1, "backward": 2}

# Only the fused convolution epilogue takes a bias, and only going forward.
BIAS_OPS = ("div_leaky_relu",)


def kernel_name(op: str, dtype: str, kind: str, bias: bool = False) -> str:
    """The C++ name expression of one instantiation."""
    return (
        f"cupy_act::act_kernel<cupy_act::{FUNCTORS[op]}<{CTYPES[dtype]}>, "
        f"{KINDS[kind]}, {'true' if bias else 'false'}>"
    )


def all_kernel_keys() -> tuple[tuple[str, str, str, bool], ...]:
    """(op, dtype, kind, bias) of every instantiation the library launches, in a fixed order."""
    keys = []
    for op, dtype, kind in itertools.product(OPS, DTYPES, KINDS):
        keys.append((op, dtype, kind, False))
        if op in BIAS_OPS and kind != "backward":
            keys.append((op, dtype, kind, True))
    return tuple(keys)


def all_kernel_names() -> tuple[str, ...]:
    """The name expressions of ``all_kernel_keys()``, in the same order."""
    return tuple(kernel_name(*key) for key in all_kernel_keys())
