#!/usr/bin/env python3
"""The node's CPU for one agent command, for docs/BENCHMARKS.md: every command the platform runs on a node starts
`python3 gpumarket_agent-<hash>.pyz <command>` afresh, and a zipapp holds no __pycache__. Three archives, run in turn
(interleaved), each command N times, on a sim node's folder with the node's own python3 (/usr/bin/python3, the one
sshd finds), without SSH:
- baseline: the agent of --baseline-rev (default: main before round 47) as it was built then, sources only, so the
  whole agent was compiled at every command and every module imported by every command;
- the same sources with each module's hash-checked .pyc beside it (what the bytecode alone saves);
- now: this tree's agent as the platform builds it (bytecode, and each command importing what it uses).
The CPU is the command's process's own (user + system, from the kernel's accounting of children), its wall beside.

Run: .venv/bin/python bench/agent_command_cpu.py [--runs 40] [--profile a10-x2] [--baseline-rev 75a9efe]
"""
from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioning.agent.gpumarket_agent.bundle import build_zipapp  # noqa: E402
from provisioning.ssh import agent_bundle  # noqa: E402

NODE_PYTHON = "/usr/bin/python3"
COMMANDS = ["health", "inventory", "vm list"]


def sources_only(data: bytes) -> bytes:
    """The same archive without its .pyc entries: byte for byte the zipapp the platform built before."""
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(buf, "w") as out:
        for info in src.infolist():
            if not info.filename.endswith(".pyc"):
                out.writestr(info, src.read(info))
    return buf.getvalue()


def agent_at(rev: str, into: Path) -> Path:
    """The agent package's sources at git revision `rev`, written under `into`."""
    archive = subprocess.run(["git", "archive", rev, "provisioning/agent/gpumarket_agent"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "provisioning/agent/gpumarket_agent"


def run_once(archive: Path, command: str, env: dict) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one command's process."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([NODE_PYTHON, str(archive), *command.split()], input="{}", capture_output=True, text=True,
                          env=env, timeout=60)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if '"ok": true' not in proc.stdout:
        raise SystemExit(f"{command} failed: {proc.stdout[:300]} {proc.stderr[-300:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--profile", default="a10-x2")
    parser.add_argument("--baseline-rev", default="75a9efe")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        node = Path(tmp)
        shutil.copy(ROOT / "provisioning/agent/profiles" / f"{args.profile}.json", node / "profile.json")
        old = build_zipapp(str(agent_at(args.baseline_rev, node / "old")))
        archives = {f"{args.baseline_rev}": node / "before.pyz", f"{args.baseline_rev}+pyc": node / "pyc.pyz",
                    "now": node / "now.pyz"}
        archives[f"{args.baseline_rev}"].write_bytes(sources_only(old))
        archives[f"{args.baseline_rev}+pyc"].write_bytes(old)
        archives["now"].write_bytes(agent_bundle()[0])
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "GPUMARKET_RUNTIME": "sim",
               "GPUMARKET_SIM_PROFILE": str(node / "profile.json"), "GPUMARKET_SIM_ROOT": tmp}
        print(f"node python: {subprocess.run([NODE_PYTHON, '-V'], capture_output=True, text=True).stdout.strip()}, "
              f"archives: {', '.join(f'{k} {v.stat().st_size // 1024} KiB' for k, v in archives.items())}, "
              f"{args.runs} runs per command and archive, interleaved, machine load {os.getloadavg()[0]:.2f}")
        for command in COMMANDS:
            figures: dict[str, list[tuple[float, float]]] = {k: [] for k in archives}
            for _ in range(args.runs):
                for name, archive in archives.items():
                    figures[name].append(run_once(archive, command, env))
            line = []
            for name, runs in figures.items():
                cpu = statistics.median(c for c, _ in runs) * 1000
                wall = statistics.median(w for _, w in runs) * 1000
                line.append(f"{name}: CPU {cpu:.0f} ms, wall {wall:.0f} ms")
            before, _, now = (statistics.median(c for c, _ in runs) for runs in figures.values())
            print(f"  {command:<10} " + " | ".join(line) + f" | CPU saved {(before - now) * 1000:.0f} ms "
                  f"({(1 - now / before) * 100:.0f} %)")


if __name__ == "__main__":
    main()
