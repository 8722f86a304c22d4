"""README keeps exactly two set-up commands, and CI runs the test one."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_commands():
    section = ROOT.joinpath("README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.DOTALL)


def test_two_setup_commands_and_ci_runs_the_test_one():
    main_job, tests = setup_commands()
    assert "python3 -m cupy_act" in main_job
    assert "pytest" in tests
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert tests.strip() in [line.strip() for line in ci]
