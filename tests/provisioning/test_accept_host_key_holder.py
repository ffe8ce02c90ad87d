"""An operator accepting a quarantined node's new host key that another node holds: a 409 naming the node that holds
it. Since a node holds its host key only once proven (node_unique_live_host_key) or among its provider's own live
nodes (node_unique_own_live_host_key), the second constraint's refusal was re-raised (a 500 in the admin), and the
first's named any live node with the key, an unproven squatter's too."""
import pytest
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Node, NodeState
from provisioning.services.verification import node_accept_host_key
from tests.factories import UserFactory, make_node

pytestmark = pytest.mark.django_db

FINGERPRINT = "SHA256:" + "K" * 43
OLD = "SHA256:" + "M" * 43


def _quarantined(provider, seen: str) -> Node:
    moved = make_node(provider, host_key_fingerprint=OLD, state=NodeState.QUARANTINED, ssh_port=2299)
    Node.objects.filter(pk=moved.pk).update(control_proven_at=timezone.now(), seen_host_key_fingerprint=seen)
    return Node.objects.get(pk=moved.pk)


def test_a_key_held_by_the_providers_own_unproven_node_is_a_409_naming_it_not_a_500():
    provider = UserFactory()
    squatter = make_node(host_key_fingerprint=FINGERPRINT, ssh_port=2201)  # another account's, unproven
    own = make_node(provider, host_key_fingerprint=FINGERPRINT, ssh_port=2202)  # the provider's own, unproven
    moved = _quarantined(provider, FINGERPRINT)
    with pytest.raises(Conflict, match=f"pinned on live node {own.pk}:"):
        node_accept_host_key(node=moved, operator_email="ops@example.com")
    assert squatter.pk != own.pk
    moved.refresh_from_db()
    assert (moved.state, moved.host_key_fingerprint) == (NodeState.QUARANTINED, OLD)


def test_a_key_held_by_a_proven_node_names_that_node_not_an_unproven_one_with_it():
    squatter = make_node(host_key_fingerprint=FINGERPRINT, ssh_port=2201)  # first by id, unproven
    holder = make_node(host_key_fingerprint=FINGERPRINT, ssh_port=2202)
    Node.objects.filter(pk=holder.pk).update(control_proven_at=timezone.now())
    moved = _quarantined(UserFactory(), FINGERPRINT)
    with pytest.raises(Conflict, match=f"pinned on live node {holder.pk}:"):
        node_accept_host_key(node=moved, operator_email="ops@example.com")
    assert squatter.pk < holder.pk


def test_a_key_only_another_accounts_unproven_node_declares_is_accepted():
    make_node(host_key_fingerprint=FINGERPRINT, ssh_port=2201)
    moved = _quarantined(UserFactory(), FINGERPRINT)
    node_accept_host_key(node=moved, operator_email="ops@example.com")
    moved.refresh_from_db()
    assert moved.host_key_fingerprint == FINGERPRINT
