#!/usr/bin/env python3
"""How stable the benchmark check's verdicts are under the sim's run-to-run noise.

For every sim profile (provisioning/agent/profiles/), draws the benchmark N times (each draw: every figure of
every GPU with its own noise, about 1 % and never past 3 %, seeded from os.urandom), judges each draw with the
acceptance policy against the declared catalogue model, and counts:
  - honest profiles (expect verdict "verified"): any other verdict is a false finding (rejected = false rejection,
    degraded = false degradation). Each draw is judged against a fleet reference too: --fleet-nodes other nodes
    with the same hardware, drawn afresh for every draw (the smallest fleet the platform uses by default, so the
    noisiest median), so the fleet rule's false degradations are counted with the rest;
  - dishonest profiles: caught = the expected verdict with every expected finding code present (against the fleet
    their `expect.fleet` names, if any).
Then each band's headroom: over every honest draw, how far the worst GPU stayed from the band's edge, as
value / threshold - 1 (for a ceiling, threshold / value - 1): +10 % = 10 % of room left.
No database, no Django: the policy reads the catalogue's JSON file.

Run: .venv/bin/python bench/verdict_stability.py [--runs 1000] [--fleet-nodes 5] [--profiles honest] [--jobs 2]
(exit status 1 if any draw went wrong)
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provisioning.verification.model import DeclaredModel, load_catalogue  # noqa: E402
from provisioning.verification.performance import FleetReference  # noqa: E402
from provisioning.verification.policy import Judgement  # noqa: E402
from provisioning.verification.profiles import (  # noqa: E402
    PROFILES_DIR,
    fleet_figures,
    judge_profile,
    profile_expectation,
    profile_fleet,
    profile_names,
)
from provisioning.verification.tolerances import FIGURES, TOLERANCES  # noqa: E402


def band_headroom(result: Judgement, declared: DeclaredModel, fleet: FleetReference | None) -> dict[str, float]:
    """Per band, the worst GPU's room in this draw: value / threshold - 1 (ceilings: threshold / value - 1)."""
    t, room = TOLERANCES, {}

    def keep(band: str, value: float) -> None:
        room[band] = min(room.get(band, float("inf")), value - 1)

    for gpu in result.figures.get("gpus", []):
        for key, share in gpu["of_datasheet"].items():
            band = t["figure_bands"][key]
            slack = t["derived_floor_factor"] if key in declared.derived else 1.0
            keep(f"{key} >= {band['degrade'] * slack:.3g} of datasheet", share / (band["degrade"] * slack))
            if band["max"] is not None:
                keep(f"{key} <= {band['max']:.3g} of datasheet", band["max"] / share)
        links = [v for v in (gpu["h2d_gbs"], gpu["d2h_gbs"]) if v is not None]
        if links:
            keep(f"host link >= {t['host_link_min_gbs'][declared.pcie_gen]:g} GB/s",
                 min(links) / t["host_link_min_gbs"][declared.pcie_gen])
        for key in t["node_median_figures"]:
            median = result.figures["median"][key]
            keep(f"{key} >= {1 - t['node_median_max_deviation']:.2f} x node median",
                 gpu[key] / ((1 - t["node_median_max_deviation"]) * median))
        tele = gpu.get("telemetry") or {}
        if "SwPowerCap" in (tele.get("clocks_event_reasons") or []) and declared.tdp_w:
            keep(f"power drawn at SwPowerCap >= {t['power_capped_draw_max_fraction']:.2f} x TDP",
                 tele["power_draw_w"] / (t["power_capped_draw_max_fraction"] * declared.tdp_w))
        if fleet is not None:
            for key in t["fleet_max_gap"]:
                floor = fleet.floor(key)
                if floor and gpu.get(key) is not None:
                    keep(f"{key} >= fleet median - {t['fleet_max_gap'][key]:.0%} (or 4 x MAD)", gpu[key] / floor)
    return room


