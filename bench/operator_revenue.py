#!/usr/bin/env python3
"""Benchmark of the operators' dashboard revenue figures (operations.dashboard.revenue_figures: today and month to
date, billing.selectors.revenue_between) against a month of metering's ledger.

Not a timed test: it prints figures for docs/BENCHMARKS.md. What it does:

1. creates a database of its own (`gpumarket_bench_revenue` by default; never the test or dev database), points
   Django at it and runs the migrations (the ledger's triggers are the real ones);
2. seeds --renters renters and --providers providers with their accounts, and a ledger from 00:00 UTC --days-back
   days before the 1st of this month up to now (so it spans the month boundary): --instances running instances
   ticking every minute (one usage transaction each: wallet -amount, earnings +amount - fee, revenue +fee, the
   platform's fee 15 %), an hourly storage charge per renter, a daily top-up per renter (wallet entries that are
   not sales) and a reversal of one usage transaction in 5,000 (posted an hour after it, or now), with one set-based
   INSERT per table, then VACUUM ANALYZE;
3. times one dashboard load the new way with nothing kept yet (the first load after the deploy sums the month's
   settled slots of ten minutes once) and one with its latest kept slot dropped (the load after a slot settles);
4. in --rounds rounds, interleaved (the order alternating), times the revenue figures the old way (the plain
   aggregate over every entry: billing.selectors.revenue_from_ledger, for today and for the month) and the new way
   (revenue_figures: kept slots plus the live rest), asserting the same figures every round;
5. in --page-rounds rounds, interleaved, times the whole admin index page (the dashboard, every part) through
   Django's test client as a superuser, with the old revenue read patched in and with the new one;
6. drops the database unless --keep.

The timings (steps 3-5) run holding --lock (the shared checkout's test lock) so that no test run shares the CPUs.

Run: DJANGO_SETTINGS_MODULE=config.settings.test .venv/bin/python bench/operator_revenue.py
"""
from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")

import django  # noqa: E402
import metering as metering_bench  # noqa: E402 (bench/metering.py, beside this script)

