#!/usr/bin/env python3
"""Benchmark: the agent's `vm create` on a real Docker engine, until the container's sshd answers, beside the
engine's own `docker run` of the same image on the same engine. Not a timed test: it prints figures for
docs/BENCHMARKS.md. Needs root (it starts its own dockerd and registry, as tests/docker/ does).

Four ways, interleaved round by round so drifts in machine load hit all of them alike:
- agent warm: `python3 -m provisioning.agent.gpumarket_agent vm create` (a process, as over SSH) with the image
  already on the node. The agent still asks the registry for the manifest (GPUMARKET_DOCKER_PULL=always: a
  renter must be able to read the image even when it is cached), inspects the image, writes the box folder,
  creates, reads /etc/os-release, starts and reads the host key, then answers;
- agent cold: the same after `docker rmi` of the image: the pull downloads every layer from the local registry;
- docker warm / docker cold: `docker run -d -p 127.0.0.1:<port>:22 <image>` (the cold one pulls, logged in).
Each ends when the published port answers with an SSH banner ("SSH-2.0-"): the moment a renter can log in.
Containers are removed between rounds (not timed).

Run: sudo .venv/bin/python bench/docker_boot.py [--rounds 5]
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.docker.engine import (  # noqa: E402 - after the path
    REGISTRY_PASSWORD,
    REGISTRY_USER,
    Engine,
    Registry,
    cannot_run_dockerd,
    free_port,
    setup_machine,
)
from tests.provisioning.sshkit import new_keypair  # noqa: E402

SMI = ROOT / "tests" / "provisioning" / "fixtures" / "nvidia_smi" / "a100_sxm4_80gb_x4.csv"


def wait_banner(port, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.settimeout(2)
                if sock.recv(8).startswith(b"SSH-2.0"):
                    return
        except OSError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"no SSH banner on port {port}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reason = cannot_run_dockerd()
    if reason:
        sys.exit("docker_boot: " + reason)
    rootfs = setup_machine()
    base = Path(tempfile.mkdtemp(prefix="gm-bench-docker-"))
    engine, registry = Engine(base / "engine"), Registry(base / "registry")
    (base / "engine").mkdir()
    work = base / "agent"
    (work / "bin").mkdir(parents=True)
    (work / "bin" / "nvidia-smi").write_text(f"#!/bin/sh\ncat {SMI}\n")
    (work / "bin" / "nvidia-smi").chmod(0o755)
    login = base / "login"
    login.mkdir(mode=0o700)
    try:
        engine.start()
        registry.start()
        local = engine.import_image(rootfs)
        ref = registry.push(engine, local, "bench/debian-sshd:1")
        engine.docker("rmi", local, check=True)  # only the registry's reference is left, so rmi makes it cold
        env_docker = dict(engine.env, DOCKER_CONFIG=str(login))
        subprocess.run(["docker", "login", "-u", REGISTRY_USER, "--password-stdin", registry.host], env=env_docker,
                       input=REGISTRY_PASSWORD, capture_output=True, text=True, check=True)
        agent_env = dict(engine.env, PATH=f"{work / 'bin'}:{os.environ['PATH']}", PYTHONPATH=str(ROOT),
                         GPUMARKET_RUNTIME="docker", GPUMARKET_STATE_DIR=str(work / "state"),
                         GPUMARKET_PORT_RANGE="46600-46999", GPUMARKET_DOCKER_BIND="127.0.0.1",
                         GPUMARKET_DOCKER_GPUS="none")
        key = new_keypair()[1]
        auth = {"username": REGISTRY_USER, "password": REGISTRY_PASSWORD}
        times = {"agent warm": [], "agent cold": [], "docker warm": [], "docker cold": []}
        ssh_at_answer = []

        def agent_create(n):
            request = {"vm_id": f"bench-{n}", "gpu_indices": [0], "ssh_public_keys": [key],
                       "image": {"docker": ref}, "registry_auth": auth}
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "provisioning.agent.gpumarket_agent", "vm", "create"],
                                  input=json.dumps(request), env=agent_env, capture_output=True, text=True)
            answered = time.monotonic() - t0
            answer = json.loads(proc.stdout)
            if not answer["ok"]:
                raise RuntimeError(answer)
            wait_banner(answer["ssh_port"])
            elapsed = time.monotonic() - t0
            ssh_at_answer.append(elapsed - answered < 0.05)
            subprocess.run([sys.executable, "-m", "provisioning.agent.gpumarket_agent", "vm", "destroy"],
                           input=json.dumps({"vm_id": request["vm_id"]}), env=agent_env, capture_output=True, text=True)
            return elapsed

        def docker_run(n):
            port = free_port()
            t0 = time.monotonic()
            subprocess.run(["docker", "run", "-d", "--name", f"plain-{n}", "-p", f"127.0.0.1:{port}:22", ref],
                           env=env_docker, capture_output=True, check=True)
            wait_banner(port)
            elapsed = time.monotonic() - t0
            engine.docker("rm", "-f", f"plain-{n}")
            return elapsed

        def cold():
            engine.docker("rmi", ref)
            engine.docker("image", "prune", "-f")

        n = 0
        for _round in range(args.rounds + 1):  # round 0 warms caches and is not counted
            results = {}
            for name in ("agent cold", "docker cold", "agent warm", "docker warm"):
                n += 1
                if name.endswith("cold"):
                    cold()
                results[name] = (agent_create if name.startswith("agent") else docker_run)(n)
            if _round:
                for name, value in results.items():
                    times[name].append(value)
                print(f"round {_round}: " + ", ".join(f"{k} {v:.2f} s" for k, v in results.items()), flush=True)
        print(f"\nvm create -> SSH banner, {args.rounds} rounds (seconds): median [min-max]")
        for name, values in times.items():
            print(f"  {name:<12} {statistics.median(values):6.2f}  [{min(values):.2f}-{max(values):.2f}]")
        for kind in ("warm", "cold"):
            diff = statistics.median(times["agent " + kind]) - statistics.median(times["docker " + kind])
            print(f"  agent - docker ({kind}): {diff:+.2f} s (median)")
        print(f"  sshd already answering when the agent answered: {sum(ssh_at_answer)} of {len(ssh_at_answer)}")
        version = engine.docker("version", "--format", "{{.Server.Version}}").stdout.strip()
        size = engine.docker("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip()
        print(f"engine: dockerd {version}; image: {ref} ({size} bytes)")
    finally:
        registry.stop()
        engine.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
