"""scripts/kernelbench.py: each ModelNew gives its Model's bits (exact paths) on
small inputs, on CPU and (marked) CUDA; the script runs end to end on a GPU."""

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import run_json  # noqa: E402

from cupy_act.testing import assert_bits_equal  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "kernelbench.py"
spec = importlib.util.spec_from_file_location("kernelbench", SCRIPT)
kb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kb)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SMALL = {19: (3, 1000), 20: (3, 1001), 71: (2, 8, 17, 19)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem", sorted(kb.PROBLEMS))
def test_model_new_matches_model(problem, device):
    _, model_cls, news, init, _ = kb.PROBLEMS[problem]
    ref = kb.build(model_cls, init, device)
    g = torch.Generator().manual_seed(problem)
    x = torch.randn(SMALL[problem], generator=g).to(device)
    for name, cls in news.items():
        new = kb.build(cls, init, device)
        assert set(new.state_dict()) == set(ref.state_dict()), name
        with torch.no_grad():
            want, got = ref(x), new(x)
        if name.endswith("channels_last"):  # TF32 convolution where allowed: tolerance
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        else:
            assert_bits_equal(got.contiguous(), want)


@pytest.mark.gpu
def test_script_runs_with_the_protocol(tmp_path):
    args = ["--problems", "20", "71", "--perf-trials", "5", "--correct-trials", "2"]
    rows = run_json("kernelbench.py", args, tmp_path / "kb.json")
    assert {r["problem"] for r in rows} == {kb.PROBLEMS[20][0], kb.PROBLEMS[71][0]}
    for r in rows:
        if r["variant"].startswith("cupy_act"):
            assert r["correct"] == "2/2", r
            if "channels_last" not in r["variant"]:
                assert r["bit_exact"] == "2/2", r
