#!/usr/bin/env python3
"""Fleet health check: the platform's batch path against Ansible ad-hoc `-m raw` of the same agent command.

Not a timed test: it prints figures for docs/BENCHMARKS.md. What it does, in one run:

1. starts N simulated GPU servers (default 1,000, a mix of the profiles under
   provisioning/agent/profiles/): each a real OpenSSH sshd on a loopback port running the node
   agent in sim mode, in a temporary folder of its own. Before each node it looks at the memory
   the machine has left (MemAvailable): below --min-free-mib it stops adding nodes and says so;
2. creates a PostgreSQL database of its own (`gpumarket_bench_fleet`; never the test or dev one),
   migrates it, registers every node through `node_register` (which makes the node's own ed25519
   key pair), authorizes that key on the node, pins the host key node_up reported, marks it active;
3. warms up: one untimed cycle through the platform's batch path, which opens this process's kept
   connection to every node (provisioning.ssh_pool) and uploads or checks the agent once per node;
4. measures, interleaved round by round so that drift hits both sides alike:
   - the platform: one health cycle = the dispatcher's split into batches of FLEET_BATCH_SIZE, each
       run by `provisioning.services.fleet.nodes_health_batch` in this process, one after the other
       (what one worker process does with the batches it takes): per-node slot in the cache, the kept
       pinned paramiko connection, `health` through the long-lived agent it runs (`agent serve`: every
       request of the batch written, then every answer read), then the batch's results written in a
       few set-based statements. Control-plane CPU = this process's CPU time (all its threads);
   - `ansible all -m raw -a "python3 <agent> health" -f F` on the same hosts, with the same per-node
       keys and the same pinned host keys (a known_hosts file, StrictHostKeyChecking=yes), over
       ansible's OpenSSH connection, cold each run (fresh ControlPath folder);
5. one more platform cycle with an empty pool (a new worker: a connection per node) as a what-if;
6. prints the table, the goals (<= 0.3 x Ansible's wall time; <= 2 ms control-plane CPU per probe)
   and whether each was met, and the worker cores 10,000 nodes a minute would need at the measured
   CPU per probe; stops every node and drops the database (also on error or Ctrl-C).

Run: make bench, or
     .venv/bin/pip install -r requirements-bench.txt -c constraints.txt
     DJANGO_SETTINGS_MODULE=config.settings.test .venv/bin/python bench/fleet.py [--nodes 1000]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")

import benchdb  # noqa: E402 (bench/benchdb.py, beside this script)
import django  # noqa: E402
from django.conf import settings  # noqa: E402

PROFILES = ("rtx-a4000-x2", "rtx-a6000-x8", "a100-80gb-sxm-x4", "h100-sxm-x1")
GOAL_VS_ANSIBLE = 0.3  # platform wall time per cycle / Ansible's
GOAL_CPU_PER_PROBE_MS = 2.0  # control-plane CPU per probe
PROJECT_NODES_PER_MINUTE = 10_000
CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000, help="simulated nodes to try (%(default)s)")
    p.add_argument("--min-free-mib", type=int, default=3072,
                   help="stop adding nodes when the machine has less memory available (%(default)s MiB)")
    p.add_argument("--runs", type=int, default=3, help="timed rounds, each a platform cycle and an Ansible run "
                                                       "(%(default)s)")
    p.add_argument("--batch-size", type=int, default=None, help="nodes per batch (default: FLEET_BATCH_SIZE)")
    p.add_argument("--forks", type=int, default=200,
                   help="Ansible's -f, at most the number of nodes (%(default)s: one Python process per fork)")
    p.add_argument("--no-ansible", action="store_true", help="measure the platform only")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="also time one cycle with an empty SSH pool (%(default)s)")
    p.add_argument("--db-name", default="gpumarket_bench_fleet", help="database to create (%(default)s)")
    p.add_argument("--keep-dir", action="store_true", help="keep the temporary folder (keys, inventory)")
    return p.parse_args()


# --------------------------------------------------------------------------- database

def point_django_at_bench_db(name: str) -> dict:
    server = benchdb.point_django_at_bench_db(name)
    # The per-node SSH slots live in the shared cache: keep the bench's keys apart from the tests'.
    settings.CACHES["default"]["KEY_PREFIX"] = f"bench-fleet-{os.getpid()}"
    return server


drop_bench_db = benchdb.drop_bench_db


# --------------------------------------------------------------------------- measuring helpers

class Meter:
    """Wall time and CPU seconds: this process (all its threads), the children it waited for (ansible and its
    ssh clients), the simulated nodes (each node's sshd listener plus every session and agent under it, live
    or reaped), and the whole machine (which also counts whatever else runs on it)."""

    node_pids: list[int] = []  # the sshd listeners of the fleet, set once the nodes are up
    extra = 0.0  # CPU of client processes nobody waits for (ansible's ControlPersist masters), added by hand

    wall = cpu_self = cpu_children = cpu_nodes = cpu_machine = 0.0

    @contextlib.contextmanager
    def adding(self):
        """Measure a stretch and add it to this meter's totals (for interleaved measurements)."""
        with Meter() as part:
            yield
        for name in ("wall", "cpu_self", "cpu_children", "cpu_nodes", "cpu_machine"):
            setattr(self, name, getattr(self, name) + getattr(part, name))

    def __enter__(self) -> Meter:
        self._t = time.perf_counter()
        self._self = _rusage(resource.RUSAGE_SELF)
        self._children = _rusage(resource.RUSAGE_CHILDREN)
        self._nodes = _pids_cpu(self.node_pids)
        self._machine = _machine_busy_s()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t
        self.cpu_self = _rusage(resource.RUSAGE_SELF) - self._self
        self.cpu_children = _rusage(resource.RUSAGE_CHILDREN) - self._children
        self.cpu_nodes = _pids_cpu(self.node_pids) - self._nodes
        self.cpu_machine = _machine_busy_s() - self._machine

    @property
    def cpu_ours(self) -> float:
        """CPU spent by the thing measured: client side and node side."""
        return self.cpu_client + self.cpu_nodes

    @property
    def cpu_client(self) -> float:
        return self.cpu_self + self.cpu_children + self.extra


