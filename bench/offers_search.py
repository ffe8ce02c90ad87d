#!/usr/bin/env python3
"""Benchmark of the public offers search, `GET /api/v1/offers/`, on PostgreSQL.

Not a timed test: it prints figures for docs/BENCHMARKS.md. What it does:

1. creates a database of its own (`gpumarket_bench` by default; never the test or dev
   database), points Django at it and runs the migrations;
2. seeds 10,000 nodes with 60,000 GPUs over every model of the catalogue and 50 countries
   with COPY (a realistic mix of states, prices, scores and rented GPUs), then VACUUM ANALYZE;
3. for a mix of filter/order combinations, times the endpoint end to end in-process through
   Django's test client (middleware, view, filters, pagination, serializer, JSON) and, in the
   same loop, the bare SQL that request ran (its COUNT and page queries, captured with
   CaptureQueriesContext and executed as they are on a raw cursor);
4. prints p50/p95 of both, their ratio, and EXPLAIN ANALYZE of the slowest query;
5. drops the database unless --keep.

With --http (issue 14) step 3 goes through gunicorn instead: scripts/run-web with one worker, served from this
tree and, with --before REV, also from that git revision (extracted with `git archive`) on the same database;
each round times a request to each server over HTTP and each tree's own SQL strings (captured in a subprocess
run in that tree) on one psycopg connection, in a rotating order. Goal: p95 <= 2x the bare SQL for every
combination, and p95 <= 50 ms.

Run: DJANGO_SETTINGS_MODULE=config.settings.test .venv/bin/python bench/offers_search.py  (or `make bench`)
     ... bench/offers_search.py --http --before HEAD~1
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")

import django  # noqa: E402
import psycopg  # noqa: E402
from django.conf import settings  # noqa: E402

N_NODES = 10_000
N_GPUS = 60_000
N_PROVIDERS = 400
HISTORY_PER_NODE = 10  # destroyed or failed instances per node, on average
DUMMY_PRIVATE_KEY = b"bench-dummy-encrypted-key: not a Fernet token, never decrypted"

# 50 countries, weighted roughly like a real GPU fleet, with a few cities each.
COUNTRIES: list[tuple[str, int, list[str]]] = [
    ("US", 30, ["Ashburn", "Dallas", "San Jose", "Chicago", "Seattle"]),
    ("DE", 12, ["Frankfurt", "Berlin", "Nuremberg"]),
    ("NL", 8, ["Amsterdam", "Rotterdam"]),
    ("GB", 7, ["London", "Manchester"]),
    ("FR", 6, ["Paris", "Marseille"]),
    ("CA", 6, ["Montreal", "Toronto"]),
    ("SE", 4, ["Stockholm"]),
    ("FI", 4, ["Helsinki"]),
    ("NO", 3, ["Oslo"]),
    ("IS", 2, ["Reykjavik"]),
    ("JP", 5, ["Tokyo", "Osaka"]),
    ("SG", 5, ["Singapore"]),
    ("KR", 3, ["Seoul"]),
    ("TW", 3, ["Taipei"]),
    ("HK", 2, ["Hong Kong"]),
    ("AU", 3, ["Sydney", "Melbourne"]),
    ("IN", 3, ["Mumbai", "Chennai"]),
    ("BR", 2, ["Sao Paulo"]),
    ("PL", 3, ["Warsaw"]),
    ("CZ", 2, ["Prague"]),
    ("ES", 2, ["Madrid"]),
    ("IT", 2, ["Milan"]),
    ("CH", 2, ["Zurich"]),
    ("AT", 1, ["Vienna"]),
    ("BE", 1, ["Brussels"]),
    ("DK", 1, ["Copenhagen"]),
    ("IE", 2, ["Dublin"]),
    ("PT", 1, ["Lisbon"]),
    ("RO", 1, ["Bucharest"]),
    ("BG", 1, ["Sofia"]),
    ("HU", 1, ["Budapest"]),
    ("LT", 1, ["Vilnius"]),
    ("LV", 1, ["Riga"]),
    ("EE", 1, ["Tallinn"]),
    ("UA", 1, ["Kyiv"]),
    ("TR", 1, ["Istanbul"]),
    ("IL", 1, ["Tel Aviv"]),
    ("AE", 1, ["Dubai"]),
    ("ZA", 1, ["Johannesburg"]),
    ("MX", 1, ["Queretaro"]),
    ("CL", 1, ["Santiago"]),
    ("AR", 1, ["Buenos Aires"]),
    ("CO", 1, ["Bogota"]),
    ("NZ", 1, ["Auckland"]),
    ("TH", 1, ["Bangkok"]),
    ("VN", 1, ["Hanoi"]),
    ("MY", 1, ["Kuala Lumpur"]),
    ("ID", 1, ["Jakarta"]),
    ("PH", 1, ["Manila"]),
    ("KE", 1, ["Nairobi"]),
]

# The filter/order mix, as a renter (or a price scraper) would send it.
COMBINATIONS: list[tuple[str, str]] = [
    ("no filter (default -score_per_dollar)", ""),
    ("gpu_model", "gpu_model=rtx-4090"),
    ("gpu_model + min_gpus", "gpu_model=a100-80gb-sxm&min_gpus=4"),
    ("2 gpu_models + ordering=price", "gpu_model=h100-sxm&gpu_model=h100-pcie&ordering=price_per_gpu_hour"),
    ("max_price + ordering=price", "max_price_per_gpu_hour=0.50&ordering=price_per_gpu_hour"),
    ("country + min_reliability", "country=US&min_reliability=0.95"),
    ("country + city", "country=DE&city=frankfurt"),
    ("min_gpu_memory_gb + ordering=-score_per_dollar", "min_gpu_memory_gb=48&ordering=-score_per_dollar"),
    ("min_score + ordering=-score", "min_score=1.5&ordering=-score"),
    ("min_gpus=8 + ordering=-reliability", "min_gpus=8&ordering=-reliability"),
    ("page=5", "page=5"),
    ("page_size=200 + ordering=-price", "page_size=200&ordering=-price_per_gpu_hour"),
    ("memory + price + reliability + order", "min_gpu_memory_gb=80&max_price_per_gpu_hour=2.50"
                                             "&min_reliability=0.9&ordering=score_per_dollar"),
    # The disk room left (reported free less promised since): computed per node it filters or orders.
    ("min_disk_free_gb", "min_disk_free_gb=1000"),
    ("gpu_model + ordering=-disk_free_gb", "gpu_model=rtx-4090&ordering=-disk_free_gb"),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db-name", default="gpumarket_bench", help="database to create (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    p.add_argument("--reuse", action="store_true",
                   help="reuse a database kept by --keep: migrate it, do not re-create or re-seed it")
    p.add_argument("--requests", type=int, default=100, help="timed requests per combination (%(default)s)")
    p.add_argument("--warmup", type=int, default=10, help="untimed requests per combination (%(default)s)")
    p.add_argument("--seed", type=int, default=20240601, help="random seed of the data (%(default)s)")
    p.add_argument("--no-explain", action="store_true", help="skip EXPLAIN ANALYZE of the slowest query")
    p.add_argument("--http", action="store_true",
                   help="time requests to gunicorn (scripts/run-web, one worker) over HTTP instead of in-process")
    p.add_argument("--differ", metavar="FIELD", action="append", default=[],
                   help="an offer field the change meant to change: left out of the two trees' comparison, and a "
                        "combination whose query names it is not compared (repeatable)")
    p.add_argument("--before", metavar="REV",
                   help="with --http: also serve this git revision (git archive) and time it in the same rounds")
    return p.parse_args()


# --------------------------------------------------------------------------- database

def point_django_at_bench_db(args: argparse.Namespace) -> dict:
    """Create the bench database on the configured PostgreSQL server; point settings at it."""
    db = settings.DATABASES["default"]  # loads the settings module; Django is not set up yet
    if db["ENGINE"] != "django.db.backends.postgresql":
        sys.exit(f"bench: needs PostgreSQL (DATABASE_URL); the settings give {db['ENGINE']}")
    if args.db_name == db["NAME"]:
        sys.exit(f"bench: refusing to use the configured database {db['NAME']!r}; pick another --db-name")
    server = {"host": db.get("HOST") or "127.0.0.1", "port": db.get("PORT") or 5432,
              "user": db.get("USER") or "postgres", "password": db.get("PASSWORD") or None}
    if not args.reuse:
        with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{args.db_name}" WITH (FORCE)')
            admin.execute(f'CREATE DATABASE "{args.db_name}"')
    db["NAME"] = args.db_name
    db["TEST"] = {"NAME": args.db_name}
    return server


def drop_bench_db(server: dict, name: str) -> None:
    from django.db import connections

    connections.close_all()
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --------------------------------------------------------------------------- seeding

def gpu_counts(rng: random.Random) -> list[int]:
    """N_NODES counts in 1..8 summing to exactly N_GPUS (mean 6: mostly 8-GPU servers)."""
    counts = rng.choices([1, 2, 3, 4, 5, 6, 7, 8], weights=[8, 8, 2, 14, 1, 3, 1, 63], k=N_NODES)
    diff = N_GPUS - sum(counts)
    while diff:
        i = rng.randrange(N_NODES)
        if diff > 0 and counts[i] < 8:
            counts[i] += 1
            diff -= 1
        elif diff < 0 and counts[i] > 1:
            counts[i] -= 1
            diff += 1
    return counts


def node_state(rng: random.Random) -> tuple[str, str, bool]:
    """(state, verdict, listed): ~75 % bookable, the rest in every other situation."""
    r = rng.random()
    if r < 0.70:
        return "active", "verified", True
    if r < 0.78:
        return "active", "degraded", True
    if r < 0.82:
        return "active", "verified", False  # unlisted by its provider
    if r < 0.86:
        return "pending", "unverified", True
    if r < 0.88:
        return "verifying", "unverified", True
    if r < 0.91:
        return "maintenance", "verified", True
    if r < 0.95:
        return "offline", "verified", True
    if r < 0.98:
        return "rejected", "rejected", True
    return "retired", "verified", False


def copy_in(model, objs) -> None:
    """COPY model instances into their table: every concrete column, prepared as Django would for an INSERT.

    Built from the model's fields, so the bench keeps working when other fields (with defaults) are added.
    """
    from django.db import connection

    fields = list(model._meta.concrete_fields)
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    with connection.cursor() as c:
        # c.cursor is psycopg's own cursor, which speaks COPY.
        with c.cursor.copy(f"COPY {connection.ops.quote_name(model._meta.db_table)} ({columns}) FROM STDIN") as copy:
            for obj in objs:
                copy.write_row([f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields])
        c.execute(f"SELECT setval(pg_get_serial_sequence(%s, 'id'), max(id)) FROM {model._meta.db_table}",
                  [model._meta.db_table])


def inventory(rng: random.Random, model, n: int, node_id: int) -> dict:
    """What the node agent's `inventory` answers, as stored on a verified node (about 1-2 kB)."""
    driver = rng.choice(("535.183.01", "550.90.07", "560.35.03"))
    return {
        "runtime": "docker", "hostname": f"gpu-{node_id}", "gpu_count": n, "driver_version": driver,
        "cuda_version": "12.4",
        "gpus": [{"index": g, "name": model.smi_name, "uuid": f"GPU-{node_id:08x}-{g:04x}-bench",
                  "memory_mib": model.memory_mib, "driver_version": driver,
                  "pci_bus_id": f"00000000:{0x17 + g:02X}:00.0", "temperature_c": rng.randint(30, 70)}
                 for g in range(n)],
        "cpu": {"model": "AMD EPYC 7543 32-Core Processor", "cores": 64}, "ram_mib": 515_000,
        "disk_free_gb": rng.randint(200, 3000),
        "os": {"name": "Ubuntu 22.04.4 LTS", "kernel": "5.15.0-105-generic", "arch": "x86_64"},
    }


