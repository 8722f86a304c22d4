"""scripts/ without a GPU: every script answers --help, the benchmarks' target
arithmetic and tables (scripts/bench.py, scripts/measure.py) on rows made up
here, and the profiler's sorting of kernel names. The scripts' runs on a GPU
are tested beside their subjects (test_conv, test_adopt, test_kernelbench)."""

import runpy
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench  # noqa: E402
import measure  # noqa: E402


@pytest.mark.parametrize(
    "script", sorted(p.name for p in SCRIPTS.glob("*.py") if p.name != "measure.py")
)
def test_every_script_answers_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_target_reads_its_goal():
    t = measure.target("speed", 1.2, ">= 1.2x")
    assert t.met and t.bound == 1.2 and t.floor_note() == ""
    assert not measure.target("time", 0.31, "<= 0.3").met
    assert measure.target("pct", 98.5, ">= 98%").met
    assert not measure.target("ratio", 1.0, "> 1x").met
    assert measure.target("nothing measured", None, ">= 1x") is None
    below = measure.target("backward ms", 0.50, "<= 0.45", floor=0.48)
    assert below.floor_note() == "floor 0.480, goal below the floor"


def _rows(ours_ms: float) -> list:
    """bench.py's rows at the reference shape: eager and compile 1 ms, ours
    ``ours_ms``, the copy 1 ms, 4-byte elements."""
    b = bench.Bench(None)
    n, s, ref = 4096 * 393216, 4, "4096x393216"
    for dtype in ("float32", "bfloat16", "float16"):
        d = getattr(bench.torch, dtype)
        copy = b.add(d, ref, n, s, "-", "copy", "copy", 1.0)
        for op in bench.OPS:
            div = " div" if op == "div_leaky_relu" else ""
            for case in ("forward", "backward", "fwd+bwd"):
                b.add(d, ref, n, s, op, case, "eager" + div, 1.0, saved=4.0)
                b.add(d, ref, n, s, op, case, "cupy_act", ours_ms, saved=0.125)
            b.add(d, ref, n, s, op, "forward", "compile", 1.0)
            b.add(d, ref, n, s, op, "forward+mask", "cupy_act", ours_ms)
    for r in b.rows:
        r["pct_copy"] = 100 * (r["bytes"] / r["ms"]) / (2 * n * s / copy["ms"])
        r["x_copy_time"] = r["ms"] / copy["ms"]
    return b.rows


def test_bench_targets_met_and_missed():
    """Ours at half eager's time meets the speed goals; at eager's time it
    misses them; the table says which."""
    fast = {t.what: t for t in bench.targets(_rows(0.5), [])}
    slow = {t.what: t for t in bench.targets(_rows(1.0), [])}
    speed = "leaky_relu forward float32: speed vs eager"
    assert fast[speed].value == 2.0 and fast[speed].met
    assert slow[speed].value == 1.0 and slow[speed].met  # (>= 0.99x)
    f16 = "relu forward float16: speed vs eager"
    assert fast[f16].met and not slow[f16].met  # (>= 1.08x)
    back = "relu backward float32: speed vs eager backward"
    assert fast[back].met and not slow[back].met
    saved = "relu saved memory float32: eager / ours"
    assert fast[saved].value == 32.0 and fast[saved].met
    mask = "relu forward+mask float32: time / copy time"
    assert fast[mask].met and slow[mask].value == 1.0 and slow[mask].met
    table = bench.markdown(measure.environment(), _rows(1.0), [], list(slow.values()))
    assert f"| {back} | 1.000 | >= 1.43x | **missed** |" in table
    assert f"| {speed} | 1.000 | >= 0.99x | met |" in table


@pytest.mark.parametrize(
    "name, kind",
    [
        ("void cupy_act::bn_reduce<float, false, 4, 1, 2>(cupy_act::BnParams)", "BN bwd"),
        ("void cupy_act::bn_reduce<float, false, 1, 0, 0>(cupy_act::BnParams)", "BN fwd"),
        ("void cupy_act::bn_finalize<0>(cupy_act::BnParams)", "BN fwd"),
        ("void cupy_act::bn_finalize<1>(cupy_act::BnParams)", "BN bwd"),
        ("void cupy_act::bn_finalize<2>(cupy_act::BnParams)", "BN bwd"),
        ("cudnn::bn_fw_tr_1C11_kernel_NCHW", "BN fwd"),
        ("triton_red_fused_native_batch_norm_backward_3", "BN bwd"),
        ("sm90_xmma_fprop_implicit_gemm_tf32", "convolution"),
        ("void cupy_act::conv2d_wgrad_kernel_wg<float, 3, 0>", "convolution"),
        ("void cupy_act::act_kernel<cupy_act::Relu<float>, 0, false, 1>", "activation"),
        ("triton_poi_fused_leaky_relu_7", "activation"),
        ("void at::native::vectorized_elementwise_kernel<4, add>", "other"),
    ],
)
def test_profile_sorts_kernels_by_kind(name, kind):
    assert measure.kind(name) == kind


