#!/usr/bin/env python3
"""How long the benchmark check takes, for docs/BENCHMARKS.md.

1. On simulated servers over real SSH (a real sshd on loopback, the platform's SSH client with a pinned host
   key): a fresh connection, `inventory`, `benchmark` and the policy, as node_verify_run does them (without the
   database writes), for every profile, N times each. The first run of a node also uploads the agent.
2. The real measuring code on this machine's CPU (`agent benchmark` with device=cpu, in quick and full mode), run
   as a process, as the platform runs it on a node.

Run: .venv/bin/python bench/benchmark_check_time.py [--runs 10] [--cpu-runs 3]
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: E402

from provisioning import sim  # noqa: E402
from provisioning.ssh import Endpoint, NodeSession, agent_bundle  # noqa: E402
from provisioning.verification.model import DeclaredModel, load_catalogue  # noqa: E402
from provisioning.verification.policy import judge  # noqa: E402
from provisioning.verification.profiles import PROFILES_DIR, profile_names  # noqa: E402


def keypair() -> tuple[bytes, str]:
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public.decode()


def check_once(endpoint: Endpoint, declared: DeclaredModel, count: int) -> tuple[float, str]:
    started = time.perf_counter()
    with NodeSession(endpoint) as session:
        inventory = session.agent("inventory")
        bench = session.agent("benchmark", request={"quick": False, "time_limit_s": 300}, timeout=330)
    verdict = judge(declared, count, inventory["gpus"], bench).verdict
    return time.perf_counter() - started, verdict


def p(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cpu-runs", type=int, default=3)
    args = parser.parse_args()
    catalogue = load_catalogue()
    base = Path(tempfile.mkdtemp(prefix="bench-check-"))
    private, public = keypair()
    print(f"1. sim servers over SSH: connect + inventory + benchmark + policy, {args.runs} runs per profile")
    print(f"   {'profile':32} {'first (upload)':>14} {'median':>8} {'p95':>8}  verdict")
    try:
        node = sim.node_up("rtx-a4000-x2", base)
        sim.node_authorize(node["ssh_port"], public, base)
        endpoint = Endpoint(node["address"], node["ssh_port"], node["ssh_user"], private,
                            node["host_key_fingerprint"])
        all_times = []
        for n, name in enumerate(profile_names()):
            data = json.loads((PROFILES_DIR / f"{name}.json").read_text())
            (Path(node["node_dir"]) / "profile.json").write_text(json.dumps(data))
            declared = DeclaredModel.from_catalogue(catalogue[data["declared"]["gpu_model"]])
            times = []
            for _ in range(args.runs):
                seconds, verdict = check_once(endpoint, declared, data["declared"]["gpu_count"])
                times.append(seconds)
            first = f"{times[0]:.3f} s" if n == 0 else ""
            rest = times[1:] if n == 0 else times
            all_times += rest
            print(f"   {name:32} {first:>14} {statistics.median(rest):7.3f}s {p(rest, 0.95):7.3f}s  {verdict}")
        print(f"   all profiles: median {statistics.median(all_times):.3f} s, p95 {p(all_times, 0.95):.3f} s, "
              f"max {max(all_times):.3f} s over {len(all_times)} checks")
    finally:
        sim.nodes_down(base)
        shutil.rmtree(base, ignore_errors=True)

    print(f"\n2. the measuring code on this CPU (agent benchmark, device=cpu, as a process), {args.cpu_runs} runs")
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        agent = Path(tmp) / "gpumarket_agent.pyz"
        agent.write_bytes(agent_bundle()[0])  # the zipapp, exactly as the platform uploads it
        return cpu_runs(agent, args.cpu_runs)


def cpu_runs(agent: Path, runs: int) -> int:
    for quick in (True, False):
        walls, inner = [], []
        for _ in range(runs):
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, str(agent), "benchmark"], capture_output=True, text=True,
                                  input=json.dumps({"device": "cpu", "quick": quick}), timeout=600)
            walls.append(time.perf_counter() - started)
            answer = json.load(io.StringIO(proc.stdout.splitlines()[-1]))
            if not answer["ok"]:
                print(f"   failed: {answer['error']}")
                return 1
            inner.append(answer["duration_s"])
        gpu = answer["gpus"][0]
        mode = "quick" if quick else "full"
        print(f"   {mode:5}: process median {statistics.median(walls):.2f} s (max {max(walls):.2f}),"
              f" measuring {statistics.median(inner):.2f} s; last run: bf16 {gpu['bf16_tflops']} fp32 "
              f"{gpu['fp32_tflops']} TFLOP/s, copy {gpu['memory_bandwidth_gbs']} GB/s, CNN train "
              f"{gpu['cnn_train_images_s']:.0f} / infer {gpu['cnn_infer_images_s']:.0f} images/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
