"""The operators' lists of instances and interruptions drilled down by date with Django's date_hierarchy, which on
every opening of the list read the whole table twice (found by review): MIN and MAX of a column with no index,
then SELECT DISTINCT date_trunc('year', ...) over every row (with a year chosen, every row of the year for its
months); 150 ms a page at 200,000 instances, growing with the platform's life. The drill-down is now a list filter
(marketplace/admin/renting.py, DateDrillDown) over an index on the column (migration 0036): the bounds and which
years, months and days have rows are MINs read in the index, the choices range lookups.

No timing here: what the queries read, by PostgreSQL's EXPLAIN ANALYZE of each, on a few thousand rows spread over
the years (ANALYZE'd, so the planner's choices are those of a table of that size)."""
import html
import json
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from core.admin_paginator import EstimatedCountPaginator
from marketplace.models import Instance, Interruption
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

INSTANCES = Instance._meta.db_table
INTERRUPTIONS = Interruption._meta.db_table
PAGE = 100  # the admin's list_per_page
# Three stretches of 1,000 rows: January-February 2021, 10-30 May 2023, March-May 2024 (none in 2022).
STRETCHES = [("2021-01-01", "1 hour"), ("2023-05-10", "30 minutes"), ("2024-03-01", "2 hours")]


@pytest.fixture
def ops(operator, monkeypatch):
    # The unfiltered list counted by the estimate, as a large table's is (core/admin_paginator.py): its COUNT(*)
    # is the paginator's, not the drill-down's.
    monkeypatch.setattr(EstimatedCountPaginator, "estimate_above", 1)
    return logged_in(operator)


@pytest.fixture
def rows(renter):
    instance = book(renter, make_listed_node(gpu_count=2))
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {INSTANCES} SET created_at = '2024-05-31 23:30+00' WHERE id = %s",  # noqa: S608
                       [instance.pk])
        for n, (start, step) in enumerate(STRETCHES):
            # Copies of the booked instance, destroyed, one `step` apart from `start`.
            cursor.execute(f"""
                INSERT INTO {INSTANCES}
                SELECT r.* FROM {INSTANCES} i, generate_series(1, 1000) g,
                LATERAL jsonb_populate_record(NULL::{INSTANCES}, to_jsonb(i) || jsonb_build_object(
                    'id', i.id + {n * 1000} + g, 'status', 'destroyed', 'idempotency_key', '',
                    'created_at', timestamptz '{start} 00:00+00' + g * interval '{step}')) r
                WHERE i.id = %s""", [instance.pk])  # noqa: S608 (the tests' own constants)
            cursor.execute(f"""
                INSERT INTO {INTERRUPTIONS} (instance_id, cause, detail, started_at, detected_at, ended_at, outcome,
                                             credited_seconds, credited_micros)
                SELECT %s, 'node_lost', '', t, t, t + interval '1 minute', 'resumed', 0, 0
                FROM (SELECT timestamptz '{start} 00:00+00' + g * interval '{step}' AS t
                      FROM generate_series(1, 1000) g) s""", [instance.pk])  # noqa: S608
        cursor.execute(f"SELECT setval(pg_get_serial_sequence(%s, 'id'), (SELECT max(id) FROM {INSTANCES}))",  # noqa: S608
                       [INSTANCES])
        cursor.execute(f"ANALYZE {INSTANCES}")
        cursor.execute(f"ANALYZE {INTERRUPTIONS}")
    return instance


def _rows_read(sql: str, table: str) -> int:
    """Rows PostgreSQL read from `table` to run `sql` (returned or filtered out, in every scan of it)."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def read(node) -> int:
        own = 0
        if node.get("Relation Name") == table:
            own = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
                   + node.get("Rows Removed by Index Recheck", 0)) * node["Actual Loops"]
        return own + sum(read(child) for child in node.get("Plans", []))

    return read(plan[0]["Plan"])


def _open(client, url: str, table: str):
    with CaptureQueriesContext(connection) as queries:
        page = client.get(url)
    assert page.status_code == 200, (url, page.status_code)
    read = [(_rows_read(q["sql"], table), q["sql"]) for q in queries.captured_queries
            if f'"{table}"' in q["sql"] and q["sql"].lstrip().upper().startswith("SELECT")]
    return page.content.decode(), read


def _drill_down(page: str, title: str) -> dict[str, str]:
    """The date filter's links in the sidebar: their text and query string."""
    section = page.split(f'data-filter-title="{title}"', 1)[1].split("</details>", 1)[0]
    return {html.unescape(text.strip()): html.unescape(href)
            for href, text in re.findall(r'<a href="(\?[^"]*)"[^>]*>([^<]+)</a>', section)}