def seed(rng: random.Random) -> None:
    from django.db import connection
    from django.utils import timezone

    from marketplace.models import Gpu, GpuModel, Node, User

    models = list(GpuModel.objects.order_by("id"))
    reference = next((m for m in models if m.slug == "a100-80gb-sxm"), models[0])
    # List price per GPU-hour roughly tracking dense BF16 throughput, with a floor for small cards.
    base_price = {m.id: max(0.12, 0.0062 * m.bf16_tflops + 0.05) for m in models}
    base_score = {m.id: m.bf16_tflops / reference.bf16_tflops for m in models}
    # Popular cards are more common than exotic ones.
    model_weights = [{"rtx-4090": 14, "rtx-3090": 10, "rtx-a4000": 8, "rtx-a5000": 7, "rtx-a6000": 8,
                      "a100-80gb-sxm": 9, "a100-80gb-pcie": 6, "h100-sxm": 9, "h100-pcie": 5}.get(m.slug, 4)
                     for m in models]
    country_weights = [w for _, w, _ in COUNTRIES]
    has_inventory = any(f.name == "inventory" for f in Node._meta.concrete_fields)
    now = timezone.now()

    providers = [User(email=f"provider{i}@bench.example") for i in range(N_PROVIDERS)]
    for user in providers:
        user.set_unusable_password()
        if hasattr(user, "email_canonical"):  # unique since 032c32d; save() sets it, bulk_create does not
            user.email_canonical = user.email
    User.objects.bulk_create(providers, batch_size=1000)
    provider_ids = list(User.objects.values_list("id", flat=True))

    counts = gpu_counts(rng)
    nodes, gpus = [], []
    for i in range(N_NODES):
        node_id = i + 1
        m = rng.choices(models, weights=model_weights)[0]
        code, _, cities = rng.choices(COUNTRIES, weights=country_weights)[0]
        city = rng.choice(cities)
        state, verdict, listed = node_state(rng)
        n = counts[i]
        price = base_price[m.id] * rng.uniform(0.65, 1.45)
        score = base_score[m.id] * rng.uniform(0.9, 1.03) * (rng.uniform(0.6, 0.85) if verdict == "degraded" else 1)
        checked = verdict != "unverified"
        created = now - timedelta(days=rng.uniform(1, 720))
        node = Node(
            id=node_id, provider_id=rng.choice(provider_ids), name=f"{m.slug}-{code.lower()}-{node_id}",
            address=f"10.{node_id // 65536}.{node_id // 256 % 256}.{node_id % 256}", ssh_port=22, ssh_user="ubuntu",
            host_key_fingerprint=f"SHA256:bench{node_id:038d}", country=code, city=city,
            datacenter=f"{code}-{city[:3].upper()}{rng.randint(1, 3)}", gpu_model_id=m.id, gpu_count=n,
            price_per_gpu_hour_micros=round(price * 1_000_000), runtime=rng.choice(("docker", "docker", "libvirt")),
            state=state, state_changed_at=created, verdict=verdict, listed=listed,
            score=round(score, 4) if checked else 0.0,
            reliability=round(min(1.0, rng.betavariate(12, 0.6)), 4) if checked else 0.0,
            ssh_public_key=f"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBENCH{node_id:016d} gpumarket-node-{node_id}",
            ssh_private_key_encrypted=DUMMY_PRIVATE_KEY, created_at=created,
        )
        if checked:  # the host facts of its last check: the disk room's base (marketplace/services/disk_room.py)
            node.disk_free_gb = rng.randint(200, 3000)
            node.disk_total_gb = node.disk_free_gb + rng.randint(100, 2000)  # the disk's size (the room's bound)
            node.host_checked_at = now - timedelta(days=rng.uniform(0, 7))
        if has_inventory and checked:
            node.inventory = inventory(rng, m, n, node_id)
        nodes.append(node)
        # Rentals: a third of the servers fully booked, a third partly, a third idle; a few broken cards.
        r = rng.random()
        rented = n if r < 0.33 else rng.randint(0, n - 1) if r < 0.66 else 0
        for g in range(n):
            status = "rented" if g < rented else ("unavailable" if rng.random() < 0.02 else "free")
            gpus.append(Gpu(id=len(gpus) + 1, node_id=node_id, index=g, uuid=f"GPU-{node_id:08x}-{g:04x}-bench",
                            gpu_model_id=m.id, memory_mib=m.memory_mib, pci_bus_id=f"00000000:{0x17 + g:02X}:00.0",
                            status=status))
    copy_in(Node, nodes)
    copy_in(Gpu, gpus)
    seed_disks(rng, nodes, gpus, provider_ids, now)
    with connection.cursor() as c:
        # VACUUM sets the visibility map (what autovacuum does to a settled table), so index-only scans
        # are measured as they run in production rather than on freshly loaded pages; ANALYZE: statistics.
        c.execute("VACUUM ANALYZE")


