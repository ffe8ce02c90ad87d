"""The admin's lists of the largest tables (found by review): the usage intervals' list sorted by a column no index
serves, joined every relation of each row (Django's select_related() with no names: the instance's renter, node,
provider, GPU models) and counted the whole table twice per page, 2 s a page at 2 million rows and growing. Now it
reads newest first by the primary key, joins only the instance it shows, and counts neither the whole table (an
estimate when unfiltered and large) nor twice; the ledger transactions' list counts the same way. No timing here:
what the queries are."""
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import LedgerTransaction, UsageInterval
from billing.services.ledger import credit_grant
from core.admin_paginator import EstimatedCountPaginator
from marketplace.models import Instance
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

USAGE = f'"{UsageInterval._meta.db_table}"'
LEDGER = f'"{LedgerTransaction._meta.db_table}"'


@pytest.fixture
def ops(operator):
    return logged_in(operator)


@pytest.fixture
def intervals(renter):
    instance = book(renter, make_listed_node(gpu_count=2))
    end = timezone.now()
    rows = []
    for n in range(3):  # the newest interval first by id, oldest by its start: the order is the id's
        started = end - timedelta(hours=n + 1)
        rows.append(UsageInterval.objects.create(
            instance=instance, started_at=started, ended_at=started + timedelta(minutes=30), seconds=1800,
            price_per_hour_micros=1_000_000, platform_fee_bps=1000, amount_micros=500_000, fee_micros=50_000))
    return rows


def _analysed(table: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")  # noqa: S608 (a model's table)


def _counts(queries, table: str) -> list[str]:
    return [q["sql"] for q in queries.captured_queries
            if q["sql"].lstrip().upper().startswith("SELECT COUNT(") and f"FROM {table}" in q["sql"]]


def test_the_usage_list_joins_only_the_instance_sorts_by_id_and_counts_once(ops, intervals):
    with CaptureQueriesContext(connection) as queries:
        page = ops.get("/admin/billing/usageinterval/")
    assert page.status_code == 200
    rows = [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f"SELECT {USAGE}.")]
    assert len(rows) == 1, rows
    assert rows[0].count(" JOIN ") == 1 and f'JOIN "{Instance._meta.db_table}"' in rows[0]
    assert rows[0].split(" ORDER BY ")[1].startswith(f'{USAGE}."id" DESC')
    assert len(_counts(queries, USAGE)) == 1, "one count (the paginator's), no second 'N total' count"
    html = page.content.decode()
    ids = [html.index(f"/admin/billing/usageinterval/{row.pk}/change/") for row in intervals]
    assert ids == sorted(ids, reverse=True)  # newest (highest id) first
    assert f"instance {intervals[0].instance_id}" in html


def test_a_large_unfiltered_list_is_counted_by_the_estimate(ops, intervals, monkeypatch):
    monkeypatch.setattr(EstimatedCountPaginator, "estimate_above", 1)
    _analysed(USAGE)
    with CaptureQueriesContext(connection) as queries:
        page = ops.get("/admin/billing/usageinterval/")
    assert page.status_code == 200
    assert _counts(queries, USAGE) == [], "no COUNT(*) over the whole table"
    assert "3 usage intervals" in page.content.decode()
    # Filtered, the count is exact (and reads only what the filter keeps).
    with CaptureQueriesContext(connection) as queries:
        page = ops.get("/admin/billing/usageinterval/", {"ended_at__gte": str(timezone.now() - timedelta(days=1))})
    assert page.status_code == 200
    counts = _counts(queries, USAGE)
    assert len(counts) == 1 and " WHERE " in counts[0]


def test_the_ledger_list_is_counted_by_the_estimate_too(ops, renter, monkeypatch):
    for n in range(3):
        credit_grant(user=renter, amount_micros=1_000_000, reason=f"tests {n}")
    monkeypatch.setattr(EstimatedCountPaginator, "estimate_above", 1)
    _analysed(LEDGER)
    with CaptureQueriesContext(connection) as queries:
        page = ops.get("/admin/billing/ledgertransaction/")
    assert page.status_code == 200
    assert _counts(queries, LEDGER) == []
    assert page.content.decode().count("/admin/billing/ledgertransaction/") >= 3


def test_a_small_or_never_analysed_table_is_counted_exactly():
    assert EstimatedCountPaginator(UsageInterval.objects.order_by("-id"), 100).count == 0
    assert EstimatedCountPaginator([1, 2, 3], 2).count == 3
