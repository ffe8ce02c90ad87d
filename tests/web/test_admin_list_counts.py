"""The admin's lists count what each row shows (an account's nodes, a node's free GPUs) for the rows shown, without
making their count queries join every related row: the counts of all accounts (the paginator's, and the "N total"
one) ran over a GROUP BY of every account joined with its nodes, and the node list's over every node's GPUs."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from marketplace.models import Node, User
from tests.factories import UserFactory, make_listed_node, make_node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def test_the_user_lists_counts_do_not_read_the_nodes_and_each_row_shows_its_node_count(operator):
    provider = UserFactory(email="provider@example.com")
    make_listed_node(provider, name="a", gpu_count=1)
    make_node(provider, name="b", gpu_count=1)
    UserFactory(email="renter@example.com")
    client = logged_in(operator)
    with CaptureQueriesContext(connection) as queries:
        page = client.get("/admin/marketplace/user/")
    assert page.status_code == 200
    users, nodes = f'"{User._meta.db_table}"', f'"{Node._meta.db_table}"'
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"] and users in q["sql"]
              and "GROUP BY" not in q["sql"].split("FROM", 1)[0]]
    counts = [sql for sql in counts if sql.lstrip().upper().startswith("SELECT COUNT(")]
    assert counts, "the list counts its accounts"
    assert [sql for sql in counts if nodes in sql] == [], "a count of the accounts reads every account's nodes"
    html = page.content.decode()
    row = html.split("provider@example.com</a>", 1)[1].split("</tr>", 1)[0]
    assert '<td class="field-node_count">2</td>' in row
    row = html.split("renter@example.com</a>", 1)[1].split("</tr>", 1)[0]
    assert '<td class="field-node_count">0</td>' in row


def test_the_user_list_sorts_by_node_count(operator):
    provider = UserFactory(email="zz-provider@example.com")
    make_listed_node(provider, name="a", gpu_count=1)
    UserFactory(email="aa-renter@example.com")
    html = logged_in(operator).get("/admin/marketplace/user/", {"o": "-4"}).content.decode()
    assert html.index("zz-provider@example.com") < html.index("aa-renter@example.com")


def test_the_node_lists_counts_do_not_read_the_gpus_and_each_row_shows_its_free_gpus(operator, renter):
    """The same cause on the node list: Count("gpus", filter=free) joined every GPU in both counts of nodes."""
    from marketplace.models import Gpu, GpuStatus

    busy = make_listed_node(UserFactory(), name="busy-node", gpu_count=4)
    Gpu.objects.filter(node=busy, index__in=[0, 1, 2]).update(status=GpuStatus.UNAVAILABLE)
    make_listed_node(UserFactory(), name="idle-node", gpu_count=2)
    client = logged_in(operator)
    with CaptureQueriesContext(connection) as queries:
        page = client.get("/admin/marketplace/node/")
    assert page.status_code == 200
    nodes, gpus = f'"{Node._meta.db_table}"', f'"{Gpu._meta.db_table}"'
    counts = [q["sql"] for q in queries.captured_queries
              if q["sql"].lstrip().upper().startswith("SELECT COUNT(") and nodes in q["sql"]]
    assert counts, "the list counts its nodes"
    assert [sql for sql in counts if gpus in sql] == [], "a count of the nodes reads every node's GPUs"
    html = page.content.decode()
    assert '<td class="field-gpus_free">1</td>' in html.split("busy-node", 1)[1].split("</tr>", 1)[0]
    assert '<td class="field-gpus_free">2</td>' in html.split("idle-node", 1)[1].split("</tr>", 1)[0]
    html = client.get("/admin/marketplace/node/", {"o": "5"}).content.decode()  # by free GPUs, fewest first
    assert html.index("busy-node") < html.index("idle-node")
