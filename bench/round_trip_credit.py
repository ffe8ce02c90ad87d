#!/usr/bin/env python3
"""What a node buys by holding its agent's pongs back, for docs/BENCHMARKS.md: on a simulated server over real SSH
(a real sshd on loopback, the platform's SSH client), per run and profile one challenge or memory-proof exchange,
the profiles interleaved run by run. Each exchange is judged twice from the same measurements: with the round trip
the platform credited before (the least of the agent's three pongs, uncapped: the baseline) and with the credit it
gives now (verification/round_trip.py: the least of the pongs, sshd's keepalive reply and the kernel's TCP
estimate, capped at round_trip_credit_max_s). Printed per profile: the round trips each measurement saw (medians),
the credit, and how many exchanges each rule judged as the profile expects.

Goal (issue 11, item 2: a faster-looking report cannot make a slower card finish sooner): every exchange of the
pong-delaying impostors caught under the new credit, and no finding on the honest profiles' exchanges.

Run: .venv/bin/python bench/round_trip_credit.py [--runs 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchmark_check_time import keypair  # noqa: E402
from provisioning import sim  # noqa: E402
from provisioning.ssh import Endpoint, NodeSession  # noqa: E402
from provisioning.verification import challenge, challenge_verdict, memproof, memproof_verdict  # noqa: E402
from provisioning.verification.model import DeclaredModel, load_catalogue  # noqa: E402
from provisioning.verification.profiles import PROFILES_DIR  # noqa: E402
from provisioning.verification.tolerances import TOLERANCES  # noqa: E402

# (profile, the exchange it is judged on, the codes expected of that exchange)
CASES = [
    ("a6000-posing-as-a100-x2-delays-pongs", "challenge", {"challenge_too_slow"}),
    ("a100-40gb-sxm-says-80gb-rebuilds-delays-pongs-x1", "memproof", {"memory_proof_late"}),
    ("rtx-a4000-x2", "challenge", set()),
    ("rtx-a4000-x2", "memproof", set()),
    ("a100-80gb-sxm-x4", "challenge", set()),
    ("a100-80gb-sxm-x4", "memproof", set()),
]


def exchange_once(endpoint: Endpoint, declared: DeclaredModel, gpus: list[int], kind: str) -> dict:
    with NodeSession(endpoint) as session:
        exchange = session.exchange(kind)
        try:
            if kind == "challenge":
                drawn = challenge.draw(declared, gpus, quick=True)
                out = challenge.run(exchange, drawn, 300)
            else:
                proof = memproof.draw(declared, gpus)
                out = memproof.run(exchange, proof, 300)
        finally:
            exchange.close()
    judged = (lambda o: challenge_verdict.judge(declared, drawn, o)) if kind == "challenge" else (
        lambda o: memproof_verdict.judge(declared, proof, o))
    before = dataclasses.replace(out, round_trip_s=out.round_trips["agent_pings"])
    return {"trips": dict(out.round_trips), "credit": out.round_trip_s,
            "now": {f.code for f in judged(out)[0]}, "before": {f.code for f in judged(before)[0]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    catalogue = load_catalogue()
    base = Path(tempfile.mkdtemp(prefix="bench-round-trip-"))
    private, public = keypair()
    results: dict[tuple[str, str], list[dict]] = {(name, kind): [] for name, kind, _ in CASES}
    try:
        node = sim.node_up("rtx-a4000-x2", base)
        sim.node_authorize(node["ssh_port"], public, base)
        endpoint = Endpoint(node["address"], node["ssh_port"], node["ssh_user"], private,
                            node["host_key_fingerprint"])
        for _ in range(args.runs):
            for name, kind, _codes in CASES:  # interleaved: each run takes every case once, in turn
                data = json.loads((PROFILES_DIR / f"{name}.json").read_text())
                (Path(node["node_dir"]) / "profile.json").write_text(json.dumps(data))
                model = DeclaredModel.from_catalogue(catalogue[data["declared"]["gpu_model"]])
                gpus = list(range(data["declared"]["gpu_count"]))
                results[name, kind].append(exchange_once(endpoint, model, gpus, kind))
    finally:
        sim.nodes_down(base)
        shutil.rmtree(base, ignore_errors=True)
    cap = TOLERANCES["round_trip_credit_max_s"]
    print(f"{args.runs} exchanges per case over SSH on loopback; the credit is capped at {cap} s\n")
    print(f"{'profile':50} {'exchange':9} {'pongs':>8} {'sshd':>8} {'tcp':>8} {'credit':>8}  "
          f"{'as expected before':>18} {'as expected now':>15}")
    met = True
    for name, kind, codes in CASES:
        runs = results[name, kind]
        med = {k: statistics.median(r["trips"].get(k, float("nan")) for r in runs)
               for k in ("agent_pings", "sshd", "tcp")}
        credit = statistics.median(r["credit"] for r in runs)
        before = sum((r["before"] >= codes) if codes else not r["before"] for r in runs)
        now = sum((r["now"] >= codes) if codes else not r["now"] for r in runs)
        met &= now == len(runs)
        print(f"{name:50} {kind:9} {med['agent_pings'] * 1e3:6.1f}ms {med['sshd'] * 1e3:6.2f}ms "
              f"{med['tcp'] * 1e3:6.3f}ms {credit * 1e3:6.3f}ms  {before:>11}/{len(runs):<6} "
              f"{now:>8}/{len(runs):<6}")
    print("\n'as expected': the impostors caught with their codes; the honest profiles without a finding.")
    verdict = "met" if met else "NOT met"
    print(f"goal (every impostor exchange caught, no honest finding, under the new credit): {verdict}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
