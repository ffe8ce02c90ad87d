"""Round 47: the instance page offers Start and Restart only where the service takes them for the node's sake,
and says the service's own reason where not (its node in maintenance, quarantined, retired, its provider
deactivated...); the verbs the node does not stand in the way of stay offered."""
import pytest
from django.test import Client

from core.errors import Conflict
from marketplace.models import InstanceStatus, Node, NodeState, User
from marketplace.services import instances as svc
from marketplace.services.instances.lifecycle import instance_restart_refusal, instance_start_refusal
from tests.api_contract import world
from tests.factories import UserFactory
from tests.web.conftest import fund

pytestmark = pytest.mark.django_db


def _page(instance) -> tuple[str, Client]:
    web = Client()
    web.force_login(instance.renter)
    return web.get(f"/instances/{instance.pk}/").content.decode(), web


def _refused(verb, instance) -> str:
    with pytest.raises(Conflict) as refused:
        getattr(svc, f"instance_{verb}")(instance=instance)
    return refused.value.message


@pytest.mark.parametrize("change", [
    {"state": NodeState.MAINTENANCE},
    {"state": NodeState.QUARANTINED},
    {"state": NodeState.OFFLINE, "health_failures": 1},
    {"health_failures": 1},
])
def test_start_is_not_offered_where_the_node_refuses_it_and_the_page_says_why(change):
    renter = UserFactory()
    fund(renter, 100)
    node = world.listed_node(UserFactory())
    stopped = world.stopped_instance(renter, on=node)
    Node.objects.filter(pk=node.pk).update(**change)
    page, web = _page(stopped)
    said = _refused("start", stopped)
    stopped.refresh_from_db()
    assert stopped.status == InstanceStatus.STOPPED
    # Old code: "Start" offered (a form posting to the start URL), then the click refused with `said`.
    assert f"/instances/{stopped.pk}/start/" not in page, said
    assert 'id="start-refused"' in page and said.replace("'", "&#x27;") in page
    assert instance_start_refusal(instance=stopped) == said  # the service's own words, one check
    assert f"/instances/{stopped.pk}/destroy/" in page  # destroying it stays offered
    live = web.get(f"/instances/{stopped.pk}/live/").content.decode()  # the polled part says the same
    assert f"/instances/{stopped.pk}/start/" not in live and 'id="start-refused"' in live


def test_start_is_not_offered_when_the_provider_was_deactivated():
    renter, provider = UserFactory(), UserFactory()
    fund(renter, 100)
    stopped = world.stopped_instance(renter, on=world.listed_node(provider))
    User.objects.filter(pk=provider.pk).update(is_active=False)
    page, _ = _page(stopped)
    said = _refused("start", stopped)
    assert f"/instances/{stopped.pk}/start/" not in page and 'id="start-refused"' in page
    assert "provider account was deactivated" in said and instance_start_refusal(instance=stopped) == said


def test_restart_is_not_offered_on_a_quarantined_node_but_stop_and_destroy_are():
    renter = UserFactory()
    fund(renter, 100)
    node = world.listed_node(UserFactory())
    running = world.running_instance(renter, on=node)
    Node.objects.filter(pk=node.pk).update(state=NodeState.QUARANTINED)
    page, _ = _page(running)
    said = _refused("restart", running)
    assert f"/instances/{running.pk}/restart/" not in page, said  # old code: offered, then refused
    assert 'id="restart-refused"' in page and instance_restart_refusal(instance=running) == said
    assert f"/instances/{running.pk}/stop/" in page and f"/instances/{running.pk}/destroy/" in page


def test_a_node_that_takes_them_keeps_start_and_restart_offered():
    renter = UserFactory()
    fund(renter, 100)
    node = world.listed_node(UserFactory())
    running = world.running_instance(renter, on=node)
    page, _ = _page(running)
    assert f"/instances/{running.pk}/restart/" in page and "-refused" not in page
    stopped = world.stopped_instance(renter, on=node)
    page, _ = _page(stopped)
    assert f"/instances/{stopped.pk}/start/" in page and "-refused" not in page
    assert instance_start_refusal(instance=stopped) == "" and instance_restart_refusal(instance=running) == ""
    svc.instance_start(instance=stopped)
