"""What the platform-level Docker test (test_platform_on_docker.py) and bench/docker_booking.py share: a node that is
a simulated server's sshd (provisioning.sim) whose agent runs in `docker` mode against a test engine, and the wait
for an SSH banner.

The node: `SetEnv` in its sshd_config is rewritten so that every agent call over SSH gets GPUMARKET_RUNTIME=docker
and DOCKER_HOST of the engine; GPUMARKET_DOCKER_GPUS=none (no GPU injection: that is checked at the agent level in
test_docker_runtime.py); a fake nvidia-smi of 4 x A100 on its PATH for the inventory."""
from __future__ import annotations

import re
import socket
import time
from pathlib import Path

from tests.docker.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
SMI = ROOT / "tests" / "provisioning" / "fixtures" / "nvidia_smi" / "a100_sxm4_80gb_x4.csv"
PROFILE = "a100-80gb-sxm-x4"


def wait_banner(port: int, host: str = "127.0.0.1", timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=2) as sock:
                sock.settimeout(2)
                if sock.recv(8).startswith(b"SSH-2.0"):
                    return
        except OSError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"no SSH banner on {host}:{port}")


def docker_node(sim, simbase: Path, engine: Engine, work: Path, port_range: str = "46600-46999") -> dict:
    """Start a simulated server (sim: provisioning.sim.nodes) whose agent runs in docker mode against `engine`;
    `work` holds the agent's state and the fake nvidia-smi. Answers sim.node_up's info."""
    (work / "bin").mkdir(parents=True, exist_ok=True)
    smi = work / "bin" / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {SMI}\n")
    smi.chmod(0o755)
    info = sim.node_up(PROFILE, simbase)
    node_dir = Path(info["node_dir"])
    env = {
        "GPUMARKET_RUNTIME": "docker",
        "GPUMARKET_STATE_DIR": str(work / "state"),
        "GPUMARKET_PUBLIC_HOST": "127.0.0.1",
        "GPUMARKET_PORT_RANGE": port_range,
        "GPUMARKET_DOCKER_BIND": "127.0.0.1",
        "GPUMARKET_DOCKER_GPUS": "none",
        "GPUMARKET_INTERNAL_REGISTRIES": "127.0.0.1",  # the session's registry (conftest.py), renters' own images
        "DOCKER_HOST": engine.env["DOCKER_HOST"],
        "PATH": f"{work / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(node_dir / "home"),
    }
    config = node_dir / "sshd_config"
    text = re.sub(r"(?m)^SetEnv .*$", "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()),
                  config.read_text())
    config.write_text(text)
    sim.node_cut(info["ssh_port"], simbase)  # restarted with the same host key, to read the new SetEnv
    sim.node_restore(info["ssh_port"], simbase)
    return info