def _rusage(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _pids_cpu(pids: list[int]) -> float:
    """CPU seconds of these processes and of every process under them, live or reaped (utime + stime +
    cutime + cstime of each: a reaped child's time moves into its parent's cutime)."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    chosen = {p for p in pids if p in stats}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    stack = list(chosen)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in chosen:
                chosen.add(child)
                stack.append(child)
    return sum(stats[p][1] for p in chosen) / CLK_TCK


def _tree_rss_mib(pids: list[int]) -> float:
    """Resident memory of these processes and every process under them (MiB; shared pages counted in each)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    chosen, stack = set(pids), list(pids)
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in chosen:
                chosen.add(child)
                stack.append(child)
    total_kib = 0
    for pid in chosen:
        try:
            with open(f"/proc/{pid}/status") as f:
                total_kib += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            continue
    return total_kib / 1024


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:8]]  # user .. softirq (steal is not ours)
    return (sum(values) - values[3] - values[4]) / CLK_TCK  # minus idle and iowait


def median(values: list[float]) -> float:
    return statistics.median(values)


# --------------------------------------------------------------------------- the fleet

def fleet_down(base: Path) -> int:
    """Stop every process of the fleet (each node's sshd, its sessions and agents): one look through /proc for
    all of them, where sim.nodes_down looks once per node (minutes for 1,000 nodes). Returns the nodes' count."""
    from provisioning.agent import gpumarket_agent as agent

    nodes = len(list((base / "nodes").glob("*/node.json"))) if (base / "nodes").is_dir() else 0
    agent.kill_trees(agent.pids_matching(f"{base}/"))  # the listeners, and every session under them
    return nodes


