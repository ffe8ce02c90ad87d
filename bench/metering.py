#!/usr/bin/env python3
"""Benchmark of one metering tick over 50,000 running instances in PostgreSQL.

Not a timed test: it prints figures for docs/BENCHMARKS.md. What it does:

1. creates a database of its own (`gpumarket_bench_metering` by default; never the test or dev
   database), points Django at it and runs the migrations (so the ledger's triggers are the real ones);
2. seeds with COPY: 5,000 renters with funded wallets (posted as ledger credits), 500 providers with
   2,000 nodes, and 50,000 instances running since a random moment of the last three days, a third of
   them already metered up to a few minutes ago; then warms up with two ticks and VACUUM ANALYZE;
3. in rounds, interleaved (so that both sides see the same load on a shared machine): one tick, a
   simulated minute after the last (the metering, billing.services.metering.usage_meter, the set-based SQL,
   and the balance checks that the Celery task runs after it, enforcement), writing 50,000 usage intervals,
   50,000 ledger transactions and 150,000 entries and updating 50,000 instances and 5,501 accounts; then a
   bare bulk INSERT of the same rows (intervals, transactions, entries) into plain copies of those tables
   with their indexes, and without: the floor the tick is compared against, round by round;
4. with --profile, one more tick statement by statement (and its COMMIT), to say where the time goes;
5. times the per-instance path (one transaction per instance, what SQLite uses) on a sample, to show
   why PostgreSQL gets the set-based one;
6. checks the ledger afterwards (every transaction sums to zero, cached balances equal their entries)
   and drops the database unless --keep.

Run: DJANGO_SETTINGS_MODULE=config.settings.test .venv/bin/python bench/metering.py
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")

import benchdb  # noqa: E402 (bench/benchdb.py, beside this script)
import django  # noqa: E402
from django.conf import settings  # noqa: E402

N_RENTERS = 5_000
N_PROVIDERS = 500
N_NODES = 2_000
GOAL_RATIO, GOAL_SECONDS = 3.0, 5.0  # issue 14: a tick <= 3x the bare INSERT of its rows, and <= 5 s


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db-name", default="gpumarket_bench_metering", help="database to create (%(default)s)")
    p.add_argument("--instances", type=int, default=50_000, help="running instances (%(default)s)")
    p.add_argument("--ticks", type=int, default=5, help="rounds: timed ticks, each beside a bare INSERT (%(default)s)")
    p.add_argument("--profile", action="store_true", help="time one more tick statement by statement")
    p.add_argument("--batch-size", type=int, default=None, help="instances per batch (BILLING_METER_BATCH_SIZE)")
    p.add_argument("--sample", type=int, default=2_000, help="instances for the per-instance path (%(default)s)")
    p.add_argument("--seed", type=int, default=20260301)
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    return p.parse_args()


def point_django_at_bench_db(name: str) -> dict:
    server = benchdb.point_django_at_bench_db(name)
    settings.DATABASES["default"]["CONN_MAX_AGE"] = None
    return server


drop_bench_db = benchdb.drop_bench_db


def copy_in(model, objs) -> None:
    """COPY model instances into their table, every concrete column prepared as Django would."""
    from django.db import connection

    fields = list(model._meta.concrete_fields)
    table = connection.ops.quote_name(model._meta.db_table)
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    with connection.cursor() as c:
        with c.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
            for obj in objs:
                copy.write_row([f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields])
        c.execute(f"SELECT setval(pg_get_serial_sequence(%s, 'id'), max(id)) FROM {table}", [model._meta.db_table])


def seed(rng: random.Random, n_instances: int, now: datetime) -> None:
    from django.db import connection, transaction

    from billing.models import Account, AccountKind
    from billing.services.ledger import platform_account
    from billing.services.metering import cost_for
    from marketplace.models import GpuModel, Image, Instance, Node, User

    users = [User(id=i + 1, email=f"user{i}@bench.example", date_joined=now) for i in range(N_RENTERS + N_PROVIDERS)]
    for user in users:
        user.set_unusable_password()
        if hasattr(user, "email_canonical"):  # unique since 032c32d; save() sets it, a bulk insert does not
            user.email_canonical = user.email
    copy_in(User, users)
    renters, providers = range(1, N_RENTERS + 1), range(N_RENTERS + 1, N_RENTERS + N_PROVIDERS + 1)
    models = list(GpuModel.objects.order_by("id"))
    image = Image.objects.order_by("id").first()
    nodes = []
    for i in range(N_NODES):
        m = rng.choice(models)
        nodes.append(Node(
            id=i + 1, provider_id=rng.choice(providers), name=f"bench-{i}", address=f"10.1.{i // 256}.{i % 256}",
            ssh_port=22, ssh_user="ubuntu", host_key_fingerprint=f"SHA256:bench{i:038d}", country="DE",
            city="Frankfurt", datacenter="FRA1", gpu_model_id=m.id, gpu_count=8,
            price_per_gpu_hour_micros=rng.randint(150_000, 4_500_000), runtime="docker", state="active",
            state_changed_at=now, verdict="verified", listed=True, score=1.0, reliability=0.99,
            ssh_public_key=f"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBENCH{i:016d}",
            ssh_private_key_encrypted=b"bench-dummy", created_at=now - timedelta(days=30),
        ))
    copy_in(Node, nodes)
    instances = []
    for i in range(n_instances):
        node = rng.choice(nodes)
        gpus = rng.choice((1, 1, 1, 2, 4, 8))
        price = node.price_per_gpu_hour_micros * gpus
        started = now - timedelta(seconds=rng.uniform(120, 3 * 86400))
        billed = 0
        if rng.random() < 0.33:  # metered before, up to a few minutes ago
            billed = int((now - started).total_seconds()) - rng.randint(60, 600)
        instances.append(Instance(
            id=i + 1, renter_id=rng.choice(renters), node_id=node.id, gpu_model_id=node.gpu_model_id, num_gpus=gpus,
            image_id=image.id, disk_gb=50, ssh_public_keys=[], status="running", status_message="Running",
            ssh_host="10.0.0.1", ssh_port=40000 + i % 20000, ssh_user="root",
            price_per_gpu_hour_micros=node.price_per_gpu_hour_micros, price_per_hour_micros=price,
            platform_fee_bps=1500, created_at=started - timedelta(seconds=30), started_at=started, updated_at=now,
            billed_until=started + timedelta(seconds=billed) if billed else None, billed_seconds=max(billed, 0),
            cost_micros=cost_for(price, max(billed, 0)),
        ))
    copy_in(Instance, instances)
    # The renters' money, as the ledger holds it: one credit transaction each (promotions -> wallet), and
    # the usage already metered as one transaction per instance (earlier intervals are not needed).
    promo = platform_account(kind=AccountKind.PROMOTIONS)
    revenue = platform_account(kind=AccountKind.PLATFORM_REVENUE)
    with transaction.atomic(), connection.cursor() as c:
        Account.objects.bulk_create([Account(kind=AccountKind.CUSTOMER_WALLET, user_id=u) for u in renters]
                                    + [Account(kind=AccountKind.PROVIDER_EARNINGS, user_id=u) for u in providers])
        c.execute("""
            INSERT INTO billing_ledgertransaction (idempotency_key, kind, memo, reason, created_at)
            SELECT 'bench-credit:' || a.user_id, 'credit', 'bench funds', 'bench', %(now)s
            FROM billing_account a WHERE a.kind = 'customer_wallet'
        """, {"now": now})
        c.execute("""
            INSERT INTO billing_entry (transaction_id, account_id, amount_micros)
            SELECT t.id, a.id, 1000000000000 FROM billing_ledgertransaction t
            JOIN billing_account a ON 'bench-credit:' || a.user_id = t.idempotency_key AND a.kind = 'customer_wallet'
            UNION ALL
            SELECT t.id, %(promo)s, -1000000000000 FROM billing_ledgertransaction t
            WHERE t.idempotency_key LIKE 'bench-credit:%%'
        """, {"promo": promo.pk})
        c.execute("""
            INSERT INTO billing_ledgertransaction (idempotency_key, kind, memo, reason, created_at)
            SELECT 'bench-history:' || i.id, 'usage', 'history', '', %(now)s
            FROM marketplace_instance i WHERE i.cost_micros > 0
        """, {"now": now})
        c.execute("""
            INSERT INTO billing_entry (transaction_id, account_id, amount_micros)
            SELECT t.id, w.id, -i.cost_micros FROM marketplace_instance i
            JOIN billing_ledgertransaction t ON t.idempotency_key = 'bench-history:' || i.id
            JOIN billing_account w ON w.kind = 'customer_wallet' AND w.user_id = i.renter_id
            UNION ALL
            SELECT t.id, e.id, i.cost_micros - i.cost_micros * 1500 / 10000 FROM marketplace_instance i
            JOIN billing_ledgertransaction t ON t.idempotency_key = 'bench-history:' || i.id
            JOIN marketplace_node n ON n.id = i.node_id
            JOIN billing_account e ON e.kind = 'provider_earnings' AND e.user_id = n.provider_id
            WHERE i.cost_micros - i.cost_micros * 1500 / 10000 <> 0
            UNION ALL
            SELECT t.id, %(revenue)s, i.cost_micros * 1500 / 10000 FROM marketplace_instance i
            JOIN billing_ledgertransaction t ON t.idempotency_key = 'bench-history:' || i.id
            WHERE i.cost_micros * 1500 / 10000 <> 0
        """, {"revenue": revenue.pk})
        c.execute("""
            UPDATE billing_account a SET balance_micros = s.total
            FROM (SELECT account_id, sum(amount_micros) AS total FROM billing_entry GROUP BY account_id) s
            WHERE a.id = s.account_id
        """)


def vacuum() -> None:
    from django.db import connection

    with connection.cursor() as c:
        c.execute("VACUUM ANALYZE")


def bare_insert(rows: int, indexed: bool) -> tuple[float, int]:
    """The same rows as one tick writes (intervals, transactions, entries: 5 rows per instance), inserted
    with one INSERT ... SELECT each into plain copies of the tables (with their indexes if `indexed`)."""
    from django.db import connection, transaction

    like = "INCLUDING DEFAULTS" + (" INCLUDING INDEXES" if indexed else "")
    with connection.cursor() as c:
        for t in ("billing_usageinterval", "billing_ledgertransaction", "billing_entry"):
            c.execute(f"DROP TABLE IF EXISTS bare_{t}")
            c.execute(f"CREATE TABLE bare_{t} (LIKE {t} {like})")
            c.execute(f"ALTER TABLE bare_{t} ALTER COLUMN id SET DEFAULT nextval('{t}_id_seq')")
    started = time.perf_counter()
    with transaction.atomic(), connection.cursor() as c:
        c.execute("""
            INSERT INTO bare_billing_ledgertransaction (idempotency_key, kind, memo, reason, created_at)
            SELECT 'bare:' || g || ':' || %(salt)s, 'usage', 'Instance ' || g || ': 60 s', '', now()
            FROM generate_series(1, %(n)s) g
        """, {"n": rows, "salt": time.time_ns()})
        c.execute("""
            INSERT INTO bare_billing_entry (transaction_id, account_id, amount_micros)
            SELECT g, 1 + g %% 5000, -1000 - g FROM generate_series(1, %(n)s) g
            UNION ALL SELECT g, 5001 + g %% 500, 850 + g FROM generate_series(1, %(n)s) g
            UNION ALL SELECT g, 5502, 150 FROM generate_series(1, %(n)s) g
        """, {"n": rows})
        c.execute("""
            INSERT INTO bare_billing_usageinterval (instance_id, started_at, ended_at, seconds, price_per_hour_micros,
                                                    platform_fee_bps, amount_micros, fee_micros, transaction_id,
                                                    created_at)
            SELECT g, now(), now() + interval '60 seconds', 60, 1000000, 1500, 1000 + g, 150, g, now()
            FROM generate_series(1, %(n)s) g
        """, {"n": rows})
    elapsed = time.perf_counter() - started
    with connection.cursor() as c:
        for t in ("billing_usageinterval", "billing_ledgertransaction", "billing_entry"):
            c.execute(f"DROP TABLE bare_{t}")
    return elapsed, rows * 5


def per_instance_path(now: datetime, sample: int) -> float:
    """Seconds per instance of the one-transaction-per-instance path (what SQLite runs), on a sample."""
    from django.db import transaction

    from billing.services.metering import usage_close
    from marketplace.models import Instance

    ids = list(Instance.objects.filter(status="running").order_by("?").values_list("pk", flat=True)[:sample])
    started = time.perf_counter()
    for pk in ids:
        with transaction.atomic():
            instance = Instance.objects.select_for_update().get(pk=pk)
            usage_close(instance=instance, until=now)
    return (time.perf_counter() - started) / max(len(ids), 1)


def profile_tick(now: datetime, batch_size: int) -> list[tuple[str, float]]:
    """One tick run statement by statement (the statements usage_meter runs, in its batches): seconds each,
    summed over the batches, with the deferred checks (SET CONSTRAINTS ALL IMMEDIATE) and COMMIT apart."""
    from django.db import connection, transaction

    from billing.models import AccountKind, TransactionKind
    from billing.services import metering
    from billing.services.ledger import platform_account

    params = {"now": now, "running": "running", "wallet": AccountKind.CUSTOMER_WALLET,
              "earnings": AccountKind.PROVIDER_EARNINGS,
              "revenue": platform_account(kind=AccountKind.PLATFORM_REVENUE).pk,
              "usage": TransactionKind.USAGE, "limit": batch_size, "after": 0}
    spent: dict[str, float] = {}

    def timed(label: str, run) -> None:
        t = time.perf_counter()
        run()
        spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

    with connection.cursor() as c:
        while True:
            with transaction.atomic():
                for n, sql in enumerate(metering._statements(metering._LOCK_AND_COMPUTE)):
                    timed(f"{n + 1:2}. " + " ".join(sql.split())[:60], lambda sql=sql: c.execute(sql, params))
                c.execute("SELECT count(*), max(instance_id) FROM billing_tick")
                locked, last = c.fetchone()
                for n, sql in enumerate(metering._statements(metering._POST)):
                    timed(f"{n + 3:2}. " + " ".join(sql.split())[:60], lambda sql=sql: c.execute(sql, params))
                c.execute("DROP TABLE billing_tick")
                timed("deferred checks (SET CONSTRAINTS ALL IMMEDIATE)",
                      lambda: c.execute("SET CONSTRAINTS ALL IMMEDIATE"))
                t = time.perf_counter()
            spent["COMMIT"] = spent.get("COMMIT", 0.0) + time.perf_counter() - t
            if locked < batch_size:
                return list(spent.items())
            params["after"] = last


def check_ledger() -> list[tuple[str, object]]:
    from django.db import connection

    with connection.cursor() as c:
        c.execute("""SELECT count(*) FROM (SELECT transaction_id FROM billing_entry GROUP BY transaction_id
                     HAVING sum(amount_micros) <> 0) x""")
        unbalanced = c.fetchone()[0]
        c.execute("""SELECT count(*) FROM billing_account a LEFT JOIN (SELECT account_id, sum(amount_micros) s
                     FROM billing_entry GROUP BY account_id) e ON e.account_id = a.id
                     WHERE a.balance_micros <> coalesce(e.s, 0)""")
        stale = c.fetchone()[0]
        c.execute("""SELECT count(*) FROM marketplace_instance i WHERE i.cost_micros
                     <> i.price_per_hour_micros * i.billed_seconds / 3600""")
        off = c.fetchone()[0]
        c.execute("SELECT count(*) FROM billing_usageinterval")
        intervals = c.fetchone()[0]
        c.execute("SELECT count(*) FROM billing_entry")
        entries = c.fetchone()[0]
    return [("unbalanced transactions", unbalanced), ("accounts whose cached balance differs", stale),
            ("instances whose cost is not floor(price x seconds / 3600)", off), ("usage intervals", intervals),
            ("ledger entries", entries)]


def main() -> None:
    args = parse_args()
    server = point_django_at_bench_db(args.db_name)
    django.setup()
    from django.core.management import call_command

    from billing.services.enforcement import balances_enforce
    from billing.services.metering import usage_meter

    print(f"bench/metering.py: database {args.db_name}, {args.instances:,} running instances")
    t = time.perf_counter()
    call_command("migrate", verbosity=0)
    print(f"  migrate: {time.perf_counter() - t:.1f} s")
    rng = random.Random(args.seed)
    now = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    try:
        t = time.perf_counter()
        seed(rng, args.instances, now)
        vacuum()
        print(f"  seed: {time.perf_counter() - t:.1f} s")
        for _ in range(2):  # warm-up ticks: every instance gets an interval, caches are warm
            now += timedelta(seconds=60)
            usage_meter(now=now, batch_size=args.batch_size)
        vacuum()

        meter_s, enforce_s, bare_indexed, bare_plain, loads, rows = [], [], [], [], [], 0
        for _ in range(args.ticks):  # one round: a tick, then the bare INSERTs of the same rows
            now += timedelta(seconds=60)
            loads.append(os.getloadavg()[0])
            t0 = time.perf_counter()
            result = usage_meter(now=now, batch_size=args.batch_size)
            t1 = time.perf_counter()
            enforced = balances_enforce(now=now)
            t2 = time.perf_counter()
            meter_s.append(t1 - t0)
            enforce_s.append(t2 - t1)
            rows = result.intervals * 5
            assert result.intervals == args.instances, result
            assert enforced.stopped == 0, enforced
            bare_indexed.append(bare_insert(args.instances, indexed=True)[0])
            bare_plain.append(bare_insert(args.instances, indexed=False)[0])
            print(f"  round {len(meter_s)}: load {loads[-1]:.1f}  tick {t2 - t0:.2f} s  bare INSERT with indexes "
                  f"{bare_indexed[-1]:.2f} s  ({(t2 - t0) / bare_indexed[-1]:.1f}x)  plain {bare_plain[-1]:.2f} s",
                  flush=True)
        profile = []
        if args.profile:
            now += timedelta(seconds=60)
            profile = profile_tick(now, args.batch_size or settings.BILLING_METER_BATCH_SIZE)
        now += timedelta(seconds=60)
        per_instance = per_instance_path(now, args.sample)
        checks = check_ledger()
    finally:
        if not args.keep:
            drop_bench_db(server, args.db_name)

    med = statistics.median
    tick = [m + e for m, e in zip(meter_s, enforce_s, strict=True)]
    ratios = [t / b for t, b in zip(tick, bare_indexed, strict=True)]
    plain_s, indexed_s = med(bare_plain), med(bare_indexed)
    print()
    print(f"  {args.ticks} rounds, {args.instances:,} instances, batch "
          f"{args.batch_size or settings.BILLING_METER_BATCH_SIZE:,}, load average (1 min) "
          f"{min(loads):.1f}-{max(loads):.1f}, now {os.getloadavg()[0]:.1f} (median; min-max):")
    print(f"    metering (set-based SQL)   {med(meter_s):6.2f} s  ({min(meter_s):.2f}-{max(meter_s):.2f})  "
          f"{rows / med(meter_s):>10,.0f} rows/s")
    print(f"    balance checks             {med(enforce_s):6.2f} s  ({min(enforce_s):.2f}-{max(enforce_s):.2f})")
    print(f"    whole tick                 {med(tick):6.2f} s  ({min(tick):.2f}-{max(tick):.2f})  "
          f"{rows / med(tick):>10,.0f} rows/s")
    print(f"  bare bulk INSERT of the same {rows:,} rows, in the same rounds:")
    print(f"    plain tables               {plain_s:6.2f} s  ({min(bare_plain):.2f}-{max(bare_plain):.2f})  "
          f"{rows / plain_s:>10,.0f} rows/s")
    print(f"    with the same indexes      {indexed_s:6.2f} s  ({min(bare_indexed):.2f}-{max(bare_indexed):.2f})  "
          f"{rows / indexed_s:>10,.0f} rows/s")
    print(f"  tick / bare INSERT with indexes, round by round: median {med(ratios):.1f}x "
          f"({min(ratios):.1f}-{max(ratios):.1f})")
    met = med(ratios) <= GOAL_RATIO and med(tick) <= GOAL_SECONDS
    print(f"  goal (issue 14): tick <= {GOAL_RATIO:g}x the bare INSERT and <= {GOAL_SECONDS:g} s: "
          f"{'MET' if met else 'NOT MET'} ({med(ratios):.1f}x, {med(tick):.2f} s)")
    if profile:
        print(f"  one more tick, statement by statement (load {os.getloadavg()[0]:.1f}; summed over its batches):")
        for label, seconds in profile:
            print(f"    {seconds:6.2f} s  {label}")
        print(f"    {sum(s for _, s in profile):6.2f} s  in all")
    print(f"  per-instance path (one transaction each, SQLite's): {per_instance * 1000:.2f} ms per instance "
          f"-> {per_instance * args.instances:.0f} s for {args.instances:,}")
    print("  ledger after the run:")
    for name, value in checks:
        print(f"    {name}: {value:,}")


if __name__ == "__main__":
    main()