def seed_disks(rng: random.Random, nodes: list, gpus: list, renter_ids: list[int], now) -> None:
    """What the offers' room left reads (disk_room.disk_left_gb): a live instance per node with rented GPUs, its
    disk booked before or after the node's last check; a history of HISTORY_PER_NODE destroyed or failed (never
    started) instances per node on average (the rows the live sum skips through its partial index, and the sum of
    those over but holding their disk, selectors.over_but_holding_its_disk, reads and leaves out); a volume on one
    checked node in six."""
    from marketplace.models import Instance, Volume

    rented = {g.node_id for g in gpus if g.status == "rented"}
    instances, volumes = [], []

    def instance(node, status: str, created) -> None:
        instances.append(Instance(
            id=len(instances) + 1, renter_id=rng.choice(renter_ids), node_id=node.id, gpu_model_id=node.gpu_model_id,
            num_gpus=1, image_ref="bench/cuda:12.4", disk_gb=rng.choice((20, 50, 100, 200, 400)), status=status,
            price_per_gpu_hour_micros=node.price_per_gpu_hour_micros,
            price_per_hour_micros=node.price_per_gpu_hour_micros, created_at=created))

    for node in nodes:
        for _ in range(rng.randint(0, 2 * HISTORY_PER_NODE)):
            instance(node, rng.choice(("destroyed", "destroyed", "failed")),
                     now - timedelta(days=rng.uniform(10, 700)))
        if node.id in rented:
            instance(node, "running", now - timedelta(days=rng.uniform(0, 10)))
        if node.host_checked_at is not None and rng.random() < 1 / 6:
            volumes.append(Volume(id=len(volumes) + 1, owner_id=rng.choice(renter_ids), node_id=node.id,
                                  name=f"bench-volume-{len(volumes) + 1}", size_gb=rng.choice((50, 200, 1000)),
                                  state="available", price_per_gb_month_micros=100_000,
                                  created_at=now - timedelta(days=rng.uniform(0, 10))))
    copy_in(Instance, instances)
    copy_in(Volume, volumes)


