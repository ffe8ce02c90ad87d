"""The earnings page lists a provider's retired servers (they earned) without a link: a retired server's page is a
404 (marketplace.selectors.nodes_for_user leaves retired nodes out). It says when the server was retired."""
from datetime import UTC, datetime

import pytest

from marketplace.models import Node
from tests.factories import make_listed_node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def test_a_retired_server_is_named_not_linked(renter):
    live = make_listed_node(renter, name="still-here")
    gone = make_listed_node(renter, name="long-gone")
    Node.objects.filter(pk=gone.pk).update(state="retired", listed=False,
                                           state_changed_at=datetime(2026, 2, 3, 4, 5, tzinfo=UTC))
    web = logged_in(renter)
    page = web.get("/earnings/").content.decode()
    assert f'href="/nodes/{live.pk}/"' in page
    assert f'href="/nodes/{gone.pk}/"' not in page
    assert "long-gone" in page and "retired 2026-02-03 UTC" in page
    assert web.get(f"/nodes/{gone.pk}/").status_code == 404  # why it has no link
