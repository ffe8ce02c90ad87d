#!/usr/bin/env python3
"""How stable the benchmark check's verdicts are under the sim's run-to-run noise.

For every sim profile (provisioning/agent/profiles/), draws the benchmark N times (each draw: every figure of
every GPU with its own noise, about 1 % and never past 3 %, seeded from os.urandom), judges each draw with the
acceptance policy against the declared catalogue model, and counts:
  - honest profiles (expect verdict "verified"): any other verdict is a false finding (rejected = false rejection);
  - dishonest profiles: caught = the expected verdict with every expected finding code present.
No database, no Django: the policy reads the catalogue's JSON file.

Run: .venv/bin/python bench/verdict_stability.py [--runs 100]   (exit status 1 if any draw went wrong)
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provisioning.verification.policy import TOLERANCES, load_catalogue  # noqa: E402
from provisioning.verification.profiles import (  # noqa: E402
    PROFILES_DIR,
    judge_profile,
    profile_expectation,
    profile_names,
)


def headroom(result, declared_gen: int) -> float:
    """How far the draw stayed from the nearest floor: min over GPUs of value / threshold (1.0 = on the line).
    Datasheet shares against their degrade floors (derived floors included), host link against its
    minimum, and each GPU against the node-median rule."""
    t, worst = TOLERANCES, float("inf")
    for gpu in result.figures.get("gpus", []):
        for key, share in gpu["of_datasheet"].items():
            worst = min(worst, share / t["figure_bands"][key]["degrade"])
        link = min(v for v in (gpu["h2d_gbs"], gpu["d2h_gbs"]) if v is not None)
        worst = min(worst, link / t["host_link_min_gbs"][declared_gen])
        for key in t["node_median_figures"]:
            median = result.figures["median"][key]
            worst = min(worst, gpu[key] / ((1 - t["node_median_max_deviation"]) * median))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    catalogue = load_catalogue()
    print(f"{'profile':32} {'expected':10} {'runs':>5} {'as expected':>12} {'false rej.':>10} {'false deg.':>10} "
          f"{'headroom':>8}  finding codes seen (draws)")
    bad = 0
    started = time.monotonic()
    for name in profile_names():
        expect = profile_expectation(name)
        verdicts, codes = collections.Counter(), collections.Counter()
        good, room = 0, float("inf")
        for _ in range(args.runs):
            result = judge_profile(name, catalogue)
            if expect["verdict"] == "verified":
                room = min(room, headroom(result, catalogue[result_model(name)]["pcie_gen"]))
            verdicts[result.verdict] += 1
            seen = {f.code for f in result.findings}
            codes.update(seen)
            good += result.verdict == expect["verdict"] and set(expect["findings"]) <= seen
        honest = expect["verdict"] == "verified"
        false_rej = verdicts["rejected"] if honest else 0
        false_deg = verdicts["degraded"] if honest else 0
        bad += args.runs - good
        seen_codes = ", ".join(f"{c} ({n})" for c, n in sorted(codes.items())) or "-"
        room_text = f"{room - 1:+.0%}" if honest else "-"
        print(f"{name:32} {expect['verdict']:10} {args.runs:5} {good:12} {false_rej:10} {false_deg:10} "
              f"{room_text:>8}  {seen_codes}")
    elapsed = time.monotonic() - started
    print(f"\n{len(profile_names())} profiles x {args.runs} draws in {elapsed:.1f} s; "
          f"{bad} draw(s) not as expected. headroom: how far the worst honest draw stayed above the nearest floor "
          "(datasheet bands, host link minimum, node-median rule)")
    return 1 if bad else 0


def result_model(name: str) -> str:
    return json.loads((PROFILES_DIR / f"{name}.json").read_text())["declared"]["gpu_model"]


if __name__ == "__main__":
    sys.exit(main())
