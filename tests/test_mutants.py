"""The deliberate bugs of tests/mutants.py: each one still applies (a kernel
edit matches its source exactly once), and, in the slow run, each CPU mutant
is caught by a test named for what it broke (scripts/mutants.py; the GPU
mutants run on the device: scripts/device_run.sh)."""

import mutants
import pytest
from conftest import run_json

from cupy_act import _source


@pytest.mark.parametrize("m", [m for m in mutants.MUTANTS if m.kind == "gpu"], ids=lambda m: m.name)
def test_gpu_mutant_edits_match_their_source_once(m):
    for source, old, new in m.edits:
        text = _source.assembled_source(source)
        assert text.count(old) == 1, (source, old)
        assert old != new


def test_every_mutant_has_a_bug_and_words():
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
    for m in mutants.MUTANTS:
        assert m.words and m.tests and m.kind in ("cpu", "gpu")
        assert (m.name in mutants._CPU) == (m.kind == "cpu") and bool(m.edits) == (m.kind == "gpu")


@pytest.mark.slow
def test_cpu_mutants_are_each_caught_by_a_test_named_for_them(tmp_path):
    result = run_json("mutants.py", ["--kind", "cpu"], tmp_path / "mutants.json", timeout=3000)
    missed = [r["mutant"] for r in result["rows"] if not r["caught_by"]]
    assert result["ok"] and not missed, missed
    assert len(result["rows"]) == sum(m.kind == "cpu" for m in mutants.MUTANTS)
