#!/usr/bin/env python3
"""Benchmark of bookings per second: `instance_create` against bare SQL doing the same allocation.

Not a timed test: it prints figures for docs/BENCHMARKS.md. Issue 14 item 3's goal: with 32 concurrent
clients over 1,000 GPUs, the service path books at least 0.5 x as many GPUs per second as bare SQL
transactions doing the same allocation, with 0 double allocations.

1. creates a database of its own (`gpumarket_bench_booking`; never the test or dev database), migrates it,
   registers 125 listed 8-GPU sim nodes (1,000 GPUs) and one funded renter per client; the funds check is
   on (BILLING_REQUIRE_FUNDS=1), as in production;
2. starts N clients (processes by default: each a Django process with its own connection, as N sync web
   workers are; `--threads` runs them as threads of one process instead, where the GIL caps the Python
   side at one core);
3. alternates rounds of the two paths; in each round every client makes `--per-client` one-GPU bookings on
   random nodes (a 409 for a node with no free GPU left is counted and retried on another):
   - service: `marketplace.services.instances.instance_create` (funds check under the wallet lock, node
     share lock, the instance, the GPUs, the provisioning job and its hand-off to the broker). The round
     ends when the last client is done AND every job has reached the broker (`sent_at` set), so work put
     off until after the answer is counted, not hidden;
   - bare: psycopg, one transaction per booking: lock free GPUs FOR UPDATE SKIP LOCKED, insert the
     instance (the same columns and values) and its allocations, update the GPUs;
4. after each round checks by query that no GPU is in two live allocations and that a GPU is rented exactly
   when it is allocated, then resets the rows (outside the timing) and VACUUMs the tables it wrote.
5. then (`--split N`) one client in this process, N bookings of each kind in 5 interleaved blocks: the service,
   the service with its broker publish replaced by nothing, and bare SQL: where the service's CPU goes.

`--slices` books MIG slices instead of whole GPUs (issue 17): every card of the 125 nodes is split into seven
1g.10gb slices (7,000 slices), each booking takes one slice by profile. The service path is `instance_create` with
`mig_profile`; the bare path locks the node's split GPUs FOR SHARE and a free slice FOR UPDATE SKIP LOCKED, inserts
the instance and its slice allocation and marks the slice rented. The checks add the parent rule: no GPU both
allocated whole and holding an allocated slice. The goal is the same: >= 0.5 x bare, 0 double allocations.

`--history N` gives each renter N destroyed instances first (a renter who has booked and destroyed many short jobs):
what a booking reads of a renter's instances (the funds check's committed rate) must not grow with them.

`--compare-send` adds a third path to the rotation: the service handing each job to the broker in the request's
thread (JOB_SEND_IN_BACKGROUND off), to show what the sender thread is worth.

Run: DJANGO_SETTINGS_MODULE=config.settings.test .venv/bin/python bench/booking.py
The provisioning messages go to the configured broker (CELERY_BROKER_URL) and are purged at the end.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")
os.environ["BILLING_REQUIRE_FUNDS"] = "1"  # the check runs, as in production (the test settings turn it off)

import benchdb  # noqa: E402 (bench/benchdb.py, beside this script)
import django  # noqa: E402
from django.conf import settings  # noqa: E402

N_NODES = 125
GPUS_PER_NODE = 8
GOAL = 0.5
SLICES = False  # --slices: book MIG 1g.10gb slices (set in main() before the clients fork)
SLICE_PROFILE = "1g.10gb"
SLICES_PER_GPU = 7


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db-name", default="gpumarket_bench_booking", help="database to create (%(default)s)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (%(default)s)")
    p.add_argument("--per-client", type=int, default=16, help="bookings per client per round (%(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each path (%(default)s)")
    p.add_argument("--threads", action="store_true", help="clients as threads of one process, not processes")
    p.add_argument("--send", choices=("relay", "thread", "request"), default="relay",
                   help="how the service's jobs reach the broker: the job relay process (JOB_RELAY, as in production "
                        "with PostgreSQL), each client process's sender thread (JOB_SEND_IN_BACKGROUND), or in the "
                        "request's thread (%(default)s)")
    p.add_argument("--relays", type=int, default=1, help="job relay processes with --send relay (%(default)s)")
    p.add_argument("--relay-poll", type=float, default=None, metavar="S",
                   help="the relays look every S seconds (JOB_RELAY_POLL_S; default: its setting)")
    p.add_argument("--no-notify", action="store_true",
                   help="drop the job table's NOTIFY trigger in the bench database: the relays only poll")
    p.add_argument("--sync-send", action="store_true", help="the same as --send request")
    p.add_argument("--compare-send", action="store_true",
                   help="a third path in the rotation: the service handing jobs over in the request's thread")
    p.add_argument("--split", type=int, default=200, metavar="N",
                   help="then, one client in this process: N bookings of each kind, interleaved in blocks, to "
                        "split the service's CPU into its transaction and the broker publish (0: skip)")
    p.add_argument("--slices", action="store_true", help="book MIG slices (every card split into 7 x 1g.10gb)")
    p.add_argument("--history", type=int, default=0, metavar="N",
                   help="destroyed instances per renter seeded first (%(default)s)")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    return p.parse_args()


# --------------------------------------------------------------------------------------------- seeding


def seed(n_clients: int) -> list[int]:
    """1,000 GPUs on 125 listed nodes; a funded renter per client (their ids)."""
    from django.utils import timezone

    from billing.services.ledger import credit_grant
    from marketplace.models import GpuModel, Node, NodeState, User, Verdict
    from marketplace.services.nodes import node_register

    # Verified addresses: renting and listing need one (marketplace.services.email_verification).
    provider = User.objects.create(email="provider@bench.example", email_verified_at=timezone.now())
    model = GpuModel.objects.get(slug="a100-80gb-sxm")
    layout = [{"gpu": g, "profiles": [SLICE_PROFILE] * SLICES_PER_GPU} for g in range(GPUS_PER_NODE)] if SLICES else []
    prices = {SLICE_PROFILE: Decimal("0.25")} if SLICES else {}
    for i in range(N_NODES):
        node = node_register(provider=provider, name=f"bench-{i}", address=f"10.1.{i // 250}.{i % 250 + 1}",
                             ssh_port=22, ssh_user="gpu", country="DE", gpu_model=model, gpu_count=GPUS_PER_NODE,
                             price_per_gpu_hour=Decimal("1.5"), runtime="sim", city="Frankfurt",
                             mig_layout=layout, mig_prices=prices)
        # Its free disk and the disk's size reported, as a verified server's are: a booking counts what was
        # promised there since, and every disk held there against the size (marketplace/services/disk_room.py).
        Node.objects.filter(pk=node.pk).update(state=NodeState.ACTIVE, verdict=Verdict.VERIFIED, listed=True,
                                               score=1.0, reliability=0.99, disk_free_gb=100_000,
                                               disk_total_gb=120_000, host_checked_at=timezone.now())
        if SLICES:
            seed_slices(node.pk)
    renters = []
    for i in range(n_clients):
        user = User.objects.create(email=f"renter{i}@bench.example", email_verified_at=timezone.now())
        credit_grant(user=user, amount_micros=10**12, reason="bench")
        renters.append(user.pk)
    return renters


def seed_history(renters: list[int], node_id: int, per_renter: int) -> None:
    """`per_renter` destroyed instances for each renter: one booked through the service and destroyed, then copied
    in SQL; its job and allocation removed and its GPU freed (they are a booking's, not history's)."""
    from django.db import connection

    from marketplace.models import Image, Instance, User
    from marketplace.services.instances import instance_create

    columns = ", ".join(f.column for f in Instance._meta.concrete_fields if f.column != "id")
    for renter_id in renters:
        instance, _ = instance_create(renter=User.objects.get(pk=renter_id), node_id=node_id, num_gpus=1,
                                      image=Image.objects.get(slug="cuda-12-4"), ssh_public_keys=[SSH_KEY])
        with connection.cursor() as c:
            c.execute("DELETE FROM provisioning_job WHERE instance_id = %s", [instance.pk])
            c.execute("DELETE FROM marketplace_gpuallocation WHERE instance_id = %s", [instance.pk])
            c.execute("UPDATE marketplace_instance SET status = 'destroyed' WHERE id = %s", [instance.pk])
            c.execute(f"INSERT INTO marketplace_instance ({columns}) SELECT {columns} "  # noqa: S608 (model's columns)
                      f"FROM marketplace_instance, generate_series(2, %s) WHERE id = %s", [per_renter, instance.pk])
            c.execute("UPDATE marketplace_gpu SET status = 'free' WHERE node_id = %s", [node_id])


def seed_slices(node_id: int) -> None:
    """The slices a passed check would list (provisioning.services.mig), all free."""
    from django.db import transaction

    from marketplace.models import Node
    from provisioning.services.mig import node_apply_mig_slices

    slices = [{"gpu": g, "device": d, "profile": SLICE_PROFILE, "memory_mib": 9728, "proven": True,
               "uuid": f"MIG-{node_id:08x}-{g:04x}-{d:04x}-0000-000000000000"}
              for g in range(GPUS_PER_NODE) for d in range(SLICES_PER_GPU)]
    with transaction.atomic():
        node_apply_mig_slices(node=Node.objects.select_for_update().get(pk=node_id), slices=slices, listable=True)


SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGNbnK8m0mXQn5d7ZqGf0l3o8n3bqQk3f3m4b0m2b2b2 bench@example"


# ---------------------------------------------------------------------------------------- the two paths


def backend_cpu(pid: int) -> float:
    """CPU seconds (user + system) a PostgreSQL backend of this machine has used: /proc/<pid>/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServicePath:
    send = "relay"  # --send: how this path's jobs reach the broker

    def __init__(self, renter_id: int):
        from django.db import connection

        settings.JOB_RELAY = self.send == "relay"  # read by job_create
        settings.JOB_SEND_IN_BACKGROUND = self.send == "thread"  # read at each on-commit hand-off

        from marketplace.models import Image, User

        self.renter = User.objects.get(pk=renter_id)
        self.image = Image.objects.get(slug="cuda-12-4")
        with connection.cursor() as c:
            c.execute("SELECT pg_backend_pid()")
            self.backend = c.fetchone()[0]

    def book(self, node_id: int) -> bool:
        from core.errors import Conflict
        from marketplace.services.instances import instance_create

        try:
            instance_create(renter=self.renter, node_id=node_id, num_gpus=1, image=self.image,
                            ssh_public_keys=[SSH_KEY], mig_profile=SLICE_PROFILE if SLICES else "")
        except Conflict:
            return False
        return True

    def close(self) -> None:
        from django.db import connection

        connection.close()


