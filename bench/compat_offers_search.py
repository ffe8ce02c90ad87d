#!/usr/bin/env python3
"""Benchmark of the Vast.ai-compatible offer search, `POST /compat/vast/api/v0/bundles/` (`vastai search offers`).

Not a timed test: it prints figures for docs/BENCHMARKS.md. The same data and method as bench/offers_search.py (the
native search), whose seeding it imports:

1. a database of its own (bench/benchdb.py; `gpumarket_bench_compat` by default), migrated;
2. offers_search.seed: 10,000 nodes, 60,000 GPUs, COPY; then the host facts a check measures (CPU, RAM, disk,
   driver, CUDA, PCIe, network, the PCIe bandwidth of the benchmark summary) on every checked node, which the
   native seed leaves empty and which every Vast row carries;
3. for a mix of queries as the `vastai` CLI sends them, times the request in-process through Django's test client
   and, in the same loop, the bare SQL that request ran (captured once, executed on the same connection);
4. prints p50/p95 of both, their ratio, how many nodes the SQL returned and how many offer rows Python built, and
   the goal (the native search's: p95 <= 2x the bare SQL's p95 and p95 <= 50 ms) per query, MET or NOT MET;
5. drops the database unless --keep.

With --before REV, REV's compat/vast/offers.py (git show) is loaded beside this tree's and the view is pointed at
each in turn, so both are timed in the same rounds (rotating order) on the same data, with this tree's query.py;
every query's answers must be identical (less the --differ fields), or the run stops.

Run: DJANGO_SETTINGS_MODULE=config.settings.test .venv/bin/python bench/compat_offers_search.py [--before HEAD~1]
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
import time
from types import ModuleType

import benchdb  # noqa: E402 (bench/benchdb.py, beside this script)
import django  # noqa: E402
import offers_search as native  # noqa: E402 (bench/offers_search.py: sets sys.path and DJANGO_SETTINGS_MODULE)

ROOT = native.ROOT
URL = "/compat/vast/api/v0/bundles/"
# What the CLI sends before the user's own query (vastai/cli/commands/offers.py), and its default order.
DEFAULTS = {"verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True}}
DEFAULT_ORDER = [["score", "desc"]]

# (label, the CLI command it stands for, the body it sends). No `limit` unless --limit: the server's 64.
QUERIES: list[tuple[str, dict]] = [
    ("search offers (the defaults)", {}),
    ("gpu_name=RTX_A5000 num_gpus>=1 -o dph",
     {"gpu_name": {"eq": "RTX A5000"}, "num_gpus": {"gte": 1}, "order": [["dph_total", "asc"]]}),
    ("gpu_name in [4090,3090] reliability>0.99 geo notin [CN,VN]",
     {"gpu_name": {"in": ["RTX 4090", "RTX 3090"]}, "reliability": {"gt": 0.99},
      "geolocation": {"notin": ["CN", "VN"]}}),
    ("num_gpus>=4 reliability>0.99 verified=False -o num_gpus-",
     {"num_gpus": {"gte": 4}, "reliability": {"gt": 0.99}, "verified": {"eq": False},
      "order": [["num_gpus", "desc"]]}),
    ("gpu_name=H100_SXM num_gpus=8 -o dph", {"gpu_name": {"eq": "H100 SXM"}, "num_gpus": {"eq": 8},
                                            "order": [["dph_total", "asc"]]}),
    ("geolocation=DE dph<1.0 -o dph", {"geolocation": {"eq": "DE"}, "dph_total": {"lt": 1.0},
                                       "order": [["dph_total", "asc"]]}),
    ("gpu_ram>=40 reliability>=0.98 -o reliability-,dph",
     {"gpu_ram": {"gte": 40000.0}, "reliability": {"gte": 0.98},
      "order": [["reliability", "desc"], ["dph_total", "asc"]]}),
    ("cuda_vers>=12.2 cpu_cores>=32 -o disk_bw-", {"cuda_max_good": {"gte": 12.2}, "cpu_cores": {"gte": 32},
                                                 "order": [["disk_bw", "desc"]]}),
    # The disk room left (selectors.disk_left_gb): computed for every node the filter reads.
    ("disk_space>=1000 -o dph", {"disk_space": {"gte": 1000}, "order": [["dph_total", "asc"]]}),
    ("-o dph- --limit 1000 (a price scraper)", {"order": [["dph_total", "desc"]], "limit": 1000}),
    ("--no-default -o dph --limit 200", {"no_default": True, "order": [["dph_total", "asc"]], "limit": 200}),
]


def body_of(query: dict) -> dict:
    body = {} if query.get("no_default") else dict(DEFAULTS)
    body.update({k: v for k, v in query.items() if k not in ("no_default", "order")})
    body["order"] = query.get("order", DEFAULT_ORDER)
    body["type"] = "on-demand"
    body["allocated_storage"] = 5.0
    return body


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db-name", default="gpumarket_bench_compat", help="database to create (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the database afterwards")
    p.add_argument("--requests", type=int, default=60, help="timed requests per query and tree (%(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests per query and tree (%(default)s)")
    p.add_argument("--seed", type=int, default=20240601, help="random seed of the data (%(default)s)")
    p.add_argument("--before", metavar="REV", help="also time REV's compat/vast/offers.py in the same rounds")
    p.add_argument("--differ", metavar="FIELD", action="append", default=[],
                   help="a row field the change meant to change: left out of the two trees' comparison, and a "
                        "query that names it is not compared (repeatable)")
    return p.parse_args()


def seed_host_facts() -> None:
    """What a check measures of the host, on every checked node (a mix per node id, so the data stays the same)."""
    from django.db import connection

    from marketplace.models import Node

    table = connection.ops.quote_name(Node._meta.db_table)
    with connection.cursor() as c:
        c.execute(f"""
            UPDATE {table} SET
              cpu_model = (ARRAY['AMD EPYC 7543 32-Core Processor', 'AMD EPYC 9354 32-Core Processor',
                                 'Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz'])[1 + id % 3],
              cpu_cores = (ARRAY[16, 32, 64, 128])[1 + id % 4],
              ram_gb = (ARRAY[128, 256, 512, 1024])[1 + (id / 4) % 4],
              disk_free_gb = 200 + (id * 37) % 3000,
              disk_total_gb = 200 + (id * 37) % 3000 + 100 + (id * 13) % 2000,
              disk_bandwidth_mbs = 800 + (id * 53) % 2500,
              driver_version = (ARRAY['535.183.01', '550.90.07', '560.35.03'])[1 + id % 3],
              cuda_version = (ARRAY[12020, 12040, 12060])[1 + id % 3],
              pcie_gen = 3 + id % 3, pcie_width = 16,
              net_mbps = 200 + (id * 71) % 9800,
              benchmark_summary = jsonb_build_object('median_per_gpu', jsonb_build_object(
                'h2d_gbs', 10 + (id % 150) / 10.0, 'd2h_gbs', 10 + (id % 140) / 10.0))
            WHERE verdict <> 'unverified'
        """)
        c.execute("VACUUM ANALYZE")


def load_revision(rev: str) -> ModuleType:
    """REV's compat/vast/offers.py as the module compat.vast.offers_before (its relative imports: this tree's)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:compat/vast/offers.py"], check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("compat.vast.offers_before", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "compat.vast"
    sys.modules[spec.name] = module
    exec(compile(source, f"{rev}:compat/vast/offers.py", "exec"), module.__dict__)  # noqa: S102 (our own history)
    return module


