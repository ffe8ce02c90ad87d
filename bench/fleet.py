#!/usr/bin/env python3
"""Fleet health check: the platform against the slowest single node and against Ansible ad-hoc.

Not a timed test: it prints figures for docs/BENCHMARKS.md. What it does, in one run:

1. starts N simulated GPU servers (default 100, a mix of the profiles under
   provisioning/agent/profiles/): each a real OpenSSH sshd on a loopback port running the node
   agent in sim mode, in a temporary folder of its own;
2. creates a PostgreSQL database of its own (`gpumarket_bench_fleet`; never the test or dev one),
   migrates it, registers every node through `node_register` (which makes the node's own ed25519
   key pair), authorizes that key on the node, pins the host key node_up reported, marks it active;
3. warms up: uploads the agent to every node once through the platform's own session (Ansible, by
   design, copies its module on every run: the report says so) and runs one untimed fleet probe;
4. measures the slowest single node: every node probed alone, one after the other, twice (per node
   the faster of its two probes);
5. measures, interleaved round by round so that drift hits every side alike:
   - the platform: `provisioning.services.maintenance.nodes_probe` over all nodes, the code the
       periodic `nodes_health_check` task runs (thread pool of HEALTH_PARALLELISM, per-node slot in
       the cache, pinned paramiko session, `health` through the agent);
   - `ansible all -m command -a "python3 <agent> health" -f N` on the same hosts, with the same
       per-node keys and the same pinned host keys (a known_hosts file, StrictHostKeyChecking=yes),
       over ansible's OpenSSH connection, cold each run (fresh ControlPath folder): once with
       ansible's defaults, once with pipelining on (one SSH connection per host, its best case);
6. breaks one probe down (connect, agent check over SFTP, `health` exec) and measures the CPU one
   probe costs on this machine, to tell how far a CPU-bound machine allows the fleet to go;
7. prints the table and whether the targets are met; stops every node and drops the database
   (also on error or Ctrl-C).

Run: make bench, or
     .venv/bin/pip install -r requirements-bench.txt -c constraints.txt
     DJANGO_SETTINGS_MODULE=config.settings.test .venv/bin/python bench/fleet.py
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
TARGET_VS_SLOWEST = 2.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=100, help="simulated nodes (%(default)s)")
    p.add_argument("--runs", type=int, default=5, help="timed platform fleet probes (%(default)s)")
    p.add_argument("--ansible-runs", type=int, default=3, help="timed runs per Ansible variant (%(default)s)")
    p.add_argument("--ansible-variants", default="defaults,pipelining",
                   help="comma-separated: defaults, pipelining, or none (%(default)s)")
    p.add_argument("--parallelism", type=int, default=None,
                   help="thread pool of nodes_probe (default: maintenance.HEALTH_PARALLELISM)")
    p.add_argument("--sweep", default="100",
                   help="also time nodes_probe once at each of these pool sizes, e.g. 16,32,100; '' for none "
                        "(%(default)s)")
    p.add_argument("--alone-passes", type=int, default=2, help="passes of single-node probes (%(default)s)")
    p.add_argument("--breakdown", type=int, default=20, help="sequential probes broken down (%(default)s)")
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


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:8]]  # user .. softirq (steal is not ours)
    return (sum(values) - values[3] - values[4]) / CLK_TCK  # minus idle and iowait


def median(values: list[float]) -> float:
    return statistics.median(values)


# --------------------------------------------------------------------------- the fleet

def profile_gpus(profile_path: str) -> tuple[str, int]:
    """(nvidia-smi name, count) declared by a sim profile."""
    lines = json.loads(Path(profile_path).read_text())["nvidia_smi"]
    return lines[0].split(",")[2].strip(), len(lines)


def fleet_up(n: int, base: Path) -> list[dict]:
    from provisioning.sim import nodes as sim

    # One after the other: node_up picks a free port and clears its folder, not safe to run in threads.
    return [sim.node_up(PROFILES[i % len(PROFILES)], base) for i in range(n)]


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


def fleet_warm_up(nodes: list) -> dict[int, str]:
    """Upload the agent to every node through the platform's session; return {node id: absolute agent path}."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    from provisioning.services.nodes import node_session

    def upload(node) -> tuple[int, str]:
        try:
            with node_session(node) as session:
                return node.pk, session.ensure_agent()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=16) as pool:
        return dict(pool.map(upload, nodes))


