"""The benchmarks (bench/) and the Python scripts (scripts/) are not imported by the suite: a name moved out of a
module they import (say memproof._chunk into memproof_verdict) breaks them silently. Each must still start: its
--help prints its usage, which needs every module-level import to resolve."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.read_text().startswith("#!/usr/bin/env python3"))
BENCHES = sorted((ROOT / "bench").glob("*.py"))
HELPERS = {"benchdb.py"}  # imported by the benches, no command line of its own


def test_the_lists_are_not_empty():
    assert len(BENCHES) > 5 and any(p.name == "gpu-selfcheck" for p in SCRIPTS)


@pytest.mark.parametrize("path", [p for p in BENCHES + SCRIPTS if p.name not in HELPERS], ids=lambda p: p.name)
def test_it_starts_and_prints_its_usage(path):
    done = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(HELPERS))
def test_a_benches_helper_imports(name):
    done = subprocess.run([sys.executable, "-c", f"import runpy; runpy.run_path({str(ROOT / 'bench' / name)!r})"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