def test_profile_adds_each_kind_per_step(monkeypatch):
    """profile() sums kernel_us's per-call device time by kind, in ms, and
    lists the largest "other" kernels."""
    times = {
        "void cupy_act::bn_forward<float, true, 4, 2>(cupy_act::BnParams)": 500.0,
        "void cupy_act::bn_reduce<float, true, 4, 1, 2>(cupy_act::BnParams)": 300.0,
        "sm90_xmma_fprop_implicit_gemm_tf32": 1500.0,
        "Memset (Device)": 250.0,
        "void at::native::vectorized_elementwise_kernel<4, add>": 50.0,
    }
    monkeypatch.setattr(measure, "kernel_us", lambda step, steps: times)
    out = measure.profile(lambda: None)
    assert out["BN fwd"] == 0.5 and out["BN bwd"] == 0.3 and out["convolution"] == 1.5
    assert out["other"] == pytest.approx(0.3) and out["total"] == pytest.approx(2.6)
    assert [name for name, _ in out["top other"]] == [
        "Memset (Device)",
        "void at::native::vectorized_elementwise_kernel<4, add>",
    ]
    assert [ms for _, ms in out["kernels"]] == [1.5, 0.5, 0.3, 0.25, 0.05]


def test_compiled_models_variants_name_their_policy():
    """compiled_models.py --variants: a variant, optionally ":" and a
    placement policy; anything else is refused by name."""
    import argparse

    import compiled_models

    assert compiled_models.variant_name("ours-inplace:inplace") == "ours-inplace:inplace"
    assert compiled_models.variant_name("ours-unfolded") == "ours-unfolded"
    for bad in ("ours:fast", "theirs", "theirs:after_conv"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            compiled_models.variant_name(bad)


def test_compiled_models_peaks_only(monkeypatch, capsys):
    """--peaks-only: each compiled variant's peak from a process of its own
    (its mode and policy passed on), printed with its ratio to PyTorch's."""
    from types import SimpleNamespace

    import compiled_models

    asked = []

    def fake_peak(args, name, batch, precision, variant, mode):
        asked.append((name, batch, precision, variant, mode))
        return {"pytorch": 4000.0, "ours-inplace:inplace": 2900.0}[variant]

    monkeypatch.setattr(compiled_models, "peak_in_own_process", fake_peak)
    args = SimpleNamespace(modes=["reduce-overhead"], variants=["pytorch", "ours-inplace:inplace"],
                           policy="inplace", steps=4)  # fmt: skip
    peaks = compiled_models.measure_peaks(args, "m", (None, None, None, None), 32, "fp32")
    assert peaks == {"pytorch/reduce-overhead MiB": 4000.0,
                     "ours-inplace:inplace/reduce-overhead MiB": 2900.0}  # fmt: skip
    assert asked[1] == ("m", 32, "fp32", "ours-inplace:inplace", "reduce-overhead")
    compiled_models.print_peaks({"model": "m", "batch": 32, "precision": "fp32", **peaks}, args)
    line = [x for x in capsys.readouterr().out.splitlines() if "ours-inplace" in x][0]
    assert line.split()[-2:] == ["2900", "0.725"]


def test_compiled_models_prints_the_default_modes_host_floor(monkeypatch, capsys):
    """Compile default mode: the ops' calls in one step counted from the
    profiler's host events, and the step at the floor printed as the step
    less each call's host cost above the floor op's."""
    from types import SimpleNamespace

    import compiled_models

    monkeypatch.setattr(compiled_models, "_OPS", ("aten::neg",))
    run = SimpleNamespace(step=lambda x, t: (torch.neg(x), torch.neg(t), torch.abs(x)))
    assert compiled_models.op_calls_per_step(run, (torch.ones(2), torch.ones(2))) == 2
    row = {"model": "m", "batch": 32, "precision": "fp32", "noise": 1e-4,
           "pytorch/default ms": 25.0, "pytorch/default spread": 0.01,
           "pytorch/default loss diff": 1e-4, "ours/default ms": 31.0,
           "ours/default spread": 0.02, "ours/default loss diff": 1e-4,
           "ours/default op calls": 134,
           "op host us": {"our forward op": 50.0, "our backward op": 54.0,
                          "floor op (no kernels)": 14.0}}  # fmt: skip
    args = SimpleNamespace(modes=["default"], variants=["pytorch", "ours"])
    compiled_models.print_row(row, args)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "host floor" in x]
    # 31 ms - 134 calls x (52 - 14) us = 25.908 ms, 1.036x PyTorch's 25
    assert "134 op calls a step at 52.0 us (floor op 14.0 us)" in line
    assert line.endswith("about 25.91 ms, 1.036x")


