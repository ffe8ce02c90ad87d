"""The admin's lists of tables that grow with the fleet's life (jobs, node events, verification runs, Stripe events,
billing events, top-ups; then instances, interruptions, volumes, refunds, disputes, payouts, cards, API keys, SSH keys
and webhook endpoints) sorted the whole table on every page (found by review): their order, -created_at
(-received_at, -started_at, -period_start), starts no index, and each page counted the table twice (the paginator,
then the "N total"). They are now read newest first by the primary key, as the usage intervals', the ledger's, the
notifications' and the webhook deliveries' lists already were: an index serves the order, the unfiltered count is
PostgreSQL's estimate once large (core/admin_paginator.py) and there is no second count."""
import re

import pytest
from django.contrib import admin
from django.db import connection
from django.test.utils import CaptureQueriesContext

from core.admin_paginator import EstimatedCountPaginator
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

LISTS = ["provisioning/job", "provisioning/nodeevent", "provisioning/verificationrun", "billing/stripeevent",
         "billing/billingevent", "billing/topup", "billing/ledgertransaction", "billing/usageinterval",
         "notifications/notification", "notifications/webhookdelivery",
         "marketplace/instance", "marketplace/interruption", "marketplace/volume", "billing/refund", "billing/dispute",
         "billing/payout", "billing/card", "marketplace/apikey", "marketplace/sshkey", "notifications/webhookendpoint"]


def _leading_index_columns(table):
    with connection.cursor() as cursor:
        cursor.execute("""SELECT a.attname FROM pg_index i JOIN pg_attribute a
                          ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                          WHERE i.indrelid = %s::regclass AND i.indpred IS NULL""", [table])
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.parametrize("changelist", LISTS)
def test_a_list_page_is_read_in_an_order_an_index_serves(operator, changelist):
    app, model = changelist.split("/")
    table = f"{app}_{model}"
    with CaptureQueriesContext(connection) as queries:
        assert logged_in(operator).get(f"/admin/{changelist}/").status_code == 200
    sql = next(q["sql"] for q in queries.captured_queries
               if q["sql"].startswith(f'SELECT "{table}".') and "ORDER BY" in q["sql"])
    first = re.search(r'ORDER BY "?(\w+)"?\."?(\w+)"?', sql)
    assert first and first[1] == table
    assert first[2] in _leading_index_columns(table), f"{changelist}: every page sorts by {first[2]}"


def _counts_of(queries, table: str) -> list[str]:
    return [q["sql"] for q in queries.captured_queries
            if q["sql"].lstrip().upper().startswith("SELECT COUNT(") and f'FROM "{table}"' in q["sql"]]


@pytest.mark.parametrize("changelist", LISTS)
def test_a_list_page_counts_its_table_once_at_most(operator, changelist):
    """One count per page (the paginator's, PostgreSQL's estimate instead once the table is large and unfiltered),
    not a second one for "N total"."""
    app, model = changelist.split("/")
    model_admin = next(admin_ for m, admin_ in admin.site._registry.items() if m._meta.label_lower == f"{app}.{model}")
    assert model_admin.paginator is EstimatedCountPaginator and not model_admin.show_full_result_count
    with CaptureQueriesContext(connection) as queries:
        assert logged_in(operator).get(f"/admin/{changelist}/").status_code == 200
    assert len(_counts_of(queries, f"{app}_{model}")) <= 1