class BarePath:
    """The same allocation in bare SQL on one psycopg connection: the floor the service is compared with."""

    def __init__(self, renter_id: int):
        import psycopg
        from django.db import connection
        from django.utils import timezone

        from billing.pricing import platform_fee_bps
        from marketplace.models import Image, Instance, InstanceStatus, Node

        node = Node.objects.only("pk", "gpu_model_id", "price_per_gpu_hour_micros",
                                 "disk_price_per_gb_month_micros").first()
        image = Image.objects.get(slug="cuda-12-4")
        now = timezone.now()
        price = node.mig_prices_micros[SLICE_PROFILE] if SLICES else node.price_per_gpu_hour_micros
        # Every column of the instance the service writes, with the values it writes (node and time fixed).
        template = Instance(
            renter_id=renter_id, node_id=node.pk, gpu_model_id=node.gpu_model_id, num_gpus=1, label="", image=image,
            image_ref="", registry_auth=False, registry_auth_encrypted=None, env_names=[], env_encrypted=None,
            onstart="", ports_requested=[],
            min_cuda_version="", disk_gb=image.min_disk_gb, ssh_public_keys=[SSH_KEY], status=InstanceStatus.REQUESTED,
            status_message="Waiting for a worker", price_per_gpu_hour_micros=price, price_per_hour_micros=price,
            platform_fee_bps=platform_fee_bps(), mig_profile=SLICE_PROFILE if SLICES else "",
            disk_price_per_gb_month_micros=node.disk_price_per_gb_month_micros, created_at=now,
        )
        fields = [f for f in Instance._meta.concrete_fields if not f.primary_key]
        self.columns = [f.column for f in fields]
        self.values = [f.get_db_prep_save(f.pre_save(template, add=True), connection) for f in fields]
        self.node_col = self.columns.index("node_id")
        self.insert_instance = (f"INSERT INTO marketplace_instance ({', '.join(self.columns)}) "  # noqa: S608
                                f"VALUES ({', '.join(['%s'] * len(self.columns))}) RETURNING id")
        db = settings.DATABASES["default"]
        self.conn = psycopg.connect(dbname=db["NAME"], host=db.get("HOST") or "127.0.0.1",
                                    port=db.get("PORT") or 5432, user=db.get("USER") or "postgres",
                                    password=db.get("PASSWORD") or None)
        self.backend = self.conn.info.backend_pid
        self.now = now
        connection.close()

    def book(self, node_id: int) -> bool:
        return self.book_slice(node_id) if SLICES else self.book_gpu(node_id)

    def book_slice(self, node_id: int) -> bool:
        cur = self.conn.cursor()
        cur.execute("SELECT id FROM marketplace_gpu WHERE node_id = %s AND status = 'mig' FOR SHARE", [node_id])
        parents = [r[0] for r in cur.fetchall()]
        cur.execute("SELECT id FROM marketplace_migslice WHERE node_id = %s AND status = 'free' AND profile = %s "
                    "AND gpu_id = ANY(%s) ORDER BY gpu_id, device LIMIT 1 FOR UPDATE SKIP LOCKED",
                    [node_id, SLICE_PROFILE, parents])
        slices = [r[0] for r in cur.fetchall()]
        if not slices:
            self.conn.rollback()
            return False
        values = list(self.values)
        values[self.node_col] = node_id
        cur.execute(self.insert_instance, values)
        instance_id = cur.fetchone()[0]
        cur.execute("INSERT INTO marketplace_migsliceallocation (instance_id, mig_slice_id, allocated_at) "
                    "VALUES (%s, %s, %s)", [instance_id, slices[0], self.now])
        cur.execute("UPDATE marketplace_migslice SET status = 'rented' WHERE id = %s", [slices[0]])
        self.conn.commit()
        return True

    def book_gpu(self, node_id: int) -> bool:
        cur = self.conn.cursor()
        cur.execute("SELECT id FROM marketplace_gpu WHERE node_id = %s AND status = 'free' ORDER BY index "
                    "LIMIT 1 FOR UPDATE SKIP LOCKED", [node_id])
        gpus = [r[0] for r in cur.fetchall()]
        if not gpus:
            self.conn.rollback()
            return False
        values = list(self.values)
        values[self.node_col] = node_id
        cur.execute(self.insert_instance, values)
        instance_id = cur.fetchone()[0]
        cur.executemany("INSERT INTO marketplace_gpuallocation (instance_id, gpu_id, allocated_at) "
                        "VALUES (%s, %s, %s)", [(instance_id, g, self.now) for g in gpus])
        cur.execute("UPDATE marketplace_gpu SET status = 'rented' WHERE id = ANY(%s)", [gpus])
        self.conn.commit()
        return True

    def close(self) -> None:
        self.conn.close()


