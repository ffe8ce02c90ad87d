#!/usr/bin/env python3
"""Benchmark: booking -> running through the whole platform on a real Docker engine, beside the engine's own
`docker run` of the same image. Not a timed test: it prints figures for docs/BENCHMARKS.md. Needs root (it starts
its own dockerd and registry, as tests/docker/ does).

What it sets up, once:
- dockerd (own data root and socket) and Debian's docker-registry with htpasswd auth, as tests/docker/engine.py;
  the test image (scripts/docker-test-setup) pushed to it, the local copy removed;
- a node (tests/docker/harness.py, shared with tests/docker/test_platform_on_docker.py): a simulated server's sshd
  (provisioning.sim) whose `SetEnv` puts the agent in `docker` mode against that
  dockerd (GPUMARKET_DOCKER_GPUS=none: no GPU injection; a fake nvidia-smi of 4 x A100 for the inventory), registered
  with node_register (runtime docker, pinned host key, its own key pair authorized on it) and listed;
- a PostgreSQL database of its own (bench/benchdb.py), migrated; a renter with credit and an API key;
- a real Celery worker (tests/live.py's Worker: `celery -A config worker`, prefork, all queues) on this worktree's
  broker (CELERY_BROKER_URL).

Four ways, interleaved in each round (round 0 warms up — the agent's first upload, the worker's SSH connection —
and is not counted):
- platform warm: `POST /api/v1/instances/` (DRF's APIClient in this process: the real view, serializer and booking
  service, no HTTP server) with the registry image and its login, image already on the node, until the instance is
  `running` (the worker marks it running once the container's sshd answers: provisioning.services.vms.wait_for_ssh)
  and this process too sees the SSH banner on the published port;
- platform cold: the same after `docker rmi` + `docker image prune` on the node's engine;
- docker warm / cold: `docker run -d -p 127.0.0.1:<port>:22 <image>` (logged in) until the SSH banner.
Each instance is destroyed through the API after its measure (not timed) and the next waits until it is gone.

Run: sudo DATABASE_URL=... CELERY_BROKER_URL=... CACHE_URL=... .venv/bin/python bench/docker_booking.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")

import benchdb  # noqa: E402 (bench/benchdb.py)
import django  # noqa: E402
from django.conf import settings  # noqa: E402

from tests.docker.engine import (  # noqa: E402
    REGISTRY_PASSWORD,
    REGISTRY_USER,
    Engine,
    Registry,
    cannot_run_dockerd,
    free_port,
    setup_machine,
)
from tests.docker.harness import docker_node, wait_banner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--db-name", default="gpumarket_bench_docker_booking")
    args = parser.parse_args()
    reason = cannot_run_dockerd()
    if reason:
        sys.exit("docker_booking: " + reason)
    rootfs = setup_machine()
    server = benchdb.point_django_at_bench_db(args.db_name)
    django.setup()
    from django.core.management import call_command
    from rest_framework.test import APIClient

    from billing.services.ledger import credit_grant
    from marketplace.models import GpuModel, Instance, Node, NodeState, User, Verdict
    from marketplace.services.accounts import api_key_create
    from marketplace.services.nodes import node_register
    from provisioning.sim import nodes as sim
    from tests.live import Worker
    from tests.provisioning.sshkit import new_keypair

    call_command("migrate", verbosity=0)
    base = Path(tempfile.mkdtemp(prefix="gm-bench-booking-"))
    engine, registry = Engine(base / "engine"), Registry(base / "registry")
    (base / "engine").mkdir()
    work = base / "agent"
    login = base / "login"
    login.mkdir(mode=0o700)
    simbase = base / "simnodes"
    worker = None
    try:
        engine.start()
        registry.start()
        local = engine.import_image(rootfs)
        ref = registry.push(engine, local, "bench/debian-sshd:1")
        engine.docker("rmi", local, check=True)  # only the registry's reference is left, so rmi makes it cold
        env_docker = dict(engine.env, DOCKER_CONFIG=str(login))
        subprocess.run(["docker", "login", "-u", REGISTRY_USER, "--password-stdin", registry.host], env=env_docker,
                       input=REGISTRY_PASSWORD, capture_output=True, text=True, check=True)

        info = docker_node(sim, simbase, engine, work)
        provider = User.objects.create_user(email="provider@docker.bench.example")
        node = node_register(
            provider=provider, name="docker-bench", address=info["address"], ssh_port=info["ssh_port"],
            ssh_user=info["ssh_user"], country="DE", city="Frankfurt",
            gpu_model=GpuModel.objects.get(slug="a100-80gb-sxm"), gpu_count=4,
            price_per_gpu_hour=Decimal("1.00"), runtime="docker", host_key_fingerprint=info["host_key_fingerprint"])
        sim.node_authorize(info["ssh_port"], node.ssh_public_key, simbase)
        Node.objects.filter(pk=node.pk).update(state=NodeState.ACTIVE, verdict=Verdict.VERIFIED, score=1.0)
        renter = User.objects.create_user(email="renter@docker.bench.example")
        credit_grant(user=renter, amount_micros=1000 * 1_000_000, reason="bench: starting balance")
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_create(user=renter, name='bench')[1]}")

        worker = Worker(base / "worker.log", simbase, suffix="-docker-bench")
        worker.start()
        key = new_keypair()[1]
        post_times: list[float] = []  # the POST itself (booking transaction, job queued on commit)
        auth = {"username": REGISTRY_USER, "password": REGISTRY_PASSWORD}
        times: dict[str, list[float]] = {"platform warm": [], "platform cold": [], "docker warm": [],
                                         "docker cold": []}

        def wait_status(instance_id: int, wanted: str, timeout: float = 300) -> Instance:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                instance = Instance.objects.get(pk=instance_id)
                if instance.status == wanted:
                    return instance
                if instance.status == "failed":
                    raise RuntimeError(f"instance {instance_id} failed: {instance.status_message}\n{worker.tail(30)}")
                time.sleep(0.02)
            raise RuntimeError(f"instance {instance_id} not {wanted} in {timeout}s ({instance.status}: "
                               f"{instance.status_message})\n{worker.tail(30)}")

        def platform_book(n: int) -> float:
            t0 = time.monotonic()
            r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": ref,
                                                 "registry_auth": auth, "ssh_public_key": key,
                                                 "label": f"bench-{n}"}, format="json")
            post_times.append(time.monotonic() - t0)
            if r.status_code != 201:
                raise RuntimeError(f"booking refused: {r.status_code} {r.content[:500]!r}")
            instance = wait_status(r.json()["id"], "running")
            wait_banner(instance.ssh_port, instance.ssh_host)
            elapsed = time.monotonic() - t0
            d = api.delete(f"/api/v1/instances/{instance.pk}/")
            if d.status_code not in (200, 202, 204):
                raise RuntimeError(f"destroy refused: {d.status_code} {d.content[:300]!r}")
            wait_status(instance.pk, "destroyed")
            return elapsed

        def docker_run(n: int) -> float:
            port = free_port()
            t0 = time.monotonic()
            subprocess.run(["docker", "run", "-d", "--name", f"plain-{n}", "-p", f"127.0.0.1:{port}:22", ref],
                           env=env_docker, capture_output=True, check=True)
            wait_banner(port)
            elapsed = time.monotonic() - t0
            engine.docker("rm", "-f", f"plain-{n}")
            return elapsed

        def cold() -> None:
            engine.docker("rmi", ref)
            engine.docker("image", "prune", "-f")

        n = 0
        for round_no in range(args.rounds + 1):  # round 0 warms up and is not counted
            results = {}
            for name in ("platform cold", "docker cold", "platform warm", "docker warm"):
                n += 1
                if name.endswith("cold"):
                    cold()
                results[name] = (platform_book if name.startswith("platform") else docker_run)(n)
            load = os.getloadavg()[0]
            if round_no:
                for name, value in results.items():
                    times[name].append(value)
            print(f"round {round_no}{'' if round_no else ' (warm-up)'}: "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in results.items()) + f"; load {load:.2f}", flush=True)
        print(f"\nPOST /api/v1/instances/ -> running + SSH banner, beside docker run -> SSH banner; "
              f"{args.rounds} rounds (seconds): median [min-max]")
        for name, values in times.items():
            print(f"  {name:<14} {statistics.median(values):6.2f}  [{min(values):.2f}-{max(values):.2f}]")
        print(f"  of which the POST's answer: median {statistics.median(post_times[2:]):.3f} s "
              f"[{min(post_times[2:]):.3f}-{max(post_times[2:]):.3f}]")
        for kind in ("warm", "cold"):
            diff = statistics.median(times["platform " + kind]) - statistics.median(times["docker " + kind])
            print(f"  platform - docker ({kind}): {diff:+.2f} s (median)")
        version = engine.docker("version", "--format", "{{.Server.Version}}").stdout.strip()
        size = engine.docker("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip()
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"engine: dockerd {version}; image: {ref} ({size} bytes); worker: celery prefork x2 on "
              f"{settings.CELERY_BROKER_URL.rsplit('@', 1)[-1]}; load average {load}; {os.cpu_count()} CPUs")
    finally:
        if worker is not None:
            worker.stop()
        sim.nodes_down(simbase)
        registry.stop()
        engine.stop()
        benchdb.drop_bench_db(server, args.db_name)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
