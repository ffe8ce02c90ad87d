#!/usr/bin/env python3
"""Benchmark of a provider's earnings reads against the length of their history, and of what keeping the earnings
rollup costs a metering tick (review r54 earn #1).

Not a timed test: it prints figures for docs/BENCHMARKS.md. What it does:

1. creates a database of its own (`gpumarket_bench_earnings` by default; never the test or dev database), points
   Django at it and runs the migrations (so the ledger's triggers, the earnings rollup's among them, are the real
   ones);
2. seeds bench/metering.py's world (renters, providers, nodes, --tick-instances running instances, their
   metered history), then one provider of its own with one node and --instances instances;
3. for each size in --ticks (cumulative): adds that provider's per-minute usage ticks up to the size, one usage
   transaction each (wallet -1,000, earnings +850, platform revenue +150 micro-dollars, a 60 s interval), dated
   back from now over the instances' runs, with one set-based INSERT per table (the rollup's trigger rolls them
   up), then VACUUM ANALYZE; and in --rounds rounds, interleaved, times the earnings page's two reads the old
   way (billing.selectors.earnings_from_ledger + earnings_by_node_from_ledger: every entry and interval) and
   the new way (earnings_for + earnings_by_node: the rollup, the payouts, the instances), and checks that they
   say the same;
4. times --tick-rounds metering ticks over the running instances, the rollup's trigger enabled and disabled in
   turn (ALTER TABLE ... DISABLE TRIGGER), to say what keeping the rollup costs the tick;
5. drops the database unless --keep.

Run: DJANGO_SETTINGS_MODULE=config.settings.test .venv/bin/python bench/earnings_history.py
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

import django  # noqa: E402
import metering as metering_bench  # noqa: E402 (bench/metering.py, beside this script: its world, seeded the same way)
from django.conf import settings  # noqa: E402

TRIGGER = "billing_earnings_rollup"  # migration 0022


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db-name", default="gpumarket_bench_earnings", help="database to create (%(default)s)")
    p.add_argument("--ticks", default="30000,300000,1000000",
                   help="the provider's usage ticks to read at, cumulative, comma-separated (%(default)s)")
    p.add_argument("--instances", type=int, default=4, help="the provider's instances the ticks are spread over")
    p.add_argument("--rounds", type=int, default=5, help="timed reads per size and way (%(default)s)")
    p.add_argument("--tick-instances", type=int, default=20_000,
                   help="running instances of the metering ticks (%(default)s)")
    p.add_argument("--tick-rounds", type=int, default=4, help="ticks with the trigger and without, each (%(default)s)")
    p.add_argument("--seed", type=int, default=20261207)
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    return p.parse_args()


def seed_provider(n_instances: int, now: datetime):
    """A provider of its own (one node, `n_instances` stopped instances) and their renter, with accounts."""
    from billing.models import AccountKind
    from billing.services.ledger import user_account
    from marketplace.models import Instance, Node, User

    provider = User.objects.create(email="provider@earnings.bench.example")
    renter = User.objects.create(email="renter@earnings.bench.example")
    node = Node.objects.order_by("id").first()
    node.pk, node.provider_id, node.name, node.address = None, provider.pk, "earnings-bench", "10.9.0.1"
    node.host_key_fingerprint = "SHA256:earningsbench" + "0" * 30
    node.ssh_public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEARNINGSBENCH"
    node.save()
    template = Instance.objects.order_by("id").first()
    instances = []
    for i in range(n_instances):
        instance = Instance.objects.get(pk=template.pk)
        instance.pk, instance.node_id, instance.renter_id = None, node.pk, renter.pk
        instance.status, instance.ssh_port = "stopped", 60000 + i
        instance.billed_until, instance.billed_seconds, instance.cost_micros = None, 0, 0
        instance.started_at, instance.created_at = now - timedelta(days=400), now - timedelta(days=400)
        instance.save()
        instances.append(instance.pk)
    for user, kind in ((provider, AccountKind.PROVIDER_EARNINGS), (renter, AccountKind.CUSTOMER_WALLET)):
        user_account(user_id=user.pk, kind=kind)
    return provider, renter, instances


def add_ticks(*, provider, renter, instances: list[int], have: int, want: int, now: datetime) -> None:
    """The provider's ticks number `have` to `want` - 1, tick g billing instance instances[g % k] for the minute
    (g // k) minutes before now's, as metering would have posted them."""
    from django.db import connection, transaction

    from billing.models import AccountKind
    from billing.services.ledger import platform_account, user_account

    wallet = user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET).pk
    earnings = user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS).pk
    revenue = platform_account(kind=AccountKind.PLATFORM_REVENUE).pk
    k = len(instances)
    params = {"have": have, "want": want, "k": k, "ids": instances, "now": now, "wallet": wallet,
              "earnings": earnings, "revenue": revenue}
    ticks = """
        SELECT g, (%(ids)s::bigint[])[g %% %(k)s + 1] AS instance_id,
               date_trunc('minute', %(now)s::timestamptz) - (g / %(k)s + 1) * interval '60 seconds' AS ts
        FROM generate_series(%(have)s, %(want)s - 1) g
    """
    with transaction.atomic(), connection.cursor() as c:
        c.execute("SELECT coalesce(max(id), 0) FROM billing_ledgertransaction")
        params["base"] = c.fetchone()[0] + 1
        c.execute(f"""
            INSERT INTO billing_ledgertransaction (id, idempotency_key, kind, memo, reason, created_at)
            SELECT %(base)s + g - %(have)s,
                   'usage:' || instance_id || ':' || (extract(epoch FROM ts) * 1000000)::bigint,
                   'usage', 'bench', '', ts
            FROM ({ticks}) t
        """, params)
        c.execute("SELECT setval(pg_get_serial_sequence('billing_ledgertransaction', 'id'), "
                  "(SELECT max(id) FROM billing_ledgertransaction))")
        c.execute("""
            INSERT INTO billing_entry (transaction_id, account_id, amount_micros)
            SELECT %(base)s + g - %(have)s, v.account_id, v.amount
            FROM generate_series(%(have)s, %(want)s - 1) g,
                 (VALUES (%(wallet)s, -1000), (%(earnings)s, 850), (%(revenue)s, 150)) v(account_id, amount)
        """, params)
        c.execute(f"""
            INSERT INTO billing_usageinterval (instance_id, started_at, ended_at, seconds, price_per_hour_micros,
                                               platform_fee_bps, amount_micros, fee_micros, transaction_id, created_at)
            SELECT instance_id, ts, ts + interval '60 seconds', 60, 60000, 1500, 1000, 150, %(base)s + g - %(have)s,
                   ts + interval '60 seconds'
            FROM ({ticks}) t
        """, params)
        c.execute("""
            UPDATE marketplace_instance i SET billed_seconds = s.seconds
            FROM (SELECT instance_id, sum(seconds) AS seconds FROM billing_usageinterval
                  WHERE instance_id = ANY(%(ids)s) GROUP BY instance_id) s
            WHERE i.id = s.instance_id
        """, params)
        n = want - have
        c.execute("UPDATE billing_account SET balance_micros = balance_micros + CASE id WHEN %s THEN %s WHEN %s "
                  "THEN %s ELSE %s END WHERE id IN (%s, %s, %s)",
                  [wallet, -1000 * n, earnings, 850 * n, 150 * n, wallet, earnings, revenue])


