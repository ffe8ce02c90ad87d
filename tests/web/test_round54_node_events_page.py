"""The provider's server page lists its recent events (provisioning/node_event_kinds.py: the kinds a provider may
see, each with its title, the stored message only where it is safe). Before, only operators saw node events (the
admin); the page said nothing of its server going offline, losing a GPU or failing a spot check."""
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from marketplace.models import NodeState, Verdict
from marketplace.web.providers import RECENT_EVENTS
from provisioning.models import NodeEvent
from tests.factories import make_node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def _event(node, kind, message, level=NodeEvent.Level.INFO, minutes_ago=0):
    return NodeEvent.objects.create(node=node, kind=kind, message=message, level=level,
                                    created_at=timezone.now() - timedelta(minutes=minutes_ago))


def _events_section(page: str) -> str:
    start = page.index('id="events-h"')
    return page[start:page.index("</section>", start)]


@pytest.fixture
def node(renter):
    return make_node(renter, name="rack1", state=NodeState.ACTIVE, verdict=Verdict.VERIFIED)


def test_the_provider_sees_recent_events_newest_first(web, node):
    _event(node, "offline", "3 health checks failed in a row: connection refused", NodeEvent.Level.WARNING, 30)
    _event(node, "back_online", "The node answers health checks again.", minutes_ago=20)
    _event(node, "unlisted_by_operator", "Unlisted by an operator (ops-alice@platform.example). Reason: x",
           NodeEvent.Level.WARNING, 10)
    _event(node, "verified_unverified", "operator-only words", minutes_ago=5)  # operator-only
    _event(node, "some_internal_kind", "renter bob@example.com", minutes_ago=1)  # in no registry
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    section = _events_section(page)
    assert "Recent events" in section
    assert section.index("Taken off the offers by an operator") < section.index("Back online") \
        < section.index("Went offline: health checks failed")
    assert "3 health checks failed in a row: connection refused" in section
    assert "The node answers health checks again." in section
    assert "critical" not in section and "warning" in section
    for hidden in ("ops-alice@platform.example", "operator-only words", "bob@example.com", "some_internal_kind"):
        assert hidden not in page, hidden


def test_only_the_latest_are_listed_in_a_bounded_number_of_queries(web, node):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert web.get(f"/nodes/{node.pk}/").status_code == 200
        return len(captured)

    _event(node, "spot_check_passed", "Spot check 0 passed.", minutes_ago=100)
    queries()
    few = queries()
    for n in range(1, RECENT_EVENTS + 10):
        _event(node, "spot_check_passed", f"Spot check {n} passed.", minutes_ago=100 - n)
    assert queries() == few
    section = _events_section(web.get(f"/nodes/{node.pk}/").content.decode())
    assert section.count("<tr><td>") == RECENT_EVENTS
    assert f"Spot check {RECENT_EVENTS + 9} passed." in section and "Spot check 9 passed." not in section


def test_no_events_yet(web, node):
    assert "Nothing has happened to this server yet." in web.get(f"/nodes/{node.pk}/").content.decode()


def test_another_providers_events_are_not_theirs_to_see(stranger, node):
    _event(node, "gpu_lost", "GPU 1 lost", NodeEvent.Level.CRITICAL)
    assert logged_in(stranger).get(f"/nodes/{node.pk}/").status_code == 404
