"""The KernelBench seed problems, answered with cupy_act and run with KernelBench's protocol.

    PYTHONPATH=. python scripts/kernelbench.py [--problems 19 20 71] [--correct-trials 5]
                                              [--perf-trials 100] [--json F]

Problems (KernelBench's reference ``Model``s and shapes, restated here):
  level 1 #19  ReLU,                 x: 4096 x 393216 float32
  level 1 #20  LeakyReLU(0.01),      x: 4096 x 393216 float32
  level 2 #71  Conv2d(8, 64, 3) -> x / 2 -> LeakyReLU(0.01), x: 128 x 8 x 128 x 128

Protocol, as KernelBench evaluates a ``ModelNew`` against its ``Model``: both
are built from the same seed with the problem's init arguments; correctness is
--correct-trials runs on fresh random inputs (seeded per trial), each output
within KernelBench's tolerance (``torch.allclose(atol=1e-2, rtol=1e-2)``) of
the reference's; we also report whether every trial was bit-identical, which
the exact paths promise. Timing is --perf-trials CUDA-event timings of single
forward calls after 3 warm-up calls, reported as mean and median ms, and as
speedups over eager (``Model``) and over ``torch.compile(Model)`` timed the
same way. One deviation: inputs are drawn on the GPU (``torch.randn`` with a
seeded CUDA generator) rather than on the CPU and copied, which changes the
numbers drawn, not the distribution, and keeps 6 GB inputs quick to make.
For #71 every ``ConvDivLeakyReLU`` algorithm that exists is a ``ModelNew``:
the exact one (NCHW, PyTorch's bits) and ``channels_last`` (cuDNN's TF32
convolution, within tolerance).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import cupy_act.torch as ct

# ---- level 1 #19 and #20 ----


class Model19(nn.Module):
    def forward(self, x):
        return torch.relu(x)


class ModelNew19(nn.Module):
    def forward(self, x):
        return ct.relu(x)


class Model20(nn.Module):
    def __init__(self, negative_slope: float = 0.01):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x):
        return F.leaky_relu(x, negative_slope=self.negative_slope)


class ModelNew20(Model20):
    def forward(self, x):
        return ct.leaky_relu(x, self.negative_slope)


# ---- level 2 #71 ----


class Model71(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, divisor):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.divisor = divisor

    def forward(self, x):
        return F.leaky_relu(self.conv(x) / self.divisor, negative_slope=0.01)


def model_new_71(channels_last: bool):
    class ModelNew71(ct.ConvDivLeakyReLU):  # same parameters and state_dict keys as Model71
        def __init__(self, in_channels, out_channels, kernel_size, divisor):
            super().__init__(
                in_channels, out_channels, kernel_size, divisor, 0.01, channels_last=channels_last
            )

    return ModelNew71


# problem -> (title, Model, {variant: ModelNew}, init args, input shape)
PROBLEMS = {
    19: ("level1 #19 ReLU", Model19, {"cupy_act": ModelNew19}, (), (4096, 393216)),
    20: ("level1 #20 LeakyReLU", Model20, {"cupy_act": ModelNew20}, (0.01,), (4096, 393216)),
    71: (
        "level2 #71 Conv2d_Divide_LeakyReLU",
        Model71,
        {"cupy_act exact": model_new_71(False), "cupy_act channels_last": model_new_71(True)},
        (8, 64, 3, 2.0),
        (128, 8, 128, 128),
    ),
}


def build(cls, init, device="cuda", seed=42):
    """A Model or ModelNew from the problem's init arguments and a fixed seed."""
    torch.manual_seed(seed)
    return cls(*init).to(device)


def inputs(shape, trial):
    g = torch.Generator(device="cuda").manual_seed(1000 + trial)
    return torch.randn(shape, device="cuda", generator=g)


def time_ms(fn, x, trials):
    """KernelBench's timing: 3 warm-up calls, then one CUDA-event timing per call."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.mean(times), statistics.median(times)


def run(problem, args):
    title, model_cls, news, init, shape = PROBLEMS[problem]
    ref = build(model_cls, init)
    compiled = torch.compile(build(model_cls, init))
    rows = []
    with torch.no_grad():
        x = inputs(shape, 0)
        eager_t = time_ms(ref, x, args.perf_trials)
        compile_t = time_ms(compiled, x, args.perf_trials)
        rows.append(
            dict(problem=title, variant="eager (Model)", mean=eager_t[0], median=eager_t[1])
        )
        rows.append(
            dict(problem=title, variant="torch.compile", mean=compile_t[0], median=compile_t[1])
        )
        for name, cls in news.items():
            new = build(cls, init)
            new.load_state_dict(ref.state_dict())
            passed = exact = 0
            max_err = 0.0
            for trial in range(args.correct_trials):
                xt = inputs(shape, trial)
                want, got = ref(xt), new(xt)
                passed += bool(torch.allclose(got, want, atol=1e-2, rtol=1e-2))
                exact += bool(
                    torch.equal(got.contiguous().view(torch.int32), want.view(torch.int32))
                )
                max_err = max(max_err, (got - want).abs().max().item())
                del want, got, xt
            t = time_ms(new, x, args.perf_trials)
            rows.append(
                dict(
                    problem=title,
                    variant=name,
                    correct=f"{passed}/{args.correct_trials}",
                    bit_exact=f"{exact}/{args.correct_trials}",
                    max_abs_err=max_err,
                    mean=t[0],
                    median=t[1],
                    vs_eager=eager_t[0] / t[0],
                    vs_compile=compile_t[0] / t[0],
                )
            )
            del new
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", nargs="+", type=int, default=list(PROBLEMS), choices=PROBLEMS)
    ap.add_argument("--correct-trials", type=int, default=5)
    ap.add_argument("--perf-trials", type=int, default=100)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    import measure  # (scripts/measure.py, beside this script)

    measure.require_gpu("kernelbench.py")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'problem':36s} {'variant':24s} {'correct':>7s} {'bits':>5s} {'max err':>8s} "
        f"{'mean ms':>8s} {'median':>8s} {'vs eager':>8s} {'vs comp.':>8s}"
    )
    rows = []
    for p in args.problems:
        for r in run(p, args):
            rows.append(r)
            speed = f"{r['vs_eager']:7.2f}x {r['vs_compile']:7.2f}x" if "vs_eager" in r else ""
            err = f"{r['max_abs_err']:8.1e}" if "max_abs_err" in r else ""
            print(
                f"{r['problem']:36s} {r['variant']:24s} {r.get('correct', ''):>7s} "
                f"{r.get('bit_exact', ''):>5s} {err:>8s} {r['mean']:8.3f} {r['median']:8.3f} "
                f"{speed}",
                flush=True,
            )
        torch.compiler.reset()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