class ServiceSyncSendPath(ServicePath):
    """The service with the job handed to the broker in the request's thread (as before the sender thread)."""

    send = "request"


PATHS = {"service": ServicePath, "bare": BarePath, "service-sync-send": ServiceSyncSendPath}


def cpu_split(renter_id: int, node_ids: list[int], n: int, seed: int) -> dict[str, tuple[float, float]]:
    """Where a booking's CPU goes, one client at a time in this process (no contention): per kind, (client ms,
    its PostgreSQL backend's ms) per booking, the median of 5 blocks interleaved. Kinds: the service handing the
    job to the broker in its own thread; the same with the hand-off replaced by nothing (the job row is written,
    never sent: the difference is the publish and its UPDATE); bare SQL."""
    from marketplace.services.instances import booking
    from provisioning.services import jobs

    rng = random.Random(seed)
    bare = BarePath(renter_id)  # first: it closes Django's connection, which the service then opens anew
    service = ServiceSyncSendPath(renter_id)
    real_send = jobs._send
    samples: dict[str, list[tuple[float, float]]] = {"service": [], "service, no publish": [], "bare": []}
    # The transaction's steps, timed (client CPU) in the no-publish blocks by wrapping the booking module's names.
    names = steps_timed()
    owner = dict.fromkeys(names, booking)
    steps = {name: getattr(owner[name], name) for name in names}
    spent: dict[str, float] = dict.fromkeys(names, 0.0)
    timed = 0
    try:
        for _ in range(5):
            for kind in samples:
                path = bare if kind == "bare" else service
                jobs._send = (lambda job_id, kind: None) if kind == "service, no publish" else real_send
                if kind == "service, no publish":
                    for name, real in steps.items():
                        setattr(owner[name], name, _timed(real, name, spent))
                c0, b0, done = time.process_time(), backend_cpu(path.backend), 0
                while done < n // 5:
                    done += path.book(rng.choice(node_ids))
                c1, b1 = time.process_time(), backend_cpu(path.backend)
                _restore(owner, steps)
                timed += done if kind == "service, no publish" else 0
                samples[kind].append((1000 * (c1 - c0) / done, 1000 * (b1 - b0) / done))
                reset()
    finally:
        jobs._send = real_send
        _restore(owner, steps)
        service.close()
        bare.close()
    result = {k: (statistics.median(c for c, _ in v), statistics.median(b for _, b in v)) for k, v in samples.items()}
    for name in names:
        result[f"  {name}"] = (1000 * spent[name] / timed, float("nan"))
    return result


