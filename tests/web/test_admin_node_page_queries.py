"""A node's admin page reads its GPU rows with their models: each row's read-only model column was one more query
per GPU (found by review), 16 queries on an 8-GPU server's page for 9 on a 1-GPU one's."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests.factories import make_listed_node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def _count(client, url) -> tuple[int, list[str]]:
    client.get(url)  # caches warmed (content types, the session) before the count
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return len(queries.captured_queries), [query["sql"][:160] for query in queries.captured_queries]


def test_the_node_page_queries_do_not_grow_with_its_gpus(operator):
    client = logged_in(operator)
    small, big = make_listed_node(gpu_count=1), make_listed_node(gpu_count=8)
    one, _ = _count(client, f"/admin/marketplace/node/{small.pk}/change/")
    eight, sqls = _count(client, f"/admin/marketplace/node/{big.pk}/change/")
    assert eight == one, (one, eight, sqls)