@pytest.mark.parametrize(("url", "table", "title"), [
    ("/admin/marketplace/instance/", INSTANCES, "created at"),
    ("/admin/marketplace/interruption/", INTERRUPTIONS, "started at"),
])
def test_the_list_opens_reading_no_more_than_its_page(ops, rows, url, table, title):
    page, read = _open(ops, url, table)
    assert read, "the list's queries were captured"
    # Its page of rows by the primary key; the bounds and which years have rows in the column's index. The date
    # hierarchy read all 3,001 rows twice (MIN/MAX, then DISTINCT date_trunc('year')), by sequential scans.
    assert max(n for n, _ in read) <= PAGE, [(n, sql[:200]) for n, sql in read if n > PAGE]
    assert "DISTINCT" not in " ".join(sql for _, sql in read)
    links = _drill_down(page, title)
    assert [t for t in links if t.isdigit()] == ["2021", "2023", "2024"]  # 2022 has no rows


def test_the_drill_down_goes_to_a_month_and_a_day_by_the_index(ops, rows):
    url = "/admin/marketplace/instance/"
    year = _drill_down(ops.get(url).content.decode(), "created at")["2023"]
    page, read = _open(ops, url + year, INSTANCES)
    links = _drill_down(page, "created at")
    assert [t for t in links if t.endswith(" 2023") and "," not in t] == ["May 2023"]  # the year's months with rows
    probes = [(n, sql) for n, sql in read if "MIN(" in sql]
    # The bounds and each period: a row at most read in the index for each MIN and MAX.
    assert probes and all(n <= sql.count("MIN(") + sql.count("MAX(") for n, sql in probes), probes
    assert "DISTINCT" not in " ".join(sql for _, sql in read)

    page, read = _open(ops, url + links["May 2023"], INSTANCES)
    days = [t for t in _drill_down(page, "created at") if t.startswith("May ") and t.endswith(", 2023")]
    assert days == [f"May {d}, 2023" for d in range(10, 31)]  # 00:30 on the 10th to 20:00 on the 30th
    assert "1000 instances" in page
    probes = [(n, sql) for n, sql in read if "MIN(" in sql]
    assert probes and all(n <= sql.count("MIN(") + sql.count("MAX(") for n, sql in probes), probes

    page = ops.get(url + _drill_down(page, "created at")["May 30, 2023"]).content.decode()
    assert "41 instances" in page  # 00:00 to 20:00, one each half hour


def test_the_interruptions_drill_down_and_the_old_links(ops, rows):
    url = "/admin/marketplace/interruption/"
    links = _drill_down(ops.get(url).content.decode(), "started at")
    page = ops.get(url + links["2024"]).content.decode()
    months = [t for t in _drill_down(page, "started at") if t.endswith(" 2024")]
    assert months == ["March 2024", "April 2024", "May 2024"]
    assert "1000 interruptions" in page
    # The date hierarchy's links (bookmarks) still filter, as lookups of the column.
    assert "1000 interruptions" in ops.get(url + "?started_at__year=2023").content.decode()
    assert "1000 instances" in ops.get("/admin/marketplace/instance/?created_at__year=2021").content.decode()


@pytest.mark.parametrize("query", [
    "created_at__gte=9999-01-01 00:00:00%2B00:00",
    "created_at__gte=9998-12-01 00:00:00%2B00:00&created_at__lt=9999-01-01 00:00:00%2B00:00",
    "created_at__gte=0001-01-01 00:00:00%2B00:00&created_at__lt=0002-01-01 00:00:00%2B00:00",
    "created_at__gte=2023-01-01 00:00:00&created_at__lt=2024-01-01 00:00:00",  # naive
    "created_at__gte=2023-02-30 00:00:00%2B00:00&created_at__lt=2023-03-01 00:00:00%2B00:00",
    "created_at__gte=soon&created_at__lt=later",
])
@pytest.mark.filterwarnings("ignore:DateTimeField Instance.created_at received a naive datetime")
def test_a_hand_written_range_is_no_500(ops, rows, query):
    response = ops.get(f"/admin/marketplace/instance/?{query}")
    assert response.status_code == 200 or response.get("Location") == "/admin/marketplace/instance/?e=1", (
        response.status_code)