def steps_timed() -> tuple[str, str]:
    """The booking transaction's steps (names in marketplace.services.instances.booking) --split times one by one:
    the node's read with the wallet's lock; the statement with the burn rate, the instance, its GPUs (or, with
    --slices, its MIG slices) and its job."""
    return ("_lock_node_for_booking", "_allocate_free_slices" if SLICES else "_allocate_free_gpus")


def _restore(owner, steps):  # type: ignore[no-untyped-def]
    for name, real in steps.items():
        setattr(owner[name], name, real)


def _timed(real, name, spent):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            spent[name] += time.process_time() - t
    return wrapper


def client_round(path: str, renter_id: int, node_ids: list[int], bookings: int, seed: int,
                 start: threading.Barrier | mp.synchronize.Barrier) -> dict:
    """One client's share of a round: `bookings` one-GPU bookings on random nodes. Times in CLOCK_MONOTONIC,
    which every process of the machine shares."""
    rng = random.Random(seed)
    client = PATHS[path](renter_id)
    done = conflicts = 0
    start.wait()
    t0, cpu0, db0 = time.monotonic(), time.process_time(), backend_cpu(client.backend)
    while done < bookings:
        if client.book(rng.choice(node_ids)):
            done += 1
        else:
            conflicts += 1
    t1, cpu1, db1 = time.monotonic(), time.process_time(), backend_cpu(client.backend)
    client.close()
    # process_time is the whole process's: with --threads, every client's (the parent reports it once).
    return {"done": done, "conflicts": conflicts, "t0": t0, "t1": t1, "cpu": cpu1 - cpu0, "db_cpu": db1 - db0}