def time_reads(provider, rounds: int) -> tuple[list[float], list[float], int, int]:
    """Old and new reads, interleaved (the order alternating): their times, and each way's query count."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from billing.selectors import earnings_by_node, earnings_by_node_from_ledger, earnings_for, earnings_from_ledger

    def old():
        return earnings_from_ledger(user=provider), earnings_by_node_from_ledger(user=provider)

    def new():
        return earnings_for(user=provider), earnings_by_node(user=provider)

    times: dict[str, list[float]] = {"old": [], "new": []}
    queries = {}
    for r in range(rounds):
        for name, read in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
            with CaptureQueriesContext(connection) as captured:
                t0 = time.perf_counter()
                result = read()
                times[name].append(time.perf_counter() - t0)
            queries[name] = len(captured.captured_queries)
            if name == "old":
                old_result = result
            else:
                new_result = result
        (old_earnings, old_nodes), (new_earnings, new_nodes) = old_result, new_result
        assert old_earnings == new_earnings, (old_earnings, new_earnings)
        assert {n: a for n, a in old_nodes.items() if a} == new_nodes, (old_nodes, new_nodes)
    return times["old"], times["new"], queries["old"], queries["new"]


def time_ticks(now: datetime, rounds: int) -> tuple[list[float], list[float], datetime]:
    """Metering ticks, a minute apart, the rollup's trigger enabled and disabled in turn (the order alternating)."""
    from django.db import connection

    from billing.services.metering import usage_meter

    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for enabled in (True, False) if r % 2 == 0 else (False, True):
            with connection.cursor() as c:
                c.execute(f"ALTER TABLE billing_entry {'ENABLE' if enabled else 'DISABLE'} TRIGGER {TRIGGER}")
            now += timedelta(seconds=60)
            t0 = time.perf_counter()
            result = usage_meter(now=now)
            times[enabled].append(time.perf_counter() - t0)
            assert result.intervals > 0, result
    with connection.cursor() as c:
        c.execute(f"ALTER TABLE billing_entry ENABLE TRIGGER {TRIGGER}")
    return times[True], times[False], now