def test_compiled_models_prints_batchnorms_byte_floor(capsys):
    """--profile: the BatchNorms' input elements counted on the meta device
    (strided layers included), and the floors printed as passes x elements x
    the precision's bytes over the copy bandwidth, with the step PyTorch's
    would take at each floor."""
    from types import SimpleNamespace

    import compiled_models

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.BatchNorm2d(16),
    )  # fmt: skip
    assert compiled_models.bn_elements(model, (3, 10, 10), 4) == 4 * 8 * 100 + 4 * 16 * 25
    assert next(model.parameters()).device.type == "cpu"  # (a copy went to meta)
    profile = {"BN fwd": 3.0, "BN bwd": 5.0}
    row = {"model": "m", "batch": 32, "precision": "bf16cl", "noise": 1e-4,
           "pytorch/reduce-overhead ms": 20.0, "pytorch/reduce-overhead spread": 0.01,
           "pytorch/reduce-overhead loss diff": 1e-4,
           "pytorch/reduce-overhead profile": profile | {"convolution": 9.0, "other": 1.0,
                                                         "total": 18.0, "top other": []},
           "ours/reduce-overhead profile": {"BN fwd": 2.0, "BN bwd": 3.5},
           "bn elements": 10**8, "copy GB/s": 4000.0}  # fmt: skip
    args = SimpleNamespace(modes=["reduce-overhead"], variants=["pytorch"])
    compiled_models.print_row(row, args)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "byte floor" in x]
    # 10 passes x 1e8 x 2 B / 4000 GB/s = 0.5 ms: 20 - 8 + 0.5 = 12.5 ms, 0.625x
    assert "x kept, y recomputed 0.50 ms (step 0.625x)" in line
    assert "y kept 0.40 ms (step 0.620x)" in line
    assert line.endswith("BN device ms: pytorch 8.00, ours 5.50")


def test_compiled_models_peaks_only_writes_json(monkeypatch, tmp_path):
    """main() with --peaks-only and --json: the peaks' rows reach the file, as
    the timed rows do."""
    import json

    import compiled_models

    out = tmp_path / "rows.json"
    monkeypatch.setattr(compiled_models.measure, "require_gpu", lambda name: None)
    monkeypatch.setattr(compiled_models.measure, "environment", lambda: {})
    monkeypatch.setattr(compiled_models.measure, "header", lambda env: "")
    monkeypatch.setattr(compiled_models.models, "build", lambda name: (None,) * 4)
    monkeypatch.setattr(compiled_models.models, "allow_recompiles", lambda: None)
    monkeypatch.setattr(compiled_models, "measure_peaks", lambda *a: {"pytorch/default MiB": 7.0})
    argv = ["--models", "m", "--batches", "8", "--precisions", "fp32", "--modes", "default",
            "--variants", "pytorch", "--peaks-only", "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["compiled_models.py", *argv])
    compiled_models.main()
    assert json.loads(out.read_text()) == [
        {"model": "m", "batch": 8, "precision": "fp32", "pytorch/default MiB": 7.0}
    ]


@pytest.mark.parametrize(
    "kernel,nbytes",
    [
        ("bn_reduce<cupy_act::bfloat16_t, true, 8, 0, 0>", 100),  # x
        ("bn_reduce<float, false, 4, 1, 2>", 204),  # x, dy, the mask
        ("bn_reduce<float, true, 1, 2, 2>", 200),  # y, dy
        ("bn_forward<float, true, 4, 2>", 204),  # x; y, the mask
        ("bn_backward<float, true, 4, 2, false>", 304),  # x, dy, the mask; dx
        ("bn_backward<float, false, 4, 0, true>", 300),  # y, dy; dx
        ("bn_finalize<0>", None),
    ],
)
def test_bn_bench_counts_each_kernels_bytes(kernel, nbytes):
    """bn_bench --kernels: the bytes each fused kernel moves (elements of 100
    bytes, a 4-byte mask), by its name as the profiler gives it."""
    import bn_bench

    name = f"void cupy_act::{kernel}(cupy_act::BnParams)"
    assert bn_bench._traffic(name, 100, 4) == nbytes