def result_model(name: str) -> str:
    return json.loads((PROFILES_DIR / f"{name}.json").read_text())["declared"]["gpu_model"]


def draw_profile(name: str, runs: int, fleet_nodes: int) -> dict:
    """`runs` draws of one profile: its verdict counts, finding codes, draws as expected and band headroom."""
    catalogue = load_catalogue()
    expect = profile_expectation(name)
    honest = expect["verdict"] == "verified"
    declared = DeclaredModel.from_catalogue(catalogue[result_model(name)])
    verdicts: collections.Counter = collections.Counter()
    codes: collections.Counter = collections.Counter()
    bands: dict[str, float] = {}
    good = 0
    for _ in range(runs):
        if honest:  # a fresh fleet of this hardware for every draw
            fleet = FleetReference.from_node_medians(
                [f["median"] for f in fleet_figures(name, fleet_nodes, catalogue)])
        else:
            fleet = profile_fleet(name, catalogue)
        result = judge_profile(name, catalogue, fleet=fleet or False)
        if honest:
            for band, value in band_headroom(result, declared, fleet).items():
                bands[band] = min(value, bands.get(band, float("inf")))
        verdicts[result.verdict] += 1
        seen = {f.code for f in result.findings}
        codes.update(seen)
        good += result.verdict == expect["verdict"] and set(expect["findings"]) <= seen
    return {"name": name, "expect": expect, "honest": honest, "verdicts": verdicts, "codes": codes, "good": good,
            "bands": bands}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--fleet-nodes", type=int, default=5)
    parser.add_argument("--profiles", default="all",
                        help="all, honest, dishonest, or profile names separated by commas (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="profiles drawn in parallel processes (default: 1)")
    args = parser.parse_args()
    names = profile_names()
    if args.profiles in ("honest", "dishonest"):
        names = [n for n in names if (profile_expectation(n)["verdict"] == "verified") == (args.profiles == "honest")]
    elif args.profiles != "all":
        wanted = args.profiles.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown profile(s): {', '.join(unknown)}")
        names = [n for n in names if n in wanted]
    print(f"{'profile':40} {'expected':10} {'runs':>5} {'as expected':>12} {'false rej.':>10} {'false deg.':>10}  "
          "finding codes seen (draws)")
    bad, false_total = 0, 0
    bands: dict[str, tuple[float, str]] = {}
    started = time.monotonic()
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        done = pool.map(draw_profile, names, [args.runs] * len(names), [args.fleet_nodes] * len(names))
        for out in done:  # in profile order, each printed as soon as it and those before it are done
            name, expect, honest, verdicts = out["name"], out["expect"], out["honest"], out["verdicts"]
            for band, value in out["bands"].items():
                if value < bands.get(band, (float("inf"), ""))[0]:
                    bands[band] = (value, name)
            false_rej = verdicts["rejected"] if honest else 0
            false_deg = verdicts["degraded"] if honest else 0
            false_total += false_rej + false_deg
            bad += args.runs - out["good"]
            seen_codes = ", ".join(f"{c} ({n})" for c, n in sorted(out["codes"].items())) or "-"
            print(f"{name:40} {expect['verdict']:10} {args.runs:5} {out['good']:12} {false_rej:10} {false_deg:10}  "
                  f"{seen_codes}", flush=True)
    elapsed = time.monotonic() - started
    print(f"\n{len(names)} profiles x {args.runs} draws in {elapsed:.1f} s ({args.jobs} process(es)); {bad} draw(s) "
          f"not as expected, {false_total} false finding(s) on honest profiles (each judged against a fresh fleet of "
          f"{args.fleet_nodes} nodes with its hardware).\n")
    print(f"{'band (honest profiles, every draw, worst GPU)':60} {'headroom':>9}  closest profile")
    for band, (value, name) in sorted(bands.items(), key=lambda item: item[1][0]):
        print(f"{band:60} {value:+9.1%}  {name}")
    assert set(FIGURES) <= set(TOLERANCES["figure_bands"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