def measure(args: argparse.Namespace) -> list[dict]:
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    view = importlib.import_module("compat.vast.views.offers")  # its global `offers`: the module it searches with
    trees = {"now": view.offers}
    if args.before:
        trees = {"before": load_revision(args.before), **trees}
    client = Client()

    def post(tree: str, body: dict):
        view.offers = trees[tree]
        response = client.post(URL, json.dumps(body), content_type="application/json")
        assert response.status_code == 200, (body, response.status_code, response.content[:500])
        return response

    connection.ensure_connection()
    raw = connection.connection  # the psycopg connection Django holds: same session, same settings

    def bare(statements: list[str], nodes_read: int) -> tuple[float, int]:
        """The statements the request ran, each as it ran: a scan's server-side cursor (BEGIN, DECLARE ... CURSOR
        FOR SELECT, COMMIT as captured; its FETCHes are not) is declared and FETCHed the nodes the request read, in
        one FETCH (fewer round trips than the request's batches: the stricter baseline)."""
        total, rows = 0.0, 0
        with raw.cursor() as cur:
            for sql in statements:
                t0 = time.perf_counter()
                cur.execute(sql)
                if sql.startswith("DECLARE "):
                    cur.execute(f"FETCH FORWARD {int(nodes_read)} FROM {sql.split()[1]}")
                if cur.description is not None:
                    rows += len(cur.fetchall())
                total += time.perf_counter() - t0
        return total, rows

    results = []
    try:
        for label, query in QUERIES:
            body = body_of(query)
            sqls, built, answers, nodes_read = {}, {}, {}, {}
            for tree, module in trees.items():
                for _ in range(args.warmup):
                    post(tree, body)
                count, read = [0], [0]
                # The rows of a node, one per GPU count: `_own_fields` builds each row's own fields first (and the
                # whole row only for one that matches); a tree before it, `offer_rows` the whole rows.
                builder = "_own_fields" if hasattr(module, "_own_fields") else "offer_rows"
                build_rows, matching_rows = getattr(module, builder), module.matching_rows

                def counting(node, *more, _rows=build_rows, _count=count):
                    rows = _rows(node, *more)
                    _count[0] += len(rows)
                    return rows

                def reading(nodes, *more, _match=matching_rows, _read=read):
                    _read[0] += len(nodes)
                    return _match(nodes, *more)

                # How many rows Python builds and nodes it reads: offers_find calls both by global name.
                setattr(module, builder, counting)
                module.matching_rows = reading
                try:
                    with CaptureQueriesContext(connection) as captured:
                        answers[tree] = post(tree, body).json()["offers"]
                finally:
                    setattr(module, builder, build_rows)
                    module.matching_rows = matching_rows
                nodes_read[tree] = read[0]
                sqls[tree] = [q["sql"] for q in captured.captured_queries]
                built[tree] = count[0]
            compared = {tree: [{k: v for k, v in row.items() if k not in args.differ} for row in rows]
                        for tree, rows in answers.items()}
            named = any(field in json.dumps(query) for field in args.differ)  # its answer is what changed
            if args.before and compared["before"] != compared["now"] and not named:
                sys.exit(f"bench: {label}: the two trees answered differently "
                         f"({len(answers['before'])} and {len(answers['now'])} offers)")
            sides = [(tree, kind) for tree in trees for kind in ("request", "bare")]
            times: dict[tuple[str, str], list[float]] = {side: [] for side in sides}
            fetched = {tree: bare(sqls[tree], nodes_read[tree])[1] for tree in trees}
            for i in range(args.requests):  # interleaved, rotating: drift hits every side alike
                for tree, kind in sides[i % len(sides):] + sides[:i % len(sides)]:
                    if kind == "request":
                        t0 = time.perf_counter()
                        post(tree, body)
                        times[tree, kind].append(time.perf_counter() - t0)
                    else:
                        times[tree, kind].append(bare(sqls[tree], nodes_read[tree])[0])
            results.append({"label": label, "offers": len(answers["now"]), "times": times, "built": built,
                            "fetched": fetched, "n_queries": {tree: len(sqls[tree]) for tree in trees},
                            "bytes": len(json.dumps(answers["now"]))})
    finally:
        view.offers = trees["now"]
    return results


