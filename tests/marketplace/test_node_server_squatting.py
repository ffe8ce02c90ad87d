"""A node reserves its server (its address and port, its host key) only once it proved it controls it: the platform
logged in to it with the node's own key and pinned its host key at first contact (Node.control_proven_at).

Before, every node not retired did, pending ones that never proved anything included (found by review): anyone with
a verified account could register another provider's server (its address, or the host key `ssh-keyscan` reads)
first and keep its owner out for good (with the host key, the owner's node could never pass verification), and the
409/400 at registration told any account whether a server was on the platform. Now registering looks only at the
registrant's own nodes; a server another proven live node holds is refused at the later node's first contact, once
its registrant proved control, under the same unique constraints (race-free)."""
import pytest
from django.apps import apps
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from core.api.scopes import PROVIDER
from marketplace.models import Node, NodeState, Verdict
from marketplace.services.accounts import api_key_create
from marketplace.services.nodes import node_retire
from provisioning.models import NodeEvent
from provisioning.services.nodes import DuplicateHardware, _pin_host_key
from tests.factories import UserFactory, make_node
from tests.marketplace.test_api_nodes import URL, valid_payload
from tests.provisioning.test_duplicate_nodes import _hold_then_second, assert_names_no_other_account

pytestmark = pytest.mark.django_db

VICTIM_FP = "SHA256:" + "A" * 42 + "E"
OTHER_FP = "SHA256:" + "B" * 42 + "E"


def _client(user, scopes=None):
    raw = api_key_create(user=user, name="k", scopes=scopes)[1]
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return c


def _provider():
    return _client(UserFactory(), [PROVIDER])


def _prove(node: Node) -> None:
    """What a first contact records (the platform logged in with the node's key)."""
    Node.objects.filter(pk=node.pk).update(control_proven_at=timezone.now())


# ------------------------------------------------------------------------------- the reviewer's reproduction

def test_an_unproven_pending_node_does_not_reserve_someone_elses_server_address():
    squatter, owner = _provider(), _provider()
    assert squatter.post(URL, valid_payload(), format="json").status_code == 201
    r = owner.post(URL, valid_payload(name="my own server"), format="json")
    assert r.status_code == 201, (r.status_code, r.content)


def test_an_unproven_pending_node_does_not_reserve_someone_elses_host_key():
    squatter, owner = _provider(), _provider()
    assert squatter.post(URL, valid_payload(ssh_port=2223, host_key_fingerprint=VICTIM_FP),
                         format="json").status_code == 201
    r = owner.post(URL, valid_payload(host_key_fingerprint=VICTIM_FP, name="my own server"), format="json")
    assert r.status_code == 201, (r.status_code, r.content)


def test_an_unproven_pending_node_does_not_block_pinning_the_owners_host_key_at_first_contact():
    squatter, owner = _provider(), _provider()
    assert squatter.post(URL, valid_payload(ssh_port=2223, host_key_fingerprint=VICTIM_FP),
                         format="json").status_code == 201
    node_id = owner.post(URL, valid_payload(name="my own server"), format="json").json()["id"]
    _pin_host_key(Node.objects.get(pk=node_id), VICTIM_FP)
    node = Node.objects.get(pk=node_id)
    assert node.host_key_fingerprint == VICTIM_FP and node.control_proven_at is not None


def test_an_unproven_node_at_the_same_address_does_not_block_the_owners_first_contact():
    squatter, owner = _provider(), _provider()
    assert squatter.post(URL, valid_payload(host_key_fingerprint=VICTIM_FP), format="json").status_code == 201
    node = Node.objects.get(pk=owner.post(URL, valid_payload(name="mine"), format="json").json()["id"])
    _pin_host_key(node, OTHER_FP)
    node.refresh_from_db()
    assert (node.host_key_fingerprint, node.control_proven_at is not None) == (OTHER_FP, True)


# --------------------------------------------------------------------------------- registration tells nothing

def test_registering_a_server_another_accounts_proven_node_holds_tells_nothing():
    """No answer at registration depends on another account's nodes, proven or not."""
    holder = make_node(address="localhost", ssh_port=2222, host_key_fingerprint=VICTIM_FP, name="holder-zz9",
                       state=NodeState.ACTIVE, verdict=Verdict.VERIFIED)
    _prove(holder)
    other = _provider()
    for payload in (valid_payload(), valid_payload(ssh_port=2223, host_key_fingerprint=VICTIM_FP)):
        r = other.post(URL, payload, format="json")
        assert r.status_code == 201, r.content
        assert_names_no_other_account(r.content.decode(), holder)


def test_the_same_owner_registering_a_server_twice_is_still_told_at_once():
    """About one's own nodes the answer leaks nothing: the same address and port is a 409, the same host key a 400
    on that field, proven or not, and nothing is written."""
    user = UserFactory()
    owner = _client(user, [PROVIDER])
    first = owner.post(URL, valid_payload(host_key_fingerprint=VICTIM_FP), format="json").json()["id"]
    for proven in (False, True):
        if proven:
            _prove(Node.objects.get(pk=first))
        before = Node.objects.count()
        r = owner.post(URL, valid_payload(name="again"), format="json")
        assert r.status_code == 409 and "localhost:2222" in r.json()["detail"], r.content
        r = owner.post(URL, valid_payload(ssh_port=2223, host_key_fingerprint=VICTIM_FP), format="json")
        assert r.status_code == 400 and list(r.json()) == ["host_key_fingerprint"], r.content
        assert Node.objects.count() == before
    assert owner.delete(f"{URL}{first}/").status_code == 204
    assert owner.post(URL, valid_payload(host_key_fingerprint=VICTIM_FP), format="json").status_code == 201