def profile_gpus(profile_path: str) -> tuple[str, int]:
    """(nvidia-smi name, count) declared by a sim profile."""
    lines = json.loads(Path(profile_path).read_text())["nvidia_smi"]
    return lines[0].split(",")[2].strip(), len(lines)


def mem_available_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def fleet_up(n: int, base: Path, min_free_mib: int) -> tuple[list[dict], str]:
    """Start up to n nodes; fewer when the machine's available memory falls below min_free_mib (says why)."""
    from provisioning.sim import nodes as sim

    infos: list[dict] = []
    # One after the other: node_up picks a free port and clears its folder, not safe to run in threads.
    for i in range(n):
        free = mem_available_mib()
        if free < min_free_mib:
            return infos, (f"stopped at {len(infos)} of {n} nodes: {free} MiB of memory available, under the "
                           f"{min_free_mib} MiB floor (--min-free-mib) kept for the platform, Ansible's forks "
                           "and the other work on this machine")
        infos.append(sim.node_up(PROFILES[i % len(PROFILES)], base))
    return infos, ""


def fleet_register(infos: list[dict], base: Path) -> list:
    from marketplace.models import GpuModel, Node, NodeState, User, Verdict
    from marketplace.services.nodes import node_register
    from provisioning.sim import nodes as sim

    provider = User.objects.create_user(email="provider@fleet.bench.example")
    nodes = []
    for i, info in enumerate(infos):
        smi_name, count = profile_gpus(info["profile_path"])
        node = node_register(
            provider=provider, name=f"fleet-{i:03d}-{info['profile']}", address=info["address"],
            ssh_port=info["ssh_port"], ssh_user=info["ssh_user"], country="DE", city="Frankfurt",
            gpu_model=GpuModel.objects.get(smi_name=smi_name), gpu_count=count,
            price_per_gpu_hour=Decimal("1.00"), runtime="sim", host_key_fingerprint=info["host_key_fingerprint"],
        )
        sim.node_authorize(info["ssh_port"], node.ssh_public_key, base)  # the provider's install command
        nodes.append(node)
    Node.objects.filter(pk__in=[n.pk for n in nodes]).update(state=NodeState.ACTIVE, verdict=Verdict.VERIFIED)
    return list(Node.objects.filter(pk__in=[n.pk for n in nodes]).order_by("pk"))