def report(results: list[dict], trees: list[str]) -> bool:
    ms, pct = 1000.0, native.percentile
    head = (f"{'query':<58} {'offers':>6} | " + " | ".join(
        f"{tree + ' p50':>10} {'p95':>7} {'SQL p95':>7} {'ratio':>5} {'q':>2} {'nodes':>5} {'rows':>6}"
        for tree in trees) + " | goal (now)")
    print(head)
    print("-" * len(head))
    met_all = True
    for r in results:
        cells = []
        for tree in trees:
            req, sql = r["times"][tree, "request"], r["times"][tree, "bare"]
            cells.append(f"{pct(req, 50) * ms:>10.2f} {pct(req, 95) * ms:>7.2f} {pct(sql, 95) * ms:>7.2f} "
                         f"{pct(req, 95) / pct(sql, 95):>5.2f} {r['n_queries'][tree]:>2} {r['fetched'][tree]:>5} "
                         f"{r['built'][tree]:>6}")
        req95, sql95 = pct(r["times"]["now", "request"], 95), pct(r["times"]["now", "bare"], 95)
        met = req95 <= 2 * sql95 and req95 * ms <= 50
        met_all &= met
        print(f"{r['label']:<58} {r['offers']:>6} | " + " | ".join(cells) + f" | {'MET' if met else 'NOT MET'}")
    print("-" * len(head))
    print("nodes: rows the request's SQL returned (all its statements); rows: offer rows considered in Python "
          "(one per node and GPU count: offer_rows, or _own_fields where the tree has it)")
    print(f"\ngoal, for every query: request p95 <= 2x its bare SQL p95 and <= 50 ms -> "
          f"{'MET' if met_all else 'NOT MET'} for this tree")
    return met_all


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    server = benchdb.point_django_at_bench_db(args.db_name)
    django.setup()

    from django.core.management import call_command
    from django.db import connection

    print(f"database {args.db_name} on {server['host']}:{server['port']}")
    try:
        t = time.perf_counter()
        call_command("migrate", verbosity=0, interactive=False)
        native.seed(random.Random(args.seed))
        seed_host_facts()
        print(f"migrated, seeded (offers_search.seed, COPY) and analysed in {time.perf_counter() - t:.1f} s")
        for name, value in native.row_counts():
            print(f"  {name:<44} {value}")
        with connection.cursor() as c:
            c.execute("SELECT version()")
            pg_version = c.fetchone()[0].split(",")[0]
        print(f"machine: {os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}, "
              f"{pg_version}; in-process django.test.Client"
              f"{f', this tree and {args.before}' if args.before else ''}; {args.warmup} warm-up + "
              f"{args.requests} timed requests per query and tree\n")
        t = time.perf_counter()
        load_before = os.getloadavg()
        results = measure(args)
        load_after = os.getloadavg()
        print(f"measured in {time.perf_counter() - t:.1f} s; load average (1, 5, 15 min) "
              f"{' '.join(f'{v:.2f}' for v in load_before)} before, {' '.join(f'{v:.2f}' for v in load_after)} after "
              f"on {os.cpu_count()} CPUs\n")
        report(results, ["before", "now"] if args.before else ["now"])
    finally:
        if args.keep:
            print(f"\nkept database {args.db_name} (drop it with: dropdb {args.db_name})")
        else:
            benchdb.drop_bench_db(server, args.db_name)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
