"""An id searched in the admin lists is matched exactly, never with LIKE '%N%' on the id cast to text (review r46b
#3: the usage-interval list's "instance__id" read the whole, largest, table, and searching for instance 5 listed the
intervals of instances 15, 50, 105, ...). The webhook deliveries' event id (a UUID) likewise."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("changelist", "table", "column", "term"), [
    ("billing/usageinterval", "billing_usageinterval", "instance_id", "5"),
    ("notifications/webhookdelivery", "notifications_webhookdelivery", "event_id", "5"),
])
def test_an_id_search_is_an_exact_match_not_a_like(changelist, table, column, term):
    op = UserFactory(is_staff=True, is_superuser=True)
    with CaptureQueriesContext(connection) as queries:
        assert logged_in(op).get(f"/admin/{changelist}/", {"q": term}).status_code == 200
    sql = [q["sql"] for q in queries.captured_queries if f'FROM "{table}"' in q["sql"]]
    assert sql
    assert not any((f'"{column}"' in s and "LIKE" in s and f'"{column}"::text) LIKE' in s) for s in sql), sql[0]