def row_counts() -> list[tuple[str, object]]:
    from django.db.models import Count, Q

    from marketplace.models import Gpu, GpuModel, Instance, Node, Volume
    from marketplace.selectors import offers_search

    gpus = Gpu.objects.aggregate(
        free=Count("id", filter=Q(status="free")),
        rented=Count("id", filter=Q(status="rented")),
        unavailable=Count("id", filter=Q(status="unavailable")),
    )
    return [
        ("nodes", Node.objects.count()),
        ("GPUs", Gpu.objects.count()),
        ("GPU models in the catalogue / used by nodes",
         f"{GpuModel.objects.count()} / {Node.objects.values('gpu_model').distinct().count()}"),
        ("countries", Node.objects.values("country").distinct().count()),
        ("providers", Node.objects.values("provider").distinct().count()),
        ("nodes active + verified/degraded + listed",
         Node.objects.filter(state="active", verdict__in=("verified", "degraded"), listed=True).count()),
        ("GPUs free / rented / unavailable", f"{gpus['free']} / {gpus['rented']} / {gpus['unavailable']}"),
        ("instances live / destroyed or failed",
         f"{Instance.objects.exclude(status__in=('destroyed', 'failed')).count()} / "
         f"{Instance.objects.filter(status__in=('destroyed', 'failed')).count()}"),
        ("volumes", Volume.objects.count()),
        ("offers (bookable nodes with a free GPU)", offers_search().count()),
    ]