def _process_main(inbox: mp.Queue, outbox: mp.Queue, start: mp.synchronize.Barrier) -> None:
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            outbox.put(client_round(*job, start=start))
        except Exception as exc:  # noqa: BLE001 (reported by the parent, which stops)
            outbox.put({"error": f"{type(exc).__name__}: {exc}"})


class Clients:
    """N clients that run rounds on command: processes (default) or threads."""

    def __init__(self, n: int, threads: bool):
        self.n, self.threads = n, threads
        if threads:
            return
        from django.db import connections

        connections.close_all()  # the children open their own
        ctx = mp.get_context("fork")
        self.start = ctx.Barrier(n)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_process_main, args=(q, self.outbox, self.start), daemon=True)
                      for q in self.inboxes]
        for proc in self.procs:
            proc.start()

    def run(self, path: str, renters: list[int], node_ids: list[int], per_client: int, seed: int) -> list[dict]:
        jobs = [(path, renters[i], node_ids, per_client, seed * 1000 + i) for i in range(self.n)]
        if self.threads:
            results: list[dict] = [{} for _ in jobs]
            start = threading.Barrier(self.n)

            def one(i: int) -> None:
                try:
                    results[i] = client_round(*jobs[i], start=start)
                except Exception as exc:  # noqa: BLE001
                    results[i] = {"error": f"{type(exc).__name__}: {exc}"}

            threads = [threading.Thread(target=one, args=(i,)) for i in range(self.n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for inbox, job in zip(self.inboxes, jobs, strict=True):
                inbox.put(job)
            results = [self.outbox.get(timeout=600) for _ in jobs]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            sys.exit(f"bench: a client failed: {errors[0]}")
        return results

    def close(self) -> None:
        if not self.threads:
            for inbox in self.inboxes:
                inbox.put(None)
            for proc in self.procs:
                proc.join(timeout=30)


class Relays:
    """`manage.py job_relay` processes on the bench's database and broker, for --send relay (their own CPU is
    reported; their PostgreSQL backends' is not split out)."""

    def __init__(self, n: int, poll_s: float | None = None):
        import subprocess

        self.n = n
        db = settings.DATABASES["default"]
        url = (f"postgres://{db.get('USER') or 'postgres'}@{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}"
               f"/{db['NAME']}")
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test", "DATABASE_URL": url, "JOB_RELAY": "1",
               "CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "LOG_LEVEL": "WARNING"}
        if poll_s is not None:
            env["JOB_RELAY_POLL_S"] = str(poll_s)
        self.procs = [subprocess.Popen([sys.executable, "manage.py", "job_relay"], cwd=ROOT, env=env,
                                       stdout=subprocess.DEVNULL) for _ in range(n)]

    def cpu(self) -> float:
        return sum(backend_cpu(p.pid) for p in self.procs)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(30)


# ------------------------------------------------------------------------------------- checks and reset


def wait_until_sent(timeout: float = 120) -> float:
    """Block until every job has reached the broker; the monotonic time when it had."""
    from provisioning.models import Job

    deadline = time.monotonic() + timeout
    while Job.objects.filter(sent_at__isnull=True).exists():
        if time.monotonic() > deadline:
            sys.exit("bench: jobs were not sent to the broker within 120 s")
        time.sleep(0.005)
    return time.monotonic()


def check(expected: int) -> int:
    """Double allocations found (must be 0); exits when the rows disagree otherwise."""
    from django.db import connection

    with connection.cursor() as c:
        c.execute("SELECT count(*) FROM (SELECT gpu_id FROM marketplace_gpuallocation WHERE released_at IS NULL "
                  "GROUP BY gpu_id HAVING count(*) > 1) d")
        doubles = c.fetchone()[0]
        c.execute("SELECT count(*) FROM marketplace_gpu g LEFT JOIN marketplace_gpuallocation a ON a.gpu_id = g.id "
                  "AND a.released_at IS NULL WHERE (g.status = 'rented') <> (a.id IS NOT NULL)")
        mismatched = c.fetchone()[0]
        c.execute("SELECT count(*) FROM (SELECT mig_slice_id FROM marketplace_migsliceallocation "
                  "WHERE released_at IS NULL GROUP BY mig_slice_id HAVING count(*) > 1) d")
        doubles += c.fetchone()[0]
        # a slice rented exactly when allocated; no GPU allocated whole with an allocated slice
        c.execute("SELECT count(*) FROM marketplace_migslice s LEFT JOIN marketplace_migsliceallocation a "
                  "ON a.mig_slice_id = s.id AND a.released_at IS NULL "
                  "WHERE (s.status = 'rented') <> (a.id IS NOT NULL)")
        mismatched += c.fetchone()[0]
        c.execute("SELECT count(*) FROM marketplace_gpuallocation ga "
                  "JOIN marketplace_migslice s ON s.gpu_id = ga.gpu_id "
                  "JOIN marketplace_migsliceallocation sa ON sa.mig_slice_id = s.id AND sa.released_at IS NULL "
                  "WHERE ga.released_at IS NULL")
        doubles += c.fetchone()[0]
        c.execute("SELECT count(*) FROM marketplace_instance WHERE status <> 'destroyed'")  # not --history's
        instances = c.fetchone()[0]
    if mismatched or instances != expected:
        sys.exit(f"bench: {mismatched} GPUs rented without a live allocation or the reverse; "
                 f"{instances} instances for {expected} bookings")
    return doubles


def reset() -> None:
    from django.db import connection

    with connection.cursor() as c:
        c.execute("DELETE FROM provisioning_job")
        c.execute("DELETE FROM marketplace_gpuallocation")
        c.execute("DELETE FROM marketplace_migsliceallocation")
        c.execute("DELETE FROM marketplace_instance WHERE status <> 'destroyed'")  # --history's stay
        c.execute("UPDATE marketplace_gpu SET status = %s", ["mig" if SLICES else "free"])
        c.execute("UPDATE marketplace_migslice SET status = 'free'")
        c.execute("VACUUM ANALYZE provisioning_job, marketplace_gpuallocation, marketplace_instance, marketplace_gpu, "
                  "marketplace_migsliceallocation, marketplace_migslice")


def purge_broker() -> int:
    from celery import current_app

    try:
        return current_app.control.purge()
    except Exception as exc:  # noqa: BLE001 (a bench: say it, go on)
        print(f"could not purge the broker: {exc}")
        return 0


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    global SLICES
    args = parse_args()
    SLICES = args.slices
    if args.clients * args.per_client > N_NODES * GPUS_PER_NODE:
        sys.exit("bench: more bookings per round than GPUs")
    # As in production with PostgreSQL (the test settings send in the request's thread).
    ServicePath.send = "request" if args.sync_send else args.send
    server = benchdb.point_django_at_bench_db(args.db_name)
    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from marketplace.models import Node

    try:
        call_command("migrate", verbosity=0)
        t = time.perf_counter()
        renters = seed(args.clients)
        node_ids = list(Node.objects.values_list("pk", flat=True))
        if args.history:
            seed_history(renters, node_ids[0], args.history)
        with connection.cursor() as c:
            c.execute("VACUUM ANALYZE")
            if args.no_notify:
                c.execute("DROP TRIGGER provisioning_job_outbox_notify ON provisioning_job")
        split = f", each split into {SLICES_PER_GPU} x MIG {SLICE_PROFILE}" if SLICES else ""
        history = f", {args.history} destroyed instances each" if args.history else ""
        print(f"seeded {N_NODES} nodes x {GPUS_PER_NODE} GPUs{split}, {args.clients} funded renters{history} "
              f"in {time.perf_counter() - t:.1f} s")
        kind = "threads of one process" if args.threads else "processes"
        per_round = args.clients * args.per_client
        woken = (f"polling every {args.relay_poll or settings.JOB_RELAY_POLL_S:g} s" if args.no_notify else
                 "woken by NOTIFY")
        send = {"relay": f"by {args.relays} job relay process{'es' if args.relays > 1 else ''} (manage.py job_relay, "
                         f"{woken})",
                "thread": "by each process's sender thread", "request": "in the request's thread"}[ServicePath.send]
        unit = f"one-slice ({SLICE_PROFILE})" if SLICES else "one-GPU"
        print(f"{args.clients} clients ({kind}), {per_round} {unit} bookings per round, "
              f"{args.rounds} rounds of each path, alternating; funds check on; jobs sent {send}")
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        clients = Clients(args.clients, args.threads)
        relays = Relays(args.relays if ServicePath.send == "relay" else 0, args.relay_poll)
        paths = ("service", "bare", "service-sync-send") if args.compare_send else ("service", "bare")
        rates: dict[str, list[float]] = {p: [] for p in paths}
        doubles_total = 0
        # A warm-up round of each (connections, caches, the broker's connection), not counted.
        schedule = list(paths) + [p for _ in range(args.rounds) for p in paths]
        for n, path in enumerate(schedule):
            warm = n < len(paths)
            per = 2 if warm else args.per_client
            relay_cpu = relays.cpu()
            results = clients.run(path, renters, node_ids, per, args.seed + n)
            t0 = min(r["t0"] for r in results)
            t1 = max(r["t1"] for r in results)
            sent = wait_until_sent() if path.startswith("service") else t1
            wall = max(t1, sent) - t0
            booked = sum(r["done"] for r in results)
            relay_cpu = relays.cpu() - relay_cpu
            conflicts = sum(r["conflicts"] for r in results)
            doubles = check(booked)
            doubles_total += doubles
            reset()
            if warm:
                continue
            rate = booked / wall
            rates[path].append(rate)
            drain = f", last job sent {1000 * (sent - t1):.0f} ms after the last answer" if sent > t1 else ""
            cpu = (max(r["cpu"] for r in results) if args.threads else sum(r["cpu"] for r in results)) / booked
            db_cpu = sum(r["db_cpu"] for r in results) / booked
            relay = f", the relay {1000 * relay_cpu / booked:.1f} ms" if relays.n and path == "service" else ""
            print(f"  {path:17s} {booked} bookings in {wall:.2f} s = {rate:7.1f}/s ({conflicts} x 409 retried{drain}); "
                  f"CPU per booking: client {1000 * cpu:.1f} ms, its PostgreSQL backend {1000 * db_cpu:.1f} ms{relay}; "
                  f"double allocations {doubles}; load {os.getloadavg()[0]:.2f}")
        clients.close()
        relays.close()
        service, bare = statistics.median(rates["service"]), statistics.median(rates["bare"])
        ratio = service / bare
        print(f"median bookings/s: service {service:.1f}, bare SQL {bare:.1f}; ratio {ratio:.2f} x bare "
              f"(rounds: {', '.join(f'{s / b:.2f}' for s, b in zip(rates['service'], rates['bare'], strict=True))})")
        if args.compare_send:
            sync = statistics.median(rates["service-sync-send"])
            print(f"median bookings/s, the service handing jobs over in the request's thread: {sync:.1f} "
                  f"({sync / bare:.2f} x bare; the sender thread's path: {service / sync:.2f} x this)")
        print(f"double allocations: {doubles_total}")
        if args.split:
            split = cpu_split(renters[0], node_ids, args.split, args.seed)
            print(f"CPU per booking, one client alone ({args.split} of each, 5 interleaved blocks, medians; "
                  f"client + its PostgreSQL backend):")
            for kind, (client, backend) in split.items():
                if kind.startswith("  "):  # a step of the no-publish booking, client CPU only
                    print(f"    of which {kind.strip():24s} {client:5.2f} ms")
                else:
                    print(f"  {kind:20s} {client:5.2f} + {backend:4.2f} ms = {client + backend:5.2f} ms")
            publish = split["service"][0] - split["service, no publish"][0]
            print(f"  the publish (kombu/Celery + the sent_at UPDATE) is {publish:.2f} ms of the service's "
                  f"{split['service'][0]:.2f} ms client CPU")
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        met = ratio >= GOAL and doubles_total == 0
        print(f"goal (>= {GOAL} x bare, 0 double allocations): {'MET' if met else 'NOT MET'}")
        purged = purge_broker()
        print(f"purged {purged} provisioning messages from the broker")
    finally:
        if args.keep:
            print(f"kept database {args.db_name}")
        else:
            benchdb.drop_bench_db(server, args.db_name)


if __name__ == "__main__":
    main()
