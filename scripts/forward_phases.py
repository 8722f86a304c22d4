"""Where a tile's time goes in the fused forward, phase by phase: clock64()
stamps in a copy of the kernel.

    PYTHONPATH=. python scripts/forward_phases.py [--dtype float32]
        [--algorithm fused] [--padding 0] [--grad]

Copies cupy_act/ and cuda/ to a temporary directory, inserts clock64()
stamps at the phase boundaries of conv2d_kernel's tile loop (wgmma path),
runs the seed shape (conv 8->64 3x3 on 128x8x128x128, NCHW) there in a child
process (``--grad``: as training runs it, the mask written too) and prints,
per phase, the mean SM cycles per tile that a warp spends in it (over all
blocks; per warp of the block too), at the GPU's own clocks. The phases:

  wait+barrier  the staged rows' wait and the tile's first barrier
  mask out      the last tile's mask words to memory (put_tile_mask_nchw) and its
                row seam lines (put_seams)
  copy          the depth offsets, the ring's new rows split into place (the
                first tile: the whole patch and the weights)
  barrier       the second barrier
  stage         the next tile's rows issued (a tensor copy, cp.async or an
                L2 prefetch)
  mma           the MMA loop, waited for
  epilogue      bias, scale, LeakyReLU, stores, mask bits to shared memory

The stamps cost a few instructions each; the sum is the instrumented
kernel's time per tile, which the script also prints as a share of the
kernel's duration (CUDA events), so that the two can be compared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ["wait+barrier", "mask out", "copy", "barrier", "stage", "mma", "epilogue"]
_N = len(PHASES)
_MARK = "_ph_mark"  # the inserted macro


def _after(anchor: str, phase: int, indent: str) -> tuple[str, str]:
    """The edit that stamps the end of ``phase`` right after ``anchor``."""
    return anchor, f"{anchor}{indent}{_MARK}({phase})\n"


_WEIGHTS = "load_weights<T, kPasses>(bs, p, w, tile_n, c0, tid);\n"
_BLOCK = "blockIdx.x * gridDim.y + blockIdx.y"
_BODY = "// The kernels' body; kTmap:"
_END = "  // the last tile's mask words and seam lines\n"
# (text in cuda/conv2d.cu, replacement); each text must occur once.
EDITS = [
    (
        _BODY,
        # [block][warp][phase, then the block's tile count]
        f'extern "C" __device__ long long phase_cycles[4096][4][{_N + 1}];\n'
        f"#define {_MARK}(i) {{ const long long _n = clock64(); _ph[i] += _n - _tp; _tp = _n; }}\n"
        f"{_BODY}",
    ),
    (
        "  for (int tile = tile_first; tile < tile_end; ++tile) {\n",
        f"  long long _ph[{_N}] = {{}};\n  long long _tp = clock64();\n"
        "  for (int tile = tile_first; tile < tile_end; ++tile) {\n",
    ),
    _after(
        "      __syncthreads();  // the previous MMAs and epilogue are done with shared memory\n",
        0,
        "      ",
    ),
    _after("                    at, tile_n, tid);\n", 1, "        "),  # (after put_seams)
    (
        f"{_WEIGHTS}      __syncthreads();\n",
        f"{_WEIGHTS}      {_MARK}(2)\n      __syncthreads();\n      {_MARK}(3)\n",
    ),
    _after("        staged = tma || stage_ok;\n      }\n", 4, "      "),
    _after("        wgmma_chunk<kPasses>(wacc, a_wg, koff, b_desc, p.kc_pad, t);\n", 5, "        "),
    (
        "tile_words, head, tail, warp, g, t);\n      }\n    } else {\n",
        f"tile_words, head, tail, warp, g, t);\n      }}\n      {_MARK}(6)\n    }} else {{\n",
    ),
    (
        _END,
        f"  if ((tid & 31) == 0 && {_BLOCK} < 4096) {{\n"
        f"    for (int i = 0; i < {_N}; ++i) phase_cycles[{_BLOCK}][warp][i] = _ph[i];\n"
        f"    phase_cycles[{_BLOCK}][warp][{_N}] = tile_end - tile_first;\n"
        "  }\n"
        f"{_END}",
    ),
]


def make_copy(where: Path) -> Path:
    """cupy_act/ and cuda/ under ``where``, the forward kernel stamped."""
    shutil.copytree(ROOT / "cupy_act", where / "cupy_act")
    shutil.copytree(ROOT / "cuda", where / "cuda")
    path = where / "cuda" / "conv2d.cu"
    text = path.read_text()
    for old, new in EDITS:
        if text.count(old) != 1:
            raise SystemExit(f"forward_phases: the kernel changed; update the edit of {old!r}")
        text = text.replace(old, new)
    path.write_text(text)
    return where


def child(dtype_name: str, algorithm: str, padding: int, grad: bool) -> None:
    """Run the seed shape's forward, then print the stamps' means."""
    import cupy
    import torch

    import cupy_act.torch as ct
    from cupy_act import _conv, testing

    dt = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(128, 8, 128, 128, device="cuda", dtype=dt)
    w = (torch.randn(64, 8, 3, 3, device="cuda", dtype=dt) * 0.1).requires_grad_(grad)
    b = torch.randn(64, device="cuda", dtype=dt).requires_grad_(grad)

    def call():
        return ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, 1, padding, algorithm=algorithm)

    ms = testing.median_ms(call, iters=7, warmup=3, reps=10)
    shape, errors, buf = (4096, 4, _N + 1), [], None
    for module in _conv._modules.values():
        try:  # (extern "C": the symbol's name as written)
            ptr = module.get_global("phase_cycles")
        except Exception as e:  # another module (no stamps)
            errors.append(repr(e))
            continue
        buf = cupy.ndarray(shape, dtype=cupy.int64, memptr=ptr)
    if buf is None:
        raise SystemExit(f"forward_phases: no stamped module: {errors}")
    buf[...] = 0
    call()
    torch.cuda.synchronize()
    a = buf.get()
    a = a[a[:, 0, _N] > 0]  # the blocks that ran
    tiles = a[:, 0, _N].sum()
    per_warp = a[:, :, :_N].sum(axis=0) / tiles  # [warp][phase], cycles per tile
    mean = per_warp.mean(axis=0)
    clock = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"] // 1000  # MHz, the top one
    print(f"kernel {ms * 1000:.1f} us per call (CUDA events, 10 calls per timing), "
          f"{len(a)} blocks, {tiles / len(a):.1f} tiles per block")  # fmt: skip
    print(f"{'phase':14s} {'cycles/tile':>11s} {'share':>6s}  " + " ".join(
        f"{'warp ' + str(i):>8s}" for i in range(4)))  # fmt: skip
    for i, name in enumerate(PHASES):
        cells = " ".join(f"{per_warp[k, i]:8.0f}" for k in range(4))
        print(f"{name:14s} {mean[i]:11.0f} {mean[i] / mean.sum():6.1%}  {cells}")
    per_tile = mean.sum()
    print(f"{'sum':14s} {per_tile:11.0f}")
    if clock:  # (the SM clock's top; the GPU may run lower)
        blocks_per_sm = len(a) / torch.cuda.get_device_properties(0).multi_processor_count
        est = per_tile * tiles / len(a) / clock  # us per block (cycles / MHz)
        print(f"a block's tiles end to end: {est:.1f} us at {clock} MHz "
              f"({blocks_per_sm:.1f} blocks per SM run side by side)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--algorithm", default="fused", choices=["fused", "fused_tf32"])
    ap.add_argument("--padding", type=int, default=0, help="the convolution's (seed: 0)")
    ap.add_argument(
        "--grad",
        action="store_true",
        help="the weight and bias need a gradient: the training forward, with its mask",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.dtype, args.algorithm, args.padding, args.grad)
        return
    with tempfile.TemporaryDirectory() as tmp:
        where = make_copy(Path(tmp))
        cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--algorithm",
               args.algorithm, "--padding", str(args.padding)]  # fmt: skip
        cmd += ["--grad"] if args.grad else []
        env = dict(os.environ, PYTHONPATH=str(where))
        what = "with the mask (training)" if args.grad else "no mask (inference)"
        print(f"forward, {args.dtype}, {args.algorithm}, padding {args.padding}, {what}",
              flush=True)  # fmt: skip
        subprocess.run(cmd, env=env, check=True, timeout=600)


if __name__ == "__main__":
    main()