# --------------------------------------------------------------------------- measuring

def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def measure(args: argparse.Namespace) -> tuple[list[dict], dict[str, list[float]]]:
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client()
    results = []
    per_query: dict[str, list[float]] = {}
    for label, query in COMBINATIONS:
        url = "/api/v1/offers/" + (f"?{query}" if query else "")
        for _ in range(args.warmup):
            response = client.get(url)
            assert response.status_code == 200, (url, response.status_code, response.content[:500])
        with CaptureQueriesContext(connection) as captured:
            response = client.get(url)
        body = response.json()
        sqls = [q["sql"] for q in captured.captured_queries]
        connection.ensure_connection()
        raw = connection.connection  # the psycopg connection Django holds: same session, same settings
        endpoint, bare = [], []
        for _ in range(args.requests):  # interleaved, so drift hits both sides alike
            t0 = time.perf_counter()
            response = client.get(url)
            t1 = time.perf_counter()
            assert response.status_code == 200
            with raw.cursor() as cur:
                t_total = 0.0
                for sql in sqls:
                    q0 = time.perf_counter()
                    cur.execute(sql)
                    cur.fetchall()
                    dt = time.perf_counter() - q0
                    t_total += dt
                    per_query.setdefault(sql, []).append(dt)
            endpoint.append(t1 - t0)
            bare.append(t_total)
        results.append({
            "label": label, "query": query, "count": body["count"], "rows": len(body["results"]),
            "n_queries": len(sqls), "endpoint": endpoint, "bare": bare,
        })
    return results, per_query