class StatementCounter:
    """Counts the SQL statements run on this thread's connection (the batches' writes run there)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, execute, sql, params, many, context):
        self.count += 1
        return execute(sql, params, many, context)


def platform_cycle(node_ids: list[int], batch_size: int, pool, threads: int | None = None) -> dict:
    """One health cycle as one worker process runs it: the batches one after the other."""
    from django.db import connection

    from provisioning.services import fleet

    summary: dict[str, int] = {}
    counter = StatementCounter()
    batches = fleet.fleet_batches(node_ids, batch_size)
    with Meter() as m, connection.execute_wrapper(counter):
        for batch in batches:
            for key, value in fleet.nodes_health_batch(batch, pool=pool,
                                                       parallelism=threads or fleet.HEALTH_PARALLELISM).items():
                summary[key] = summary.get(key, 0) + int(value)
    probes = summary.get("checked", 0)
    if summary.get("failed"):  # why, in the nodes' own records (outside the timing)
        summary["why"] = failure_reasons(node_ids)  # type: ignore[assignment]
    return {"wall": m.wall, "meter": m, "summary": summary, "probes": probes, "batches": len(batches),
            "statements": counter.count, "cpu_ms_per_probe": m.cpu_self / max(probes, 1) * 1000}


def failure_reasons(node_ids: list[int]) -> dict[str, int]:
    """{the error of a node whose last check failed: how many nodes}, digits masked so that alike ones add up."""
    import re
    from collections import Counter

    from marketplace.models import Node

    errors = Node.objects.filter(pk__in=node_ids, health_failures__gt=0).values_list("last_error", flat=True)
    return dict(Counter(re.sub(r"\d+(\.\d+)?", "N", e)[:160] for e in errors).most_common(5))


# --------------------------------------------------------------------------- Ansible

def ansible_setup(work: Path, nodes: list, infos: dict[int, dict], agent_paths: dict[int, str]) -> dict:
    """Per-node private keys (0600), a known_hosts with the pinned host keys, the inventory, a config."""
    from marketplace.services.nodes import node_private_key

    keys = work / "keys"
    keys.mkdir(mode=0o700)
    known_hosts = work / "known_hosts"
    lines, kh = ["[fleet]"], []
    for node in nodes:
        key_file = keys / f"node-{node.pk}"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(node_private_key(node=node))
        info = infos[node.pk]
        kh.append(f"[{node.address}]:{node.ssh_port} {info['host_public_key']}")
        lines.append(f"node-{node.pk} ansible_host={node.address} ansible_port={node.ssh_port} "
                     f"ansible_user={node.ssh_user} ansible_ssh_private_key_file={key_file} "
                     f"agent_path={agent_paths[node.pk]}")
    known_hosts.write_text("\n".join(kh) + "\n")
    lines += ["", "[all:vars]", "ansible_connection=ssh", "ansible_python_interpreter=/usr/bin/python3",
              # Same security as the platform: only the pinned host key is accepted, nothing is learnt.
              f"ansible_ssh_common_args='-o UserKnownHostsFile={known_hosts} -o GlobalKnownHostsFile=/dev/null "
              "-o StrictHostKeyChecking=yes -o IdentitiesOnly=yes'"]
    inventory = work / "inventory.ini"
    inventory.write_text("\n".join(lines) + "\n")
    config = work / "ansible.cfg"
    config.write_text("[defaults]\nhost_key_checking = True\n")
    return {"inventory": inventory, "config": config, "home": work / "ansible-home"}


def ansible_binary() -> str:
    beside = Path(sys.executable).parent / "ansible"
    found = str(beside) if beside.exists() else shutil.which("ansible")
    if not found:
        sys.exit("bench: ansible is not installed; run: .venv/bin/pip install -r requirements-bench.txt")
    return found


def ansible_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60).stdout
    return out.splitlines()[0] if out else "?"


def ansible_round(binary: str, setup: dict, work: Path, forks: int, run_no: int) -> dict:
    from provisioning.agent import gpumarket_agent as agent

    control_dir = work / f"cp-raw-{run_no}"  # fresh per run: no connection survives from a previous run
    control_dir.mkdir()
    env = dict(os.environ)
    env.update({
        "ANSIBLE_CONFIG": str(setup["config"]),
        "ANSIBLE_HOME": str(setup["home"]),
        "ANSIBLE_LOCAL_TEMP": str(work / "ansible-local"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control_dir),
        "ANSIBLE_TIMEOUT": "30",
        "ANSIBLE_NOCOLOR": "True",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
    })
    argv = [binary, "all", "-i", str(setup["inventory"]), "-m", "ansible.builtin.raw",
            "-a", "python3 {{ agent_path }} health", "-f", str(forks), "-o"]
    try:
        with Meter() as m:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600,
                                  stdin=subprocess.DEVNULL, cwd=work)
            m.extra = _pids_cpu(agent.pids_matching(str(control_dir)))
    finally:
        # ControlPersist masters (ansible's defaults) outlive the run: end those this run started.
        agent.kill_trees(agent.pids_matching(str(control_dir)))
    ok, errors = 0, []
    for line in proc.stdout.splitlines():
        # -o: "host | CHANGED | rc=0 | (stdout) {...}\n", or "host | FAILED ..." / "host | UNREACHABLE! ..."
        host, _, rest = line.partition(" | ")
        status, _, detail = rest.partition(" | ")
        stdout = detail.partition("(stdout) ")[2].strip()
        try:
            answer = json.JSONDecoder().raw_decode(stdout)[0] if stdout else {}
            answer_ok = status == "CHANGED" and detail.startswith("rc=0 ") and answer.get("ok") is True
        except ValueError:
            answer_ok = False
        if answer_ok:
            ok += 1
        elif host.startswith("node-"):
            errors.append(line[:300])
    if not ok and not errors:
        raise RuntimeError(f"ansible printed no result (rc {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-1500:]}")
    return {"wall": m.wall, "ok": ok, "errors": errors, "meter": m, "rc": proc.returncode}


# --------------------------------------------------------------------------- report

def cpu_line(m: Meter) -> str:
    return (f"CPU s: client {m.cpu_client:.1f}, nodes {m.cpu_nodes:.1f}, "
            f"machine {m.cpu_machine:.1f} (other work {max(0.0, m.cpu_machine - m.cpu_ours):.1f})")


def fmt_s(seconds: float) -> str:
    return f"{seconds:.2f} s"


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    binary = "" if args.no_ansible else ansible_binary()  # before anything is created that would need cleaning up
    work = Path(tempfile.gettempdir()) / f"gpumarket-fleet-{os.getpid()}-{secrets.token_hex(4)}"
    work.mkdir(mode=0o700)
    base = work / "simnodes"  # a plain path: sshd_config has no quoting
    server = point_django_at_bench_db(args.db_name)
    from provisioning.sim import nodes as sim  # no Django needed: also what the cleanup uses

    pools = []
    try:
        django.setup()
        from django.core.management import call_command
        from django.db import connection

        from provisioning.ssh_pool import SshPool

        logging.getLogger("paramiko").setLevel(logging.WARNING)  # one INFO line per connection otherwise
        batch_size = args.batch_size or settings.FLEET_BATCH_SIZE
        t = time.perf_counter()
        call_command("migrate", verbosity=0, interactive=False)
        with connection.cursor() as c:
            c.execute("SELECT version()")
            pg_version = c.fetchone()[0].split(",")[0]
        print(f"database {args.db_name} created and migrated in {time.perf_counter() - t:.1f} s")

        t = time.perf_counter()
        infos, short = fleet_up(args.nodes, base, args.min_free_mib)
        if not infos:
            raise RuntimeError(short or "no node started")
        node_pids = [i["pid"] for i in infos if i["pid"]]
        print(f"{len(infos)} simulated nodes up in {time.perf_counter() - t:.1f} s ({profile_mix(infos)}); "
              f"{_tree_rss_mib(node_pids) / len(infos):.1f} MiB resident each (an idle sshd)")
        if short:
            print(f"  NOTE: {short}")
        t = time.perf_counter()
        nodes = fleet_register(infos, base)
        node_ids = [n.pk for n in nodes]
        by_port = {i["ssh_port"]: i for i in infos}
        node_infos = {n.pk: by_port[n.ssh_port] for n in nodes}
        Meter.node_pids = [i["pid"] for i in infos if i["pid"]]
        print(f"registered (node_register, per-node ed25519 keys, pinned host keys) in "
              f"{time.perf_counter() - t:.1f} s")

        pool = SshPool(max_size=max(len(nodes), settings.FLEET_SSH_POOL_SIZE), idle_s=3600)
        pools.append(pool)
        t = time.perf_counter()
        # Opening 1,000 connections (key exchange, authentication, the agent's upload) at once on a small shared
        # machine would time some out: the warm-up opens them 32 at a time, and tries the odd failure again.
        for attempt in range(3):
            warm = platform_cycle(node_ids, batch_size, pool, threads=32)
            if not warm["summary"].get("failed"):
                break
            print(f"  warm-up pass {attempt + 1}: {warm['summary']}")
        else:
            raise RuntimeError(f"warm-up: {warm['summary']}")
        agent_paths = {node_id: known[2] for node_id, known in pool._agents.items()}
        print(f"warm-up: untimed cycles ({warm['batches']} batches of {batch_size}, 32 threads) opened "
              f"{pool.connects} kept connections and uploaded the agent once per node in "
              f"{time.perf_counter() - t:.1f} s; nodes' resident memory with them: "
              f"{_tree_rss_mib(node_pids) / len(nodes):.1f} MiB a node")

        forks = min(args.forks, len(nodes))
        ansible = None if args.no_ansible else ansible_setup(work, nodes, node_infos, agent_paths)
        version = "" if args.no_ansible else ansible_version(binary)
        print(f"machine: {os.cpu_count()} CPUs, {mem_total_gib():.0f} GiB, {platform.python_implementation()} "
              f"{platform.python_version()}, {pg_version}, {ssh_version()}, paramiko {paramiko_version()}"
              + (f", {version}" if version else ""))
        loads = [os.getloadavg()]
        print(f"load average before measuring (1, 5, 15 min): {fmt_load(loads[0])}\n")

        platform_runs: list[dict] = []
        ansible_runs: list[dict] = []
        for i in range(args.runs):
            r = platform_cycle(node_ids, batch_size, pool)
            platform_runs.append(r)
            print(f"  platform cycle {i + 1}: {fmt_s(r['wall'])}, {r['summary']}, {r['statements']} SQL statements, "
                  f"{r['cpu_ms_per_probe']:.2f} ms CPU per probe; {cpu_line(r['meter'])}; load {fmt_load()}")
            if ansible is not None:
                a = ansible_round(binary, ansible, work, forks, i)
                ansible_runs.append(a)
                print(f"  ansible -m raw -f {forks} run {i + 1}: {fmt_s(a['wall'])}, {a['ok']}/{len(nodes)} ok; "
                      f"{cpu_line(a['meter'])}; load {fmt_load()}")
                if a["errors"]:
                    print("    e.g. " + "; ".join(a["errors"][:3]))
            loads.append(os.getloadavg())
        cold = None
        if args.cold:
            # The old worker is gone: its connections (and the long-lived agent each runs on its node, ~13 MB
            # each) with it. Kept open, 1,000 nodes would hold two agents each, which ran this machine out of memory.
            pool.close_all()
            cold_pool = SshPool(max_size=len(nodes), idle_s=3600)
            pools.append(cold_pool)
            cold = platform_cycle(node_ids, batch_size, cold_pool)
            print(f"  platform cycle with an empty pool (a new worker): {fmt_s(cold['wall'])}, {cold['summary']}, "
                  f"{cold['cpu_ms_per_probe']:.2f} ms CPU per probe; {cpu_line(cold['meter'])}")
        report(len(nodes), short, batch_size, forks, platform_runs, ansible_runs, cold, loads)
    finally:
        t = time.perf_counter()
        for kept in pools:
            kept.close_all()
        try:
            stopped = fleet_down(base)
            sim.nodes_down(base)  # what is left of each node's folder
        finally:
            drop_bench_db(server, args.db_name)
            if args.keep_dir:
                print(f"\nkept {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
        print(f"\ncleanup: {stopped} nodes stopped, database {args.db_name} dropped in "
              f"{time.perf_counter() - t:.1f} s; total {time.perf_counter() - started:.1f} s")


def fmt_load(load: tuple[float, float, float] | None = None) -> str:
    return " ".join(f"{v:.1f}" for v in (load or os.getloadavg()))


def mem_total_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def profile_mix(infos: list[dict]) -> str:
    return ", ".join(f"{sum(i['profile'] == p for i in infos)} {p}" for p in PROFILES)


def ssh_version() -> str:
    proc = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=10)
    return (proc.stderr or proc.stdout).split(",")[0].strip()


def paramiko_version() -> str:
    import paramiko

    return paramiko.__version__


def report(n: int, short: str, batch_size: int, forks: int, platform_runs: list[dict], ansible_runs: list[dict],
           cold: dict | None, loads: list[tuple[float, float, float]]) -> None:
    ncpu = os.cpu_count() or 1
    walls = [r["wall"] for r in platform_runs]
    p_med = median(walls)
    cpu_probe = median([r["cpu_ms_per_probe"] for r in platform_runs])
    failed = sum(r["summary"].get("failed", 0) for r in platform_runs)
    p_nodes = median([r["meter"].cpu_nodes for r in platform_runs])
    p_self = median([r["meter"].cpu_self for r in platform_runs])
    print(f"\n=== {n} simulated nodes on {ncpu} CPUs; batches of {batch_size}, run one after the other in one "
          f"process; {len(platform_runs)} rounds; Ansible -m raw -f {forks} ===\n")
    rows = [
        ("platform cycle: wall, median (min - max)",
         f"{fmt_s(p_med)}  ({fmt_s(min(walls))} - {fmt_s(max(walls))}), {failed} of "
         f"{sum(r['probes'] for r in platform_runs)} probes failed"),
        ("platform control-plane CPU per probe (median)",
         f"{cpu_probe:.2f} ms  (this process: {p_self:.2f} CPU-s per cycle)"),
        ("nodes' CPU per cycle (sshd + agent), median", f"{p_nodes:.1f} CPU-s = {p_nodes / n * 1000:.0f} ms a probe"),
        ("SQL statements per cycle (batch writes)",
         f"{median([r['statements'] for r in platform_runs]):.0f} for {platform_runs[0]['batches']} batches"),
    ]
    if cold is not None:
        rows.append(("what-if, empty pool (a connection per node)",
                     f"{fmt_s(cold['wall'])}, {cold['cpu_ms_per_probe']:.2f} ms CPU per probe, nodes "
                     f"{cold['meter'].cpu_nodes:.1f} CPU-s"))
    a_med = 0.0
    if ansible_runs:
        a_walls = [a["wall"] for a in ansible_runs]
        a_med = median(a_walls)
        a_cpu = median([a["meter"].cpu_client for a in ansible_runs])
        a_nodes = median([a["meter"].cpu_nodes for a in ansible_runs])
        rows += [
            ("ansible -m raw: wall, median (min - max)",
             f"{fmt_s(a_med)}  ({fmt_s(min(a_walls))} - {fmt_s(max(a_walls))}), "
             f"{sum(a['ok'] for a in ansible_runs)} of {n * len(ansible_runs)} hosts ok"),
            ("ansible client CPU per probe (median)", f"{a_cpu / n * 1000:.1f} ms  ({a_cpu:.1f} CPU-s per run)"),
            ("ansible nodes' CPU per run, median", f"{a_nodes:.1f} CPU-s = {a_nodes / n * 1000:.0f} ms a probe"),
            ("ratio platform / ansible wall", f"{p_med / a_med:.2f}"),
        ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print(f"load average (1, 5, 15 min): before {fmt_load(loads[0])}, after {fmt_load(loads[-1])}")
    if short:
        print(f"fewer nodes than asked: {short}")

    print()
    if ansible_runs:
        ratio = p_med / a_med
        print(f"goal: platform wall <= {GOAL_VS_ANSIBLE} x Ansible's: {ratio:.2f} x -> "
              f"{'met' if ratio <= GOAL_VS_ANSIBLE else 'NOT met'}")
    print(f"goal: control-plane CPU per probe <= {GOAL_CPU_PER_PROBE_MS:g} ms: {cpu_probe:.2f} ms -> "
          f"{'met' if cpu_probe <= GOAL_CPU_PER_PROBE_MS else 'NOT met'}")
    cores = cpu_probe / 1000 * PROJECT_NODES_PER_MINUTE / 60
    print(f"projection: {PROJECT_NODES_PER_MINUTE:,} nodes a minute at {cpu_probe:.2f} ms a probe = "
          f"{cpu_probe / 1000 * PROJECT_NODES_PER_MINUTE:.1f} CPU-s a minute = {cores:.2f} worker cores busy "
          f"(plus PostgreSQL and Redis; the nodes' own CPU is theirs)")
    print("note: the platform's figure is one worker process running every batch; the agent was uploaded once per "
          "node in the warm-up and the connections kept from it (ssh_pool), as a worker keeps them between cycles")


if __name__ == "__main__":
    main()
