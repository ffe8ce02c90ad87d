#!/usr/bin/env python3
"""What the platform's challenge costs, for docs/BENCHMARKS.md: on a simulated server over real SSH (a real sshd on
loopback, the platform's SSH client with a pinned host key), per profile and N runs: the check's length per node
(connect + inventory + benchmark + challenge + memory proof + policy, as node_verify_run does them, without the
database writes), the challenge's and the memory proof's parts of it, and the control plane's CPU
(time.process_time) for the challenge's exchange and for its verification alone (challenge_verdict.judge: digests
checked, entries recomputed) and for the memory proof's whole exchange. Also, on honest profiles, the lowest
share of the datasheet and the widest spread from the node's median the platform measured (the headroom of the
challenge's bands, with SSH and this machine's scheduling in the timings).

Run: .venv/bin/python bench/challenge_cost.py [--runs 5] [--full]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchmark_check_time import keypair  # noqa: E402
from marketplace.mig import layout_by_gpu  # noqa: E402
from provisioning import sim  # noqa: E402
from provisioning.ssh import Endpoint, NodeSession  # noqa: E402
from provisioning.verification import (  # noqa: E402
    challenge,
    challenge_verdict,
    memproof,
    memproof_verdict,
    slice_challenge,
)
from provisioning.verification.mig import judge_mig  # noqa: E402
from provisioning.verification.model import DeclaredModel, load_catalogue  # noqa: E402
from provisioning.verification.policy import judge  # noqa: E402
from provisioning.verification.profiles import PROFILES_DIR, profile_names, simulated_challenge  # noqa: E402
from provisioning.verification.tolerances import TOLERANCES  # noqa: E402


def check_slices(session: NodeSession, declared: DeclaredModel, inventory: dict, uuids: list[str],
                 quick: bool) -> tuple[list, set[str]]:
    """The MIG slices' challenge and memory proof over the session, as node_slice_challenge runs them on a sim
    node: (findings, disproved UUIDs)."""
    cards = {g["index"]: g.get("memory_total_mib") for g in inventory["gpus"]}
    findings: list = []
    disproved: set[str] = set()
    devices = inventory.get("mig") or []
    for gpu in sorted({d["gpu"] for d in devices if d["uuid"] in uuids}):
        on_card = [d for d in devices if d["gpu"] == gpu]
        for drawn in slice_challenge.draw_slices(declared, on_card, uuids, quick, card_memory_mib=cards.get(gpu)):
            found, _, bad = slice_challenge.judge_slices(drawn, over_exchange(session, "challenge", challenge.run,
                                                                              drawn.challenge))
            assert drawn.proof is not None
            held, _, lost = slice_challenge.judge_slice_proofs(drawn, over_exchange(session, "memproof", memproof.run,
                                                                                    drawn.proof))
            findings += found + held
            disproved |= bad | lost
    return findings, disproved


def over_exchange(session: NodeSession, command: str, run, drawn):
    exchange = session.exchange(command)
    try:
        return run(exchange, drawn, 300)
    finally:
        exchange.close()


def check_once(endpoint: Endpoint, declared: DeclaredModel, profile: dict, quick: bool) -> dict:
    """One check as node_verify_run runs it (without the database writes): a card split into MIG slices is
    measured per slice, never whole; the policy gets the topology, the declared NVLink and the MIG judgement."""
    started = time.perf_counter()
    layout = layout_by_gpu(profile["declared"].get("mig_layout"))
    with NodeSession(endpoint) as session:
        inventory = session.agent("inventory")
        whole = [g["index"] for g in inventory["gpus"] if g["index"] not in layout]
        slices = [d["uuid"] for d in inventory.get("mig") or [] if d["gpu"] in layout]
        request = {"quick": quick, "time_limit_s": 300, "gpu_indices": whole, **({"mig_uuids": slices} if slices
                                                                                 else {})}
        bench = session.agent("benchmark", request=request, timeout=330)
        findings: list = []
        figures: dict = {"gpus": {}}
        exchange_wall = exchange_cpu = verify_cpu = proof_wall = proof_cpu = 0.0
        if whole:
            drawn = challenge.draw(declared, whole, quick)
            exchange_started, cpu_started = time.perf_counter(), time.process_time()
            outcome = over_exchange(session, "challenge", challenge.run, drawn)
            verify_started = time.process_time()
            findings, figures = challenge_verdict.judge(declared, drawn, outcome)
            verify_cpu = time.process_time() - verify_started
            exchange_cpu = time.process_time() - cpu_started
            exchange_wall = time.perf_counter() - exchange_started
            proof_started, proof_cpu_started = time.perf_counter(), time.process_time()
            proof = memproof.draw(declared, whole)
            proof_findings, _ = memproof_verdict.judge(declared, proof, over_exchange(session, "memproof",
                                                                                      memproof.run, proof))
            proof_cpu, proof_wall = time.process_time() - proof_cpu_started, time.perf_counter() - proof_started
            findings = findings + proof_findings
        slice_findings, disproved = check_slices(session, declared, inventory, slices, quick) if slices else ([], set())
        findings += slice_findings
    mig = judge_mig(declared, layout, inventory, bench, disproved=disproved)
    result = judge(declared, profile["declared"]["gpu_count"], inventory["gpus"], bench, challenge=findings,
                   topology=inventory.get("topology"), nvlink_declared=profile["declared"].get("nvlink", False),
                   mig=mig)
    shares = [g["of_datasheet"] for g in figures["gpus"].values() if "of_datasheet" in g]
    rates = [g["bf16_tflops"] for g in figures["gpus"].values() if "bf16_tflops" in g]
    median = statistics.median(rates) if rates else 0
    return {"wall": time.perf_counter() - started, "challenge_wall": exchange_wall, "exchange_cpu": exchange_cpu,
            "verify_cpu": verify_cpu, "proof_wall": proof_wall, "proof_cpu": proof_cpu, "verdict": result.verdict,
            "codes": sorted({f.code for f in findings}),
            "min_share": min(shares) if shares else None,
            "max_spread": max(abs(r - median) / median for r in rates) if median else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="full sizes (the default is quick, as in the tests)")
    parser.add_argument("--profile", action="append", help="only these profiles (default: every one)")
    args = parser.parse_args()
    quick = not args.full
    catalogue = load_catalogue()
    base = Path(tempfile.mkdtemp(prefix="bench-challenge-"))
    private, public = keypair()
    size = challenge.SIZES[quick]
    print(f"{'quick' if quick else 'full'} sizes: {size}; {args.runs} runs per profile")
    print(f"{'profile':42} {'check':>7} {'challenge':>9} {'exch. CPU':>9} {'verify CPU':>10} {'memory':>7} "
          f"{'mem. CPU':>9} {'min share':>9} {'spread':>6}  verdict (challenge and memory proof codes)")
    bad = 0
    try:
        node = sim.node_up("rtx-a4000-x2", base)
        sim.node_authorize(node["ssh_port"], public, base)
        endpoint = Endpoint(node["address"], node["ssh_port"], node["ssh_user"], private,
                            node["host_key_fingerprint"])
        for name in args.profile or profile_names():
            data = json.loads((PROFILES_DIR / f"{name}.json").read_text())
            (Path(node["node_dir"]) / "profile.json").write_text(json.dumps(data))
            model = DeclaredModel.from_catalogue(catalogue[data["declared"]["gpu_model"]])
            runs = [check_once(endpoint, model, data, quick) for _ in range(args.runs)]
            honest = data["expect"]["verdict"] == "verified"
            if "fleet" not in data["expect"]:  # judged against a fleet reference this script does not seed
                bad += sum(r["verdict"] != data["expect"]["verdict"] for r in runs)
            med = {k: statistics.median(r[k] for r in runs) for k in ("wall", "challenge_wall", "exchange_cpu",
                                                                        "verify_cpu", "proof_wall", "proof_cpu")}
            shares = [r["min_share"] for r in runs if r["min_share"] is not None]
            spreads = [r["max_spread"] for r in runs if r["max_spread"] is not None]
            share = f"{min(shares):.3f}" if honest and shares else "-"
            spread = f"{max(spreads):.1%}" if honest and spreads else "-"
            codes = sorted({c for r in runs for c in r["codes"]})
            print(f"{name:42} {med['wall']:6.2f}s {med['challenge_wall']:8.2f}s {med['exchange_cpu'] * 1e3:7.1f}ms "
                  f"{med['verify_cpu'] * 1e3:8.2f}ms {med['proof_wall']:6.2f}s {med['proof_cpu'] * 1e3:7.1f}ms "
                  f"{share:>9} {spread:>6}  {runs[-1]['verdict']} "
                  f"({', '.join(codes) or '-'})")
    finally:
        sim.nodes_down(base)
        shutil.rmtree(base, ignore_errors=True)
    print("\nthe verification alone, in process (no SSH), an honest 8 x A100 node's answer, 20 draws each:")
    for size_quick in (True, False):
        cpu = []
        for _ in range(20):
            _, figures = simulated_challenge(PROFILES_DIR / "a100-80gb-sxm-x8-one-slow.json",
                                             DeclaredModel.from_catalogue(catalogue["a100-80gb-sxm"]), list(range(8)),
                                             size_quick)
            cpu.append(figures["verify_cpu_s"])
        print(f"   {'quick' if size_quick else 'full':5} {challenge.SIZES[size_quick]}: verify CPU median "
              f"{statistics.median(cpu) * 1e3:.2f} ms, max {max(cpu) * 1e3:.2f} ms per node")
    band = TOLERANCES["figure_bands"]["bf16_tflops"]
    print(f"\nbands: degrade below {band['degrade']} of the datasheet ({band['degrade'] * 0.9:.3f} where BF16 is "
          f"derived), reject above {band['max']}; outlier beyond {TOLERANCES['node_median_max_deviation']:.0%} of the "
          f"node's median. {bad} run(s) with another verdict than the profile expects.")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