def platform_round(nodes: list, parallelism: int) -> dict:
    from provisioning.services.maintenance import nodes_probe

    with Meter() as m:
        results = nodes_probe(nodes, parallelism=parallelism)
    failed = [r for r in results if not r.ok]
    return {"wall": m.wall, "per_node": [r.seconds for r in results], "failed": failed, "meter": m}


def single_node_alone(nodes: list, passes: int) -> list[float]:
    """Each node probed on its own, one after the other, `passes` times; per node the fastest of its passes
    (its own latency, without the noise of whatever else the machine was doing at that instant)."""
    from provisioning.services.nodes import node_health_probe

    best = [float("inf")] * len(nodes)
    for _ in range(passes):
        for i, node in enumerate(nodes):
            result = node_health_probe(node)
            if not result.ok:
                raise RuntimeError(f"node {node.pk} failed a single probe: {result.error}")
            best[i] = min(best[i], result.seconds)
    return best


def probe_breakdown(nodes: list, k: int) -> dict:
    """One probe split into its steps, on k nodes one at a time, and its CPU cost."""
    steps = ("slot + key", "connect (TCP, kex, auth)", "agent check (SFTP stat)", "health exec", "close")
    timed: dict[str, list[float]] = {s: [] for s in steps}
    meter = Meter()
    for node in [nodes[i % len(nodes)] for i in range(k)]:
        with meter.adding():
            for name, dt in zip(steps, _probe_steps(node), strict=True):
                timed[name].append(dt)
    return {"steps": timed, "meter": meter, "k": k}


def _probe_steps(node) -> list[float]:
    from provisioning.concurrency import node_slot
    from provisioning.services.nodes import node_endpoint
    from provisioning.ssh import NodeSession, Timeouts

    t = [time.perf_counter()]
    with node_slot(node.pk):  # what node_health_probe does, step by step
        session = NodeSession(node_endpoint(node), Timeouts(connect=5, command=20, attempts=1))
        t.append(time.perf_counter())
        session.connect()
        t.append(time.perf_counter())
        session.ensure_agent()
        t.append(time.perf_counter())
        answer = session.agent("health")
        t.append(time.perf_counter())
        session.close()
        t.append(time.perf_counter())
    assert answer["ok"]
    return [b - a for a, b in zip(t, t[1:], strict=False)]


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


