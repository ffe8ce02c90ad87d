"""Round 47: the server page offers "Retire…" only where node_retire takes it, and says the service's own reason
where not; the refusal's verb agrees with what is held; a quarantined node's deleting volume waits on an
operator's key acceptance, not "a few minutes"."""
import pytest
from django.test import Client

from core.errors import Conflict
from marketplace.models import Node, NodeState, VolumeState
from marketplace.services import nodes as node_svc
from marketplace.services.volumes import volume_delete
from tests.api_contract import world
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _page(node) -> str:
    web = Client()
    web.force_login(node.provider)
    return web.get(f"/nodes/{node.pk}/").content.decode()


def _refusal(node) -> str:
    with pytest.raises(Conflict) as refused:
        node_svc.node_retire(node=node)
    node.refresh_from_db()
    assert node.state != NodeState.RETIRED
    return refused.value.message


def test_retire_is_not_offered_where_the_service_refuses_and_the_page_says_why():
    node = world.listed_node(UserFactory())  # 16 GPUs, none rented
    world.volume(UserFactory(), on=node)     # a renter's volume: node_retire refuses
    page = _page(node)
    said = _refusal(node)
    # Old code: the page offered "Retire… / Yes, retire it" (a form posting to the retire URL); the click was refused.
    assert f"/nodes/{node.pk}/retire/" not in page, said
    assert 'id="retire-refusal"' in page
    assert said.replace("'", "&#x27;") in page  # the service's own sentence, escaped as the template does
    assert "1 volume keeps a renter's data on it" in said and "once its renter has deleted it" in said  # was "keep"


def test_retire_is_offered_on_a_node_with_nothing_of_a_renters_on_it():
    node = world.listed_node(UserFactory())
    page = _page(node)
    assert f"/nodes/{node.pk}/retire/" in page and 'id="retire-refusal"' not in page
    assert node_svc.node_retire_refusal(node=node) == ""
    node_svc.node_retire(node=node)


def test_several_held_things_keep_the_plural():
    renter = UserFactory()
    node = world.listed_node(UserFactory())
    world.volume(renter, on=node)
    world.volume(renter, on=node)
    assert "2 volumes keep renters' data on it" in _refusal(node)
    assert "once their renters have deleted them" in _refusal(node)
    assert node_svc.node_retire_refusal(node=node) == _refusal(node)


def test_a_quarantined_nodes_deleting_volume_waits_on_the_host_key_not_minutes():
    node = world.listed_node(UserFactory())
    volume = world.volume(UserFactory(), on=node)
    Node.objects.filter(pk=node.pk).update(state=NodeState.QUARANTINED)  # its SSH host key changed
    node.refresh_from_db()
    volume = volume_delete(volume=volume, confirm=volume.name)  # left deleting: no job talks to the node
    assert volume.state == VolumeState.DELETING
    said = _refusal(node)
    # Old code: "...still deleting 1 volume on it; try again in a few minutes" (it never finishes until the key is
    # accepted and the node verified again).
    assert "still deleting 1 volume on it" in said and "a few minutes" not in said, said
    assert "once an operator has accepted its new host key" in said
    page = _page(node)
    assert f"/nodes/{node.pk}/retire/" not in page and "accepted its new host key" in page