GOAL_MS = 100.0  # p95 of the dashboard's revenue figures (both windows): an operator's page in well under a second


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db-name", default="gpumarket_bench_revenue", help="database to create (%(default)s)")
    p.add_argument("--instances", type=int, default=110, help="instances ticking every minute (%(default)s)")
    p.add_argument("--renters", type=int, default=200)
    p.add_argument("--providers", type=int, default=50)
    p.add_argument("--days-back", type=int, default=3, help="days of last month in the ledger (%(default)s)")
    p.add_argument("--rounds", type=int, default=30, help="timed revenue reads per way (%(default)s)")
    p.add_argument("--page-rounds", type=int, default=10, help="timed admin pages per way (%(default)s)")
    p.add_argument("--lock", default="/tmp/gm-pytest.lock",  # noqa: S108 (the checkout's shared test lock)
                   help="held while timing ('' for none)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    return p.parse_args()


def seed(args: argparse.Namespace, now: datetime) -> tuple[datetime, dict[str, int]]:
    """The users, accounts and ledger of step 2. Returns the ledger's first moment and row counts."""
    from django.db import connection, transaction

    from billing.models import AccountKind
    from billing.services.ledger import platform_account, user_account
    from marketplace.models import User

    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    since = month - timedelta(days=args.days_back)
    minutes = int((now - since).total_seconds() // 60)
    renters = [User.objects.create(email=f"renter{i}@revenue.bench.example") for i in range(args.renters)]
    providers = [User.objects.create(email=f"provider{i}@revenue.bench.example") for i in range(args.providers)]
    wallets = [user_account(user_id=u.pk, kind=AccountKind.CUSTOMER_WALLET).pk for u in renters]
    earnings = [user_account(user_id=u.pk, kind=AccountKind.PROVIDER_EARNINGS).pk for u in providers]
    p = {"since": since, "now": now, "minutes": minutes, "k": args.instances, "wallets": wallets,
         "earnings": earnings, "nw": len(wallets), "ne": len(earnings),
         "revenue": platform_account(kind=AccountKind.PLATFORM_REVENUE).pk,
         "clearing": platform_account(kind=AccountKind.PAYMENT_CLEARING).pk}
    # Each row: (id offset, kind, key, when, wallet, earnings or NULL, amount, fee); ids from a base.
    rows = """
        SELECT g AS n, 'usage' AS kind, 'usage:' || g AS key,
               %(since)s::timestamptz + (g / %(k)s) * interval '1 minute' + (g %% %(k)s %% 60) * interval '1 second'
                   AS ts,
               (%(wallets)s::bigint[])[g %% %(k)s %% %(nw)s + 1] AS wallet,
               (%(earnings)s::bigint[])[g %% %(k)s %% %(ne)s + 1] AS earn,
               1000 + (g %% 977) * 3 AS amount
        FROM generate_series(0, %(minutes)s * %(k)s - 1) g
        UNION ALL
        SELECT %(minutes)s * %(k)s + g, 'storage', 'storage:' || g,
               %(since)s::timestamptz + (g / %(nw)s) * interval '1 hour' + interval '30 seconds',
               (%(wallets)s::bigint[])[g %% %(nw)s + 1], (%(earnings)s::bigint[])[g %% %(ne)s + 1], 5000 + g %% 101
        FROM generate_series(0, (%(minutes)s / 60) * %(nw)s - 1) g
        UNION ALL
        SELECT %(minutes)s * %(k)s + (%(minutes)s / 60) * %(nw)s + g, 'top_up', 'top_up:' || g,
               %(since)s::timestamptz + (g / %(nw)s) * interval '1 day' + interval '7 hours',
               (%(wallets)s::bigint[])[g %% %(nw)s + 1], NULL, 50000000
        FROM generate_series(0, (%(minutes)s / 1440) * %(nw)s - 1) g
    """
    with transaction.atomic(), connection.cursor() as c:
        c.execute("SELECT coalesce(max(id), 0) + 1 FROM billing_ledgertransaction")
        p["base"] = c.fetchone()[0]
        c.execute(f"CREATE TEMP TABLE bench_rows ON COMMIT DROP AS {rows}", p)
        c.execute("""
            INSERT INTO billing_ledgertransaction (id, idempotency_key, kind, memo, reason, created_at)
            SELECT %(base)s + n, key, kind, 'bench', '', ts FROM bench_rows
        """, p)
        c.execute("""
            INSERT INTO billing_entry (transaction_id, account_id, amount_micros)
            SELECT %(base)s + n, wallet, -amount FROM bench_rows WHERE kind <> 'top_up'
            UNION ALL SELECT %(base)s + n, earn, amount - amount * 15 / 100 FROM bench_rows WHERE kind <> 'top_up'
            UNION ALL SELECT %(base)s + n, %(revenue)s, amount * 15 / 100 FROM bench_rows WHERE kind <> 'top_up'
            UNION ALL SELECT %(base)s + n, wallet, amount FROM bench_rows WHERE kind = 'top_up'
            UNION ALL SELECT %(base)s + n, %(clearing)s, -amount FROM bench_rows WHERE kind = 'top_up'
        """, p)
        # Reversals: one usage transaction in 5,000, posted an hour later (or now, if that is still to come).
        c.execute("SELECT max(n) + 1 FROM bench_rows")
        p["rbase"] = p["base"] + c.fetchone()[0]
        c.execute("""
            CREATE TEMP TABLE bench_reversals ON COMMIT DROP AS
            SELECT row_number() OVER (ORDER BY n) - 1 AS r, n, LEAST(ts + interval '1 hour', %(now)s) AS ts
            FROM bench_rows WHERE kind = 'usage' AND n %% 5000 = 4999
        """, p)
        c.execute("""
            INSERT INTO billing_ledgertransaction (id, idempotency_key, kind, memo, reason, reverses_id, created_at)
            SELECT %(rbase)s + r, 'reversal:' || n, 'reversal', 'bench', 'bench', %(base)s + n, ts
            FROM bench_reversals
        """, p)
        c.execute("""
            INSERT INTO billing_entry (transaction_id, account_id, amount_micros)
            SELECT %(rbase)s + v.r, e.account_id, -e.amount_micros
            FROM bench_reversals v JOIN billing_entry e ON e.transaction_id = %(base)s + v.n
        """, p)
        c.execute("SELECT setval(pg_get_serial_sequence('billing_ledgertransaction', 'id'), "
                  "(SELECT max(id) FROM billing_ledgertransaction))")
        c.execute("""
            UPDATE billing_account a SET balance_micros = s.total
            FROM (SELECT account_id, sum(amount_micros) AS total FROM billing_entry GROUP BY account_id) s
            WHERE a.id = s.account_id
        """)
        c.execute("SELECT (SELECT count(*) FROM billing_ledgertransaction), (SELECT count(*) FROM billing_entry), "
                  "(SELECT count(*) FROM billing_entry e JOIN billing_ledgertransaction t ON t.id = e.transaction_id"
                  " WHERE t.created_at >= %(month)s)", {"month": month})
        txns, entries, month_entries = c.fetchone()
    return since, {"transactions": txns, "entries": entries, "month_entries": month_entries}


def old_figures(now: datetime) -> dict:
    """The dashboard's two windows (operations.dashboard.revenue_figures), each the plain aggregate."""
    from billing.selectors import revenue_from_ledger

    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return {"today": revenue_from_ledger(start=day, end=now),
            "month": revenue_from_ledger(start=day.replace(day=1), end=now)}


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, -(-len(xs) * 95 // 100) - 1)]


def interleaved(rounds: int, ways: dict) -> dict[str, list[float]]:
    """Each way called once a round, the order alternating; their times. A way returns something to compare."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
        results = {}
        for name, way in order:
            t0 = time.perf_counter()
            results[name] = way()
            times[name].append(time.perf_counter() - t0)
        values = list(results.values())
        assert all(v == values[0] for v in values), results
    return times


def busy_jiffies() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # less idle and iowait


def main() -> None:
    args = parse_args()
    server = metering_bench.point_django_at_bench_db(args.db_name)
    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.utils import timezone

    import operations.dashboard as dashboard
    from billing.models import RevenueSlot
    from billing.selectors import revenue_from_ledger
    from marketplace.models import User

    print(f"bench/operator_revenue.py: database {args.db_name}, {args.instances} instances ticking every minute, "
          f"{args.renters} renters, {args.providers} providers, from {args.days_back} days before the month")
    t = time.perf_counter()
    call_command("migrate", verbosity=0)
    print(f"  migrate: {time.perf_counter() - t:.1f} s")
    med = statistics.median
    lock = open(args.lock, "w") if args.lock else None  # noqa: SIM115 (held until the timings end)
    try:
        t = time.perf_counter()
        since, counts = seed(args, timezone.now())
        metering_bench.vacuum()
        print(f"  seed: {time.perf_counter() - t:.1f} s: {counts['transactions']:,} transactions, "
              f"{counts['entries']:,} entries since {since:%Y-%m-%d %H:%M}, {counts['month_entries']:,} of them "
              f"this month", flush=True)
        if lock:
            t = time.perf_counter()
            fcntl.flock(lock, fcntl.LOCK_EX)
            print(f"  waited {time.perf_counter() - t:.1f} s for {args.lock}", flush=True)
        cpu0, wall0 = busy_jiffies(), time.perf_counter()

        now = timezone.now()
        t0 = time.perf_counter()
        first = dashboard.revenue_figures(now)
        cold = time.perf_counter() - t0
        assert first == old_figures(now), (first, old_figures(now))
        kept = RevenueSlot.objects.count()
        RevenueSlot.objects.filter(pk=RevenueSlot.objects.order_by("-start").values("pk")[:1]).delete()
        now = timezone.now()
        t0 = time.perf_counter()
        dashboard.revenue_figures(now)
        one_slot = time.perf_counter() - t0
        print(f"  new, first load (nothing kept, {kept} slots of 10 minutes summed and kept): {cold * 1000:.0f} ms; "
              f"a load with one slot to sum: {one_slot * 1000:.1f} ms", flush=True)

        # Both ways read at the same `now` in a round: the figures must be equal.
        reads: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            now = timezone.now()
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                way = old_figures if name == "old" else dashboard.revenue_figures
                t0 = time.perf_counter()
                result = way(now)
                reads[name].append(time.perf_counter() - t0)
                if name == "old":
                    old_result = result
                else:
                    new_result = result
            assert old_result == new_result, (old_result, new_result)
        print(f"  revenue figures (today + month), {args.rounds} loads each, interleaved: old p50 "
              f"{med(reads['old']) * 1000:.1f} ms p95 {p95(reads['old']) * 1000:.1f} ms; new p50 "
              f"{med(reads['new']) * 1000:.2f} ms p95 {p95(reads['new']) * 1000:.2f} ms; same figures: yes", flush=True)

        admin = User.objects.create_superuser(email="ops@revenue.bench.example", password=None)
        client = Client()
        client.force_login(admin)
        new_read = dashboard.revenue_between

        def page(read):
            def load():
                dashboard.revenue_between = read
                try:
                    response = client.get("/admin/")
                finally:
                    dashboard.revenue_between = new_read
                assert response.status_code == 200, response.status_code
                return True
            return load

        try:
            page(new_read)()  # warm-up: templates, the session
        except Exception as e:  # noqa: BLE001 (the page is the rest of the project's: say so and go on)
            print(f"  admin index page: not measured ({type(e).__name__}: {e})", flush=True)
            pages = {"old": [float("nan")], "new": [float("nan")]}
        else:
            pages = interleaved(args.page_rounds, {"old": page(revenue_from_ledger), "new": page(new_read)})
            print(f"  admin index page, {args.page_rounds} loads each, interleaved: old p50 "
                  f"{med(pages['old']) * 1000:.0f} ms p95 {p95(pages['old']) * 1000:.0f} ms; new p50 "
                  f"{med(pages['new']) * 1000:.0f} ms p95 {p95(pages['new']) * 1000:.0f} ms", flush=True)
        busy = (busy_jiffies() - cpu0) / os.sysconf("SC_CLK_TCK")
        wall = time.perf_counter() - wall0
    finally:
        if lock:
            lock.close()
        if not args.keep:
            connection.close()
            metering_bench.drop_bench_db(server, args.db_name)

    ok = p95(reads["new"]) * 1000 <= GOAL_MS
    print()
    print(f"  timed phase: {wall:.0f} s wall, machine busy {busy / wall:.2f} of {os.cpu_count()} CPUs "
          f"(this process and PostgreSQL included), load now {os.getloadavg()[0]:.1f}")
    print(f"  {counts['month_entries']:,} entries this month; the dashboard's revenue figures (today + month):")
    print(f"    old (every entry)       p50 {med(reads['old']) * 1000:8.1f} ms   "
          f"p95 {p95(reads['old']) * 1000:8.1f} ms")
    print(f"    new (kept slots + live) p50 {med(reads['new']) * 1000:8.2f} ms   p95 {p95(reads['new']) * 1000:8.2f} ms"
          f"   old / new {med(reads['old']) / med(reads['new']):.0f}x")
    print(f"    new, first load after the deploy {cold * 1000:.0f} ms; a load with a slot to sum "
          f"{one_slot * 1000:.1f} ms")
    print(f"  admin index page: old p50 {med(pages['old']) * 1000:.0f} ms, new p50 {med(pages['new']) * 1000:.0f} ms")
    print(f"  goal (ours): revenue figures p95 <= {GOAL_MS:.0f} ms at this scale: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
