"""Deliberate bugs against the test suite: does each get caught?

Each mutant of ``tests/mutants.py`` (a Python step replaced, or a kernel's
source edited before it compiles) is applied in a fresh pytest run of its
family's tests (``CUPY_ACT_MUTANT=<name>``). A mutant counts as caught when
the run fails and a failing test's id holds one of the mutant's words (the
test is named for what the bug broke). Each selection of tests first runs
without a mutant and must pass, so a test that fails anyway catches nothing.

    python scripts/mutants.py --kind cpu            # CI (tests/test_mutants.py)
    python scripts/mutants.py --kind gpu            # on a GPU machine
    python scripts/mutants.py --only slope_ignored  # one mutant

Prints a table (mutant, family, kind, tests run, failed, the test that
caught it) and exits 1 if a mutant was missed or a baseline failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mutants  # noqa: E402

# "FAILED <test id> - <message>" (an id may hold spaces: a tuple parameter's)
_FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.MULTILINE)
_COUNTS = re.compile(r"(\d+) (passed|failed|error|errors|skipped|deselected)")


def pytest_run(args: tuple[str, ...], mutant: str | None, timeout: int) -> dict:
    """One pytest run of ``args`` (with ``mutant`` applied): return code,
    failing test ids, counts and seconds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop(mutants.ENV, None)
    if mutant:
        env[mutants.ENV] = mutant
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=line",
           *args]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # (a hang is no catch)
        out, rc = f"{e.stdout or ''}\ntimed out after {timeout} s", -1
    counts: dict[str, int] = {}
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    for number, what in _COUNTS.findall(tail):
        counts[what.rstrip("s") if what.startswith("error") else what] = int(number)
    return {
        "rc": rc,
        "failed": _FAILED.findall(out),
        "counts": counts,
        "seconds": round(time.perf_counter() - start, 1),
        "tail": out[-3000:],
    }


def verdict(m: mutants.Mutant, run: dict) -> str | None:
    """The first failing test whose id holds one of the mutant's words, or None."""
    if run["rc"] == 0:
        return None
    for test in run["failed"]:
        if any(word in test for word in m.words):
            return test
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kind", choices=("cpu", "gpu", "all"), default="cpu")
    ap.add_argument("--only", nargs="*", help="mutant names (default: all of --kind)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    chosen = [
        m for m in mutants.MUTANTS
        if (args.kind == "all" or m.kind == args.kind) and (not args.only or m.name in args.only)
    ]  # fmt: skip
    if args.only and len(chosen) != len(args.only):
        known = ", ".join(m.name for m in mutants.MUTANTS)
        ap.error(f"--only: unknown or not of --kind {args.kind}: {args.only}; known: {known}")
    if args.list:
        for m in chosen:
            print(f"{m.name:30s} {m.family:12s} {m.kind}  {m.what}")
        return 0
    if any(m.kind == "gpu" for m in chosen):
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001 - any reason there is no GPU
            print(f"mutants: the gpu mutants need a CUDA GPU ({type(e).__name__}: {e})")
            return 2

    baselines: dict[tuple, dict] = {}
    rows = []
    ok = True
    for m in chosen:
        if m.tests not in baselines:
            base = baselines[m.tests] = pytest_run(m.tests, None, args.timeout)
            ran = base["counts"].get("passed", 0)
            print(f"baseline {' '.join(m.tests)}: rc {base['rc']}, {ran} passed, "
                  f"{base['seconds']} s", flush=True)  # fmt: skip
            if base["rc"] != 0 or ran == 0:
                print(base["tail"])
                ok = False
        base = baselines[m.tests]
        run = pytest_run(m.tests, m.name, args.timeout)
        caught = verdict(m, run) if base["rc"] == 0 else None
        ok = ok and caught is not None
        row = {
            "mutant": m.name, "family": m.family, "kind": m.kind, "what": m.what,
            "tests": sum(run["counts"].get(k, 0) for k in ("passed", "failed")),
            "failed": len(run["failed"]), "caught_by": caught, "seconds": run["seconds"],
        }  # fmt: skip
        rows.append(row)
        said = f"CAUGHT by {caught}" if caught else "MISSED"
        print(f"{m.name}: {said} ({row['failed']} of {row['tests']} failed, {run['seconds']} s)",
              flush=True)  # fmt: skip
        if caught is None:
            print(run["tail"])
    print("\n| mutant | family | kind | tests | failed | caught by |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        by = r["caught_by"].split("::", 1)[-1] if r["caught_by"] else "**MISSED**"
        print(f"| {r['mutant']} | {r['family']} | {r['kind']} | {r['tests']} | {r['failed']} "
              f"| {by} |")  # fmt: skip
    caught = sum(r["caught_by"] is not None for r in rows)
    print(f"\n{caught} of {len(rows)} mutants caught" + ("" if ok else "; FAILED"))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
