"""Round 44 review: a node's first contact that finds its server's host key declared by another live node of the
same provider (node_unique_own_live_host_key, proven or not) is that server listed twice, a rejection naming the
host key; before, _pin_host_key looked for "node_unique_live_host_key" in the error's text, which that constraint's
name does not contain: the IntegrityError was re-raised, the job failed as the platform's fault at every retry."""
import pytest
from django.db import IntegrityError, transaction

from core.sql import constraint_violated
from marketplace.models import Node
from provisioning import sim
from provisioning.models import JobStatus
from provisioning.services.nodes import DuplicateHardware, _pin_host_key
from tests.factories import UserFactory, make_node
from tests.provisioning.test_duplicate_nodes import FINGERPRINT, register, verify

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("own-key")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module")
def server(simbase):
    return sim.node_up("rtx-a4000-x2", simbase)


def test_the_same_providers_server_under_another_name_is_rejected_at_first_contact_not_a_crash(server, simbase):
    provider = UserFactory()
    first = register(server, simbase, provider=provider, name="first")  # key declared, unproven
    assert first.host_key_fingerprint == server["host_key_fingerprint"] and first.control_proven_at is None
    second = register(server, simbase, provider=provider, pin=False, address="localhost", name="second")
    second, job = verify(second)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert second.verdict == "rejected" and "duplicate_host_key" in {
        f["code"] for f in second.verifications.first().findings}
    assert (second.host_key_fingerprint, second.control_proven_at) == ("", None)


def test_pinning_a_key_ones_own_unproven_node_declared_is_a_duplicate():
    provider = UserFactory()
    make_node(provider, host_key_fingerprint=FINGERPRINT)
    other = make_node(provider)
    with pytest.raises(DuplicateHardware) as raised:
        _pin_host_key(other, FINGERPRINT)
    assert raised.value.code == "duplicate_host_key"
    other.refresh_from_db()
    assert (other.host_key_fingerprint, other.control_proven_at) == ("", None)


def test_the_constraint_is_read_by_its_name():
    provider = UserFactory()
    make_node(provider, host_key_fingerprint=FINGERPRINT)
    other = make_node(provider)
    with pytest.raises(IntegrityError) as raised, transaction.atomic():
        Node.objects.filter(pk=other.pk).update(host_key_fingerprint=FINGERPRINT)
    assert constraint_violated(raised.value) == "node_unique_own_live_host_key"
    assert constraint_violated(IntegrityError("UNIQUE constraint failed: marketplace_node.host_key_fingerprint")) == ""
