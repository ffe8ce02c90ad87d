"""The funds check's committed rate reads a renter's counted instances through the partial index that holds only
those (instance_renter_live_idx), also as the generic plan of a prepared statement: a renter's history of destroyed
instances is never read. Before, it was read twice per booking (bench/booking.py --history, docs/BENCHMARKS.md)."""
from django.db import connection

from marketplace.services.funds import _COMMITTED_RATE_STARTING_SQL, COMMITTED_RATE_SQL


def plan(sql: str, params: list) -> str:
    with connection.cursor() as c:
        c.execute("SET LOCAL enable_seqscan = off")  # a test table is small: make the planner show its index choice
        c.execute("SET LOCAL plan_cache_mode = force_generic_plan")  # as a prepared statement's plan, params unknown
        c.execute(f"PREPARE rate_plan AS {sql.replace('%s', '$1', 1).replace('%s', '$2', 1)}")
        try:
            c.execute(f"EXPLAIN EXECUTE rate_plan({', '.join(['%s'] * len(params))})", params)
            return "\n".join(row[0] for row in c.fetchall())
        finally:
            c.execute("DEALLOCATE rate_plan")


def test_the_committed_rate_reads_only_the_renters_counted_instances(db):
    for sql, params in ((COMMITTED_RATE_SQL, [1]), (_COMMITTED_RATE_STARTING_SQL, [1, 2])):
        shown = plan(sql, params)
        assert "instance_renter_live_idx" in shown, shown