def ansible_round(binary: str, setup: dict, work: Path, variant: str, forks: int, run_no: int) -> dict:
    from provisioning.agent import gpumarket_agent as agent

    control_dir = work / f"cp-{variant}-{run_no}"  # fresh per run: no connection survives from a previous run
    control_dir.mkdir()
    env = dict(os.environ)
    env.update({
        "ANSIBLE_CONFIG": str(setup["config"]),
        "ANSIBLE_HOME": str(setup["home"]),
        "ANSIBLE_LOCAL_TEMP": str(work / "ansible-local"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control_dir),
        "ANSIBLE_PIPELINING": "True" if variant == "pipelining" else "False",
        "ANSIBLE_TIMEOUT": "30",
        "ANSIBLE_NOCOLOR": "True",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
    })
    argv = [binary, "all", "-i", str(setup["inventory"]), "-m", "ansible.builtin.command",
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
        # -o: "host | CHANGED | rc=0 | (stdout) {...}", or "host | FAILED ..." / "host | UNREACHABLE! ..."
        host, _, rest = line.partition(" | ")
        status, _, detail = rest.partition(" | ")
        stdout = detail.partition("(stdout) ")[2]
        try:
            answer_ok = status == "CHANGED" and detail.startswith("rc=0 ") and json.loads(stdout).get("ok") is True
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
    variants = [v for v in args.ansible_variants.split(",") if v and v != "none"]
    binary = ansible_binary() if variants else ""  # before anything is created that would need cleaning up
    work = Path(tempfile.gettempdir()) / f"gpumarket-fleet-{os.getpid()}-{secrets.token_hex(4)}"
    work.mkdir(mode=0o700)
    base = work / "simnodes"  # a plain path: sshd_config has no quoting
    server = point_django_at_bench_db(args.db_name)
    from provisioning.sim import nodes as sim  # no Django needed: also what the cleanup uses

    try:
        django.setup()
        from django.core.management import call_command
        from django.db import connection

        from provisioning.services import maintenance

        logging.getLogger("paramiko").setLevel(logging.WARNING)  # one INFO line per connection otherwise
        parallelism = args.parallelism or maintenance.HEALTH_PARALLELISM
        t = time.perf_counter()
        call_command("migrate", verbosity=0, interactive=False)
        with connection.cursor() as c:
            c.execute("SELECT version()")
            pg_version = c.fetchone()[0].split(",")[0]
        print(f"database {args.db_name} created and migrated in {time.perf_counter() - t:.1f} s")

        t = time.perf_counter()
        infos = fleet_up(args.nodes, base)
        print(f"{len(infos)} simulated nodes up in {time.perf_counter() - t:.1f} s "
              f"({profile_mix(infos)})")
        t = time.perf_counter()
        nodes = fleet_register(infos, base)
        by_port = {i["ssh_port"]: i for i in infos}
        node_infos = {n.pk: by_port[n.ssh_port] for n in nodes}
        Meter.node_pids = [i["pid"] for i in infos if i["pid"]]
        print(f"registered (node_register, per-node ed25519 keys, pinned host keys) in "
              f"{time.perf_counter() - t:.1f} s")

        t = time.perf_counter()
        agent_paths = fleet_warm_up(nodes)
        warm = maintenance.nodes_probe(nodes, parallelism=parallelism)
        if not all(r.ok for r in warm):
            raise RuntimeError(f"warm-up probe failed: {[r.error for r in warm if not r.ok][:3]}")
        print(f"warm-up: agent uploaded once to each node, one untimed fleet probe; {time.perf_counter() - t:.1f} s")

        ansible = ansible_setup(work, nodes, node_infos, agent_paths) if variants else None
        version = ansible_version(binary) if variants else ""

        print(f"machine: {os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}, "
              f"{pg_version}, {ssh_version()}, paramiko {paramiko_version()}"
              + (f", {version}" if version else ""))
        print(f"1-minute load average before measuring: {os.getloadavg()[0]:.2f}\n")

        t = time.perf_counter()
        alone = single_node_alone(nodes, args.alone_passes)
        print(f"each node probed alone ({args.alone_passes} passes, fastest of each node's): median "
              f"{fmt_s(median(alone))}, slowest node {fmt_s(max(alone))} ({time.perf_counter() - t:.1f} s)")
        breakdown = probe_breakdown(nodes, args.breakdown)

        platform_runs: list[dict] = []
        ansible_runs: dict[str, list[dict]] = {v: [] for v in variants}
        for i in range(max(args.runs, args.ansible_runs if variants else 0)):
            if i < args.runs:
                r = platform_round(nodes, parallelism)
                platform_runs.append(r)
                print(f"  platform run {i + 1}: {fmt_s(r['wall'])}, slowest node in run {fmt_s(max(r['per_node']))}, "
                      f"{len(r['failed'])} failed; {cpu_line(r['meter'])}")
                if r["failed"]:
                    print("    e.g. " + "; ".join(f.error for f in r["failed"][:3]))
            if i < args.ansible_runs:
                for variant in variants:
                    a = ansible_round(binary, ansible, work, variant, args.nodes, i)
                    ansible_runs[variant].append(a)
                    print(f"  ansible ({variant}) run {i + 1}: {fmt_s(a['wall'])}, {a['ok']}/{len(nodes)} ok; "
                          f"{cpu_line(a['meter'])}")
                    if a["errors"]:
                        print("    e.g. " + "; ".join(a["errors"][:3]))

        sweep = []
        for size in [int(s) for s in args.sweep.split(",") if s.strip()]:
            sweep.append((size, platform_round(nodes, size)))

        report(args, parallelism, alone, breakdown, platform_runs, ansible_runs, sweep)
    finally:
        t = time.perf_counter()
        try:
            stopped = sim.nodes_down(base)
        finally:
            drop_bench_db(server, args.db_name)
            if args.keep_dir:
                print(f"\nkept {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
        print(f"\ncleanup: {stopped} nodes stopped, database {args.db_name} dropped in "
              f"{time.perf_counter() - t:.1f} s; total {time.perf_counter() - started:.1f} s")


def profile_mix(infos: list[dict]) -> str:
    return ", ".join(f"{sum(i['profile'] == p for i in infos)} {p}" for p in PROFILES)


def ssh_version() -> str:
    proc = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=10)
    return (proc.stderr or proc.stdout).split(",")[0].strip()


def paramiko_version() -> str:
    import paramiko

    return paramiko.__version__


def report(args, parallelism: int, alone: list[float], breakdown: dict, platform_runs: list[dict],
           ansible_runs: dict[str, list[dict]], sweep: list[tuple[int, dict]]) -> None:
    n = args.nodes
    ncpu = os.cpu_count() or 1
    walls = [r["wall"] for r in platform_runs]
    p_med = median(walls)
    in_run_slowest = median([max(r["per_node"]) for r in platform_runs])
    slowest_alone = max(alone)
    failed = sum(len(r["failed"]) for r in platform_runs)
    p_cpu = median([r["meter"].cpu_ours for r in platform_runs])
    floor = p_cpu / ncpu  # the wall time if the run had every CPU to itself and used them all

    print(f"\n=== {n} simulated nodes on {ncpu} CPUs; platform pool {parallelism} threads; "
          f"platform runs: {len(platform_runs)}, runs per Ansible variant: {args.ansible_runs} ===\n")
    rows = [
        ("platform nodes_probe: wall, median (min - max)",
         f"{fmt_s(p_med)}  ({fmt_s(min(walls))} - {fmt_s(max(walls))}), {failed} of "
         f"{n * len(platform_runs)} probes failed"),
        ("slowest single node, probed alone (median node)", f"{fmt_s(slowest_alone)}  ({fmt_s(median(alone))})"),
        ("slowest node within a fleet run (median of runs)", fmt_s(in_run_slowest)),
        ("ratio platform / slowest node alone", f"{p_med / slowest_alone:.1f}x"),
        ("ratio platform / slowest node in the same run", f"{p_med / in_run_slowest:.2f}x"),
        ("platform CPU per run, client + nodes (median)",
         f"{p_cpu:.1f} CPU-s -> floor on {ncpu} CPUs {fmt_s(floor)}; wall = {p_med / floor:.2f}x floor"),
    ]
    for variant, runs in ansible_runs.items():
        a_walls = [a["wall"] for a in runs]
        a_med = median(a_walls)
        ok = sum(a["ok"] for a in runs)
        a_cpu = median([a["meter"].cpu_ours for a in runs])
        rows += [
            (f"ansible ({variant}): wall, median (min - max)",
             f"{fmt_s(a_med)}  ({fmt_s(min(a_walls))} - {fmt_s(max(a_walls))}), {ok} of {n * len(runs)} hosts ok"),
            (f"  ratio ansible ({variant}) / platform", f"{a_med / p_med:.1f}x"),
            (f"  ansible ({variant}) CPU per run, client + nodes",
             f"{a_cpu:.1f} CPU-s ({a_cpu / p_cpu:.1f}x platform)"),
        ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")

    k = breakdown["k"]
    print(f"\none probe, step by step (median of {k} probes, one node at a time):")
    steps = breakdown["steps"]
    for name, values in steps.items():
        print(f"  {name:<26} {median(values) * 1000:5.1f} ms")
    print(f"  {'total':<26} {sum(median(v) for v in steps.values()) * 1000:5.1f} ms")
    bm = breakdown["meter"]
    print(f"  CPU per probe: client {bm.cpu_client / k * 1000:.0f} ms, node (sshd + agent) "
          f"{bm.cpu_nodes / k * 1000:.0f} ms")

    if sweep:
        print("\nnodes_probe by thread-pool size (one run each):")
        for size, r in sweep:
            print(f"  {size:>4} threads: {fmt_s(r['wall'])}, {len(r['failed'])} failed; {cpu_line(r['meter'])}")

    print()
    if ansible_runs:
        best = min(median([a["wall"] for a in runs]) for runs in ansible_runs.values())
        print(f"target faster than Ansible: platform {fmt_s(p_med)} vs fastest Ansible variant {fmt_s(best)} -> "
              f"{'met' if p_med < best else 'NOT met'}")
    ratio = p_med / slowest_alone
    print(f"target within {TARGET_VS_SLOWEST:g}x the slowest node (probed alone): {ratio:.2f}x -> "
          f"{'met' if ratio <= TARGET_VS_SLOWEST else 'NOT met'}")
    if ratio > TARGET_VS_SLOWEST:
        print(f"  the {n} nodes share {ncpu} CPUs with the platform here: the run's own CPU alone is "
              f"{floor / slowest_alone:.1f}x the slowest node")
    print(f"  (against the slowest node within the same run: {p_med / in_run_slowest:.2f}x)")
    print("note: the agent was uploaded to each node once before measuring (the platform re-uploads only when its "
          "hash changes); Ansible copies its module to every host on every run, as it always does")


if __name__ == "__main__":
    main()