def main() -> None:
    args = parse_args()
    sizes = [int(s) for s in args.ticks.split(",")]
    server = metering_bench.point_django_at_bench_db(args.db_name)
    django.setup()
    from django.core.management import call_command

    from billing.services.metering import usage_meter

    print(f"bench/earnings_history.py: database {args.db_name}, the provider's ticks {sizes} over "
          f"{args.instances} instances; ticks over {args.tick_instances:,} running instances")
    t = time.perf_counter()
    call_command("migrate", verbosity=0)
    print(f"  migrate: {time.perf_counter() - t:.1f} s")
    rng = random.Random(args.seed)
    now = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    med = statistics.median
    try:
        t = time.perf_counter()
        metering_bench.seed(rng, args.tick_instances, now)
        provider, renter, instances = seed_provider(args.instances, now)
        metering_bench.vacuum()
        print(f"  seed: {time.perf_counter() - t:.1f} s", flush=True)
        have, reads = 0, []
        for size in sizes:
            t = time.perf_counter()
            add_ticks(provider=provider, renter=renter, instances=instances, have=have, want=size, now=now)
            have = size
            metering_bench.vacuum()
            print(f"  {size:,} ticks: added in {time.perf_counter() - t:.1f} s (with the rollup's trigger)",
                  flush=True)
            old_s, new_s, old_q, new_q = time_reads(provider, args.rounds)
            reads.append((size, old_s, new_s, old_q, new_q))
            print(f"    old {med(old_s) * 1000:9.1f} ms ({min(old_s) * 1000:.1f}-{max(old_s) * 1000:.1f}, "
                  f"{old_q} queries)   new {med(new_s) * 1000:7.2f} ms ({min(new_s) * 1000:.2f}-"
                  f"{max(new_s) * 1000:.2f}, {new_q} queries)   same figures: yes", flush=True)
        for _ in range(2):  # warm-up ticks
            now += timedelta(seconds=60)
            usage_meter(now=now)
        metering_bench.vacuum()
        with_trigger, without, now = time_ticks(now, args.tick_rounds)
    finally:
        if not args.keep:
            metering_bench.drop_bench_db(server, args.db_name)

    print()
    print(f"  earnings page reads (earnings_for + earnings_by_node), median of {args.rounds} (min-max), "
          f"load now {os.getloadavg()[0]:.1f}:")
    print("    ticks        old (every entry)        new (rollup)        old / new")
    for size, old_s, new_s, _, _ in reads:
        print(f"    {size:>9,}  {med(old_s) * 1000:9.1f} ms ({min(old_s) * 1000:.0f}-{max(old_s) * 1000:.0f})"
              f"  {med(new_s) * 1000:7.2f} ms ({min(new_s) * 1000:.2f}-{max(new_s) * 1000:.2f})"
              f"  {med(old_s) / med(new_s):8.0f}x")
    print(f"  metering tick over {args.tick_instances:,} instances, batch {settings.BILLING_METER_BATCH_SIZE:,}, "
          f"{args.tick_rounds} each, interleaved:")
    print(f"    with the rollup's trigger     {med(with_trigger):6.2f} s  ({min(with_trigger):.2f}-"
          f"{max(with_trigger):.2f})")
    print(f"    without                       {med(without):6.2f} s  ({min(without):.2f}-{max(without):.2f})")
    print(f"    with / without: {med(with_trigger) / med(without):.2f}x")


if __name__ == "__main__":
    main()