# --------------------------------------------------------------------------- through gunicorn (--http)

# Run in a tree's own directory (so with that tree's code): the SQL strings each combination's request runs.
CAPTURE_SQL = """
import json, sys
import django
django.setup()
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
client, out = Client(), {}
for url in json.loads(sys.argv[1]):
    client.get(url)  # caches, the slug lookups' first run
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    out[url] = [q["sql"] for q in captured.captured_queries]
print(json.dumps(out))
"""


def tree_env(server: dict, db_name: str) -> dict[str, str]:
    user = server["user"] + (f":{server['password']}" if server["password"] else "")
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test", "DEBUG": "false",
            "DATABASE_URL": f"postgres://{user}@{server['host']}:{server['port']}/{db_name}",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def extract_revision(rev: str, into: Path) -> Path:
    tree = into / "before"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def capture_sql(tree: Path, env: dict[str, str], urls: list[str]) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", CAPTURE_SQL, json.dumps(urls)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench: capturing the SQL in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Gunicorn:
    """scripts/run-web of a tree, one sync worker, on a free port; stopped (its process group) on exit."""

    def __init__(self, tree: Path, env: dict[str, str], log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["bash", str(tree / "scripts" / "run-web")], cwd=tree, stdout=out, stderr=subprocess.STDOUT,
                env={**env, "BIND_ADDRESS": "127.0.0.1", "PORT": str(self.port), "WEB_CONCURRENCY": "1"},
                start_new_session=True)
        deadline = time.monotonic() + 60
        while b"Booting worker" not in log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"bench: gunicorn did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)

    def get(self, target: str) -> bytes:
        """One request on a new connection (gunicorn's sync worker closes each one), body read to the end."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", target, headers={"Host": "localhost"})  # the same links from both servers
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status != 200:
            sys.exit(f"bench: {target} answered {response.status}: {body[:500]!r}")
        return body

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)


def measure_http(args: argparse.Namespace, server: dict) -> tuple[list[dict], dict[str, list[float]]]:
    """Rounds of: each tree's request through its gunicorn, each tree's bare SQL; the order rotates by round."""
    urls = ["/api/v1/offers/" + (f"?{query}" if query else "") for _, query in COMBINATIONS]
    env = tree_env(server, args.db_name)
    work = Path(tempfile.mkdtemp(prefix="offers-bench-"))
    servers: dict[str, Gunicorn] = {}
    try:
        return _measure_http(args, urls, env, work, servers)
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)  # the extracted revision and the servers' logs


def _measure_http(args: argparse.Namespace, urls: list[str], env: dict[str, str], work: Path,
                  servers: dict[str, Gunicorn]) -> tuple[list[dict], dict[str, list[float]]]:
    from django.db import connection

    trees = {"now": ROOT}
    if args.before:
        trees = {"before": extract_revision(args.before, work), **trees}
    sqls = {name: capture_sql(tree, env, urls) for name, tree in trees.items()}
    for name, tree in trees.items():
        servers[name] = Gunicorn(tree, env, work / f"gunicorn-{name}.log")
    connection.ensure_connection()
    raw = connection.connection  # one psycopg connection for every bare SQL string
    per_query: dict[str, list[float]] = {}

    def bare(statements: list[str]) -> float:
        total = 0.0
        with raw.cursor() as cur:
            for sql in statements:
                q0 = time.perf_counter()
                cur.execute(sql)
                cur.fetchall()
                dt = time.perf_counter() - q0
                total += dt
                per_query.setdefault(sql, []).append(dt)
        return total

    results = []
    for (label, query), url in zip(COMBINATIONS, urls, strict=True):
        bodies = {}
        for name, srv in servers.items():
            for _ in range(args.warmup):
                bodies[name] = srv.get(url)
        parsed = {name: json.loads(body) for name, body in bodies.items()}
        compared = {name: _without(body, args.differ) for name, body in parsed.items()}
        if args.before and compared["before"] != compared["now"] and not any(f in query for f in args.differ):
            sys.exit(f"bench: {url}: the two trees answered different JSON: {first_difference(*compared.values())}")
        sides = [(name, kind) for name in servers for kind in ("http", "bare")]
        times: dict[tuple[str, str], list[float]] = {side: [] for side in sides}
        for i in range(args.requests):
            for name, kind in sides[i % len(sides):] + sides[:i % len(sides)]:
                if kind == "http":
                    t0 = time.perf_counter()
                    servers[name].get(url)
                    times[name, kind].append(time.perf_counter() - t0)
                else:
                    times[name, kind].append(bare(sqls[name][url]))
        body = parsed["now"]
        results.append({"label": label, "query": query, "count": body["count"], "rows": len(body["results"]),
                        "n_queries": {name: len(sqls[name][url]) for name in servers},
                        "bytes": len(bodies["now"]), "times": times})
    return results, per_query


def _without(body: dict, fields: list[str]) -> dict:
    """The answer less the offers' fields the change meant to change (--differ)."""
    return {**body, "results": [{k: v for k, v in row.items() if k not in fields} for row in body["results"]]}