# ------------------------------------------------------------------ a proven node keeps its server (first contact)

def test_a_proven_nodes_address_cannot_be_taken_at_another_nodes_first_contact():
    holder = make_node(address="localhost", ssh_port=2222, name="holder-zz9")
    _pin_host_key(holder, VICTIM_FP)
    later = Node.objects.get(pk=_provider().post(URL, valid_payload(), format="json").json()["id"])
    with pytest.raises(DuplicateHardware) as raised:
        _pin_host_key(later, OTHER_FP)  # the same address and port, another host key
    assert raised.value.code == "duplicate_address" and not raised.value.transient
    assert "localhost:2222" in raised.value.message and "another live node" in raised.value.message.lower()
    assert_names_no_other_account(raised.value.message, holder)
    later.refresh_from_db()
    assert (later.host_key_fingerprint, later.control_proven_at) == ("", None)  # nothing pinned
    assert not NodeEvent.objects.filter(node=later, kind="host_key_pinned").exists()


def test_a_proven_nodes_host_key_cannot_be_taken_at_another_nodes_first_contact():
    holder = make_node(name="holder-zz9")
    _pin_host_key(holder, VICTIM_FP)
    later = make_node(host_key_fingerprint=VICTIM_FP)  # declared at registration: accepted (tells nothing)
    with pytest.raises(DuplicateHardware) as raised:
        _pin_host_key(later, VICTIM_FP)
    assert raised.value.code == "duplicate_host_key"
    assert_names_no_other_account(raised.value.message, holder)
    later.refresh_from_db()
    assert later.control_proven_at is None

    node_retire(node=holder)  # retired, it lets the server go
    _pin_host_key(later, VICTIM_FP)
    later.refresh_from_db()
    assert later.control_proven_at is not None
    event = NodeEvent.objects.get(node=later, kind="host_key_pinned")
    assert "given at registration" in event.message


def test_of_two_pending_nodes_at_one_address_the_first_to_prove_control_wins():
    a = Node.objects.get(pk=_provider().post(URL, valid_payload(), format="json").json()["id"])
    b = Node.objects.get(pk=_provider().post(URL, valid_payload(), format="json").json()["id"])
    _pin_host_key(b, OTHER_FP)
    with pytest.raises(DuplicateHardware) as raised:
        _pin_host_key(a, VICTIM_FP)
    assert raised.value.code == "duplicate_address"
    a.refresh_from_db()
    b.refresh_from_db()
    assert (a.control_proven_at, b.control_proven_at is not None) == (None, True)


@pytest.mark.django_db(transaction=True)
def test_two_first_contacts_at_one_address_at_once_only_one_proves_control():
    """The constraint decides: the second waits for the first to commit, then is refused cleanly."""
    a = make_node(address="10.7.7.7", ssh_port=2200)
    b = make_node(address="10.7.7.7", ssh_port=2200)
    result = _hold_then_second(lambda: _pin_host_key(a, VICTIM_FP), lambda: _pin_host_key(b, OTHER_FP))
    assert isinstance(result, DuplicateHardware) and result.code == "duplicate_address", result
    a.refresh_from_db()
    b.refresh_from_db()
    assert (a.host_key_fingerprint, b.host_key_fingerprint) == (VICTIM_FP, "")
    assert a.control_proven_at is not None and b.control_proven_at is None


# ------------------------------------------------------------------------------------- existing rows (0034)

def test_the_migration_marks_proven_only_the_nodes_the_platform_reached():
    migration = __import__("marketplace.migrations.0034_node_proven_control", fromlist=["mark_proven"])
    pinned = make_node(name="pinned", host_key_fingerprint=VICTIM_FP)
    NodeEvent.objects.create(node=pinned, kind="host_key_pinned", message="pinned")
    seen = make_node(name="seen", state=NodeState.OFFLINE)
    Node.objects.filter(pk=seen.pk).update(last_seen_at=timezone.now())
    make_node(name="listed", state=NodeState.ACTIVE, verdict=Verdict.VERIFIED)
    pending = make_node(name="pending", host_key_fingerprint=OTHER_FP)
    quarantined = make_node(name="quarantined", state=NodeState.QUARANTINED)
    with connection.cursor() as cur:
        cur.execute("UPDATE marketplace_node SET control_proven_at = NULL")

    migration.mark_proven(apps, None)

    proven = set(Node.objects.filter(control_proven_at__isnull=False).values_list("name", flat=True))
    assert proven == {"pinned", "seen", "listed"}
    event_at = NodeEvent.objects.get(node=pinned).created_at
    assert Node.objects.get(pk=pinned.pk).control_proven_at == event_at
    assert {pending.pk, quarantined.pk}.isdisjoint(Node.objects.filter(control_proven_at__isnull=False)
                                                   .values_list("pk", flat=True))