def first_difference(a: dict, b: dict) -> str:
    for key in a.keys() | b.keys():
        if key != "results" and a.get(key) != b.get(key):
            return f"{key}: {a.get(key)!r} != {b.get(key)!r}"
    for i, (x, y) in enumerate(zip(a["results"], b["results"], strict=False)):
        for key in x.keys() | y.keys():
            if x.get(key) != y.get(key):
                return f"results[{i}].{key}: {x.get(key)!r} != {y.get(key)!r}"
    return f"{len(a['results'])} rows != {len(b['results'])} rows"


def report_http(results: list[dict], names: list[str]) -> bool:
    """The table per combination and tree; returns whether the goal is met by the current tree."""
    ms = 1000.0
    head = f"{'combination':<44} {'offers':>6} {'rows':>4} {'kB':>5} | " + " | ".join(
        f"{name + ' HTTP p50':>15} {'p95':>6} {'SQL p95':>7} {'ratio':>5}" for name in names) + " | goal"
    print(head)
    print("-" * len(head))
    met_all = True
    every: dict[tuple[str, str], list[float]] = {}
    for r in results:
        cells = []
        for name in names:
            h, b = r["times"][name, "http"], r["times"][name, "bare"]
            every.setdefault((name, "http"), []).extend(h)
            every.setdefault((name, "bare"), []).extend(b)
            h95, b95 = percentile(h, 95), percentile(b, 95)
            cells.append(f"{percentile(h, 50) * ms:>15.2f} {h95 * ms:>6.2f} {b95 * ms:>7.2f} {h95 / b95:>5.2f}")
        h95, b95 = percentile(r["times"]["now", "http"], 95), percentile(r["times"]["now", "bare"], 95)
        met = h95 <= 2 * b95 and h95 * ms <= 50
        met_all &= met
        print(f"{r['label']:<44} {r['count']:>6} {r['rows']:>4} {r['bytes'] / 1000:>5.1f} | " + " | ".join(cells)
              + f" | {'met' if met else 'NOT met'}")
    print("-" * len(head))
    cells = []
    for name in names:
        h, b = every[name, "http"], every[name, "bare"]
        cells.append(f"{percentile(h, 50) * ms:>15.2f} {percentile(h, 95) * ms:>6.2f} "
                     f"{percentile(b, 95) * ms:>7.2f} {percentile(h, 95) / percentile(b, 95):>5.2f}")
    print(f"{'ALL (' + str(len(every['now', 'http'])) + ' requests per tree)':<44} {'':>6} {'':>4} {'':>5} | "
          + " | ".join(cells))
    print(f"\ngoal (issue 14), for every combination: HTTP p95 <= 2x its bare SQL p95 and <= 50 ms -> "
          f"{'met' if met_all else 'NOT met'} for this tree")
    return met_all


def report(results: list[dict]) -> None:
    ms = 1000.0
    head = (f"{'combination':<44} {'offers':>6} {'rows':>4} {'q':>2} | {'endpoint p50':>12} {'p95':>7} | "
            f"{'bare SQL p50':>12} {'p95':>7} | {'ratio p50':>9} {'p95':>5}")
    print(head)
    print("-" * len(head))
    all_e, all_b = [], []
    for r in results:
        e50, e95 = percentile(r["endpoint"], 50) * ms, percentile(r["endpoint"], 95) * ms
        b50, b95 = percentile(r["bare"], 50) * ms, percentile(r["bare"], 95) * ms
        all_e += r["endpoint"]
        all_b += r["bare"]
        print(f"{r['label']:<44} {r['count']:>6} {r['rows']:>4} {r['n_queries']:>2} | {e50:>12.2f} {e95:>7.2f} | "
              f"{b50:>12.2f} {b95:>7.2f} | {e50 / b50:>9.2f} {e95 / b95:>5.2f}")
    print("-" * len(head))
    e50, e95 = percentile(all_e, 50) * ms, percentile(all_e, 95) * ms
    b50, b95 = percentile(all_b, 50) * ms, percentile(all_b, 95) * ms
    print(f"{'ALL (' + str(len(all_e)) + ' requests)':<44} {'':>6} {'':>4} {'':>2} | {e50:>12.2f} {e95:>7.2f} | "
          f"{b50:>12.2f} {b95:>7.2f} | {e50 / b50:>9.2f} {e95 / b95:>5.2f}")
    worst = max(percentile(r["endpoint"], 95) for r in results) * ms
    worst_ratio = max(percentile(r["endpoint"], 95) / percentile(r["bare"], 95) for r in results)
    print()
    print(f"target endpoint p95 <= 50 ms: overall {e95:.2f} ms, worst combination {worst:.2f} ms -> "
          f"{'met' if worst <= 50 else 'NOT met'}")
    print(f"target endpoint within 3x bare SQL: overall p95 ratio {e95 / b95:.2f}, worst combination "
          f"{worst_ratio:.2f} -> {'met' if worst_ratio <= 3 else 'NOT met'}")


def explain_slowest(per_query: dict[str, list[float]]) -> None:
    from django.db import connection

    sql, times = max(per_query.items(), key=lambda kv: percentile(kv[1], 95))
    print(f"\nslowest bare query (p95 {percentile(times, 95) * 1000:.2f} ms):\n{sql}\n")
    with connection.connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql)
        print("\n".join(row[0] for row in cur.fetchall()))


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    server = point_django_at_bench_db(args)
    django.setup()

    import platform

    from django.core.management import call_command
    from django.db import connection

    print(f"database {args.db_name} on {server['host']}:{server['port']}; "
          f"{'reused' if args.reuse else 'created'}")
    t = time.perf_counter()
    call_command("migrate", verbosity=0, interactive=False)
    print(f"migrated in {time.perf_counter() - t:.1f} s")
    try:
        if not args.reuse:
            t = time.perf_counter()
            seed(random.Random(args.seed))
            print(f"seeded (COPY) and analysed in {time.perf_counter() - t:.1f} s")
        for name, value in row_counts():
            print(f"  {name:<44} {value}")
        with connection.cursor() as c:
            c.execute("SELECT version()")
            pg_version = c.fetchone()[0].split(",")[0]
        how = ("gunicorn over HTTP (scripts/run-web, 1 sync worker" + (f"; this tree and {args.before}" if args.before
               else "") + ")") if args.http else "in-process django.test.Client"
        print(f"machine: {os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}, "
              f"{pg_version}; {how}, {args.warmup} warm-up + {args.requests} timed "
              f"requests per combination\n")
        t = time.perf_counter()
        load_before = os.getloadavg()
        if args.http:
            http_results, per_query = measure_http(args, server)
        else:
            results, per_query = measure(args)
        load_after = os.getloadavg()
        print(f"measured in {time.perf_counter() - t:.1f} s; load average (1, 5, 15 min) "
              f"{' '.join(f'{v:.2f}' for v in load_before)} before, {' '.join(f'{v:.2f}' for v in load_after)} after "
              f"on {os.cpu_count()} CPUs (the machine is shared: above ~1, other work took CPU time)\n")
        if args.http:
            report_http(http_results, ["before", "now"] if args.before else ["now"])
        else:
            report(results)
        if not args.no_explain:
            explain_slowest(per_query)
    finally:
        if args.keep:
            print(f"\nkept database {args.db_name} (drop it with: dropdb {args.db_name})")
        else:
            drop_bench_db(server, args.db_name)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
