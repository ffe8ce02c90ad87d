"""Review r52 (provider onboarding), against a simulated server (a real sshd and the real agent), as
tests/provisioning/test_duplicate_nodes.py does:

- a node retired while its check runs claims none of its server's GPUs (nor MIG slices): before, the check
  claimed them after the retire had let go of them, for a node no check or reconcile visits again, and the same
  server registered again was rejected for good as "already another live node";
- a host key fingerprint given at registration that the server does not show at the node's first contact is the
  registration's mistake, not a changed key: the check fails saying what the server presented, the node goes
  back to pending (not quarantined), and its provider corrects the fingerprint (PATCH) and verifies again."""
from decimal import Decimal

import pytest
from django.db import transaction

from marketplace.models import MigSlice, Node, NodeState, SliceStatus, Verdict
from marketplace.services.nodes import node_retire
from notifications.models import Notification
from provisioning import tasks
from provisioning.models import Job, JobFault, NodeEvent, VerificationRun
from provisioning.services import verification as verification_mod
from provisioning.services.mig import node_apply_mig_slices
from provisioning.services.verification import node_verify_request
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.mig_helpers import make_mig_node, slice_uuid
from tests.marketplace.sim_renting import deliver_until_closed, sent_jobs_fixture  # noqa: F401
from tests.provisioning import test_duplicate_nodes as duplicates
from tests.provisioning.test_duplicate_nodes import register, uuids, verify

# The sim server fixtures of test_duplicate_nodes (one server for the module).
server, simbase = duplicates.server, duplicates.simbase

NODES = "/api/v1/nodes/"
WRONG = "SHA256:" + "Z" * 43


# ------------------------------------------------------------------------- a retire while the check runs

@pytest.mark.django_db
def test_a_node_retired_during_its_first_check_claims_no_gpu_and_its_server_registers_again(
        server, simbase, monkeypatch):
    provider = UserFactory()
    node = register(server, simbase, provider=provider, pin=False, name="first")
    original = verification_mod.held_cards  # called just before node_apply_inventory

    def retire_meanwhile(n, inventory):
        node_retire(node=Node.objects.get(pk=n.pk))  # the provider presses Retire while the check connects
        return original(n, inventory)

    monkeypatch.setattr(verification_mod, "held_cards", retire_meanwhile)
    node, job = verify(node)
    monkeypatch.setattr(verification_mod, "held_cards", original)

    assert node.state == NodeState.RETIRED
    assert uuids(node) == ["", ""]  # nothing claimed for the retired node
    # The check stopped there: no verdict, no run, no notification about a node its provider just retired.
    assert node.verdict == Verdict.UNVERIFIED
    assert not VerificationRun.objects.filter(node=node).exists()
    assert not Notification.objects.filter(user=provider).exists()
    assert "retired" in job.error and job.fault == JobFault.PLATFORM, (job.status, job.error)
    assert not any("benchmarking" in step["message"] for step in job.log)

    again = register(server, simbase, provider=provider, pin=False, name="again")
    again, _ = verify(again)
    assert again.verdict == Verdict.VERIFIED, (again.verdict, again.last_error)
    assert all(uuids(again))


@pytest.mark.django_db
def test_a_check_ending_after_a_retire_records_no_verdict(server, simbase, monkeypatch):
    """Retired after the inventory (while the benchmark ran): the conclusion writes nothing on the retired node."""
    provider = UserFactory()
    node = register(server, simbase, provider=provider, pin=False, name="late")
    original = verification_mod.node_network_test  # called right after node_apply_inventory

    def retire_meanwhile(job, session):
        answer = original(job, session)
        node_retire(node=Node.objects.get(pk=job.node_id))
        return answer

    monkeypatch.setattr(verification_mod, "node_network_test", retire_meanwhile)
    node, job = verify(node)
    monkeypatch.setattr(verification_mod, "node_network_test", original)
    assert node.state == NodeState.RETIRED and node.verdict == Verdict.UNVERIFIED
    assert not VerificationRun.objects.filter(node=node).exists()
    assert not NodeEvent.objects.filter(node=node, kind__startswith="verified_").exists()
    assert node.next_check_at is None
    assert uuids(node) == ["", ""]  # node_retire let go of them; nothing claimed them back


@pytest.mark.django_db
def test_a_retired_nodes_mig_slices_are_not_claimed_by_its_check():
    """What node_verify_conclude applies from a check that ran while the node was retired claims no MIG UUID."""
    first = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    uuids_ = sorted(first.mig_slices.values_list("uuid", flat=True))
    node_retire(node=first)
    slices = [{"gpu": 0, "device": n, "profile": "3g.40gb", "uuid": uuid, "memory_mib": 40192, "proven": True}
              for n, uuid in enumerate(uuids_)]
    with transaction.atomic():
        node_apply_mig_slices(node=Node.objects.select_for_update().get(pk=first.pk), slices=slices, listable=True)
    assert set(first.mig_slices.values_list("uuid", "status")) == {("", SliceStatus.UNAVAILABLE)}
    assert first.mig_slices.count() == 2 and MigSlice.objects.exclude(uuid="").count() == 0
    again = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=1, provider=first.provider,
                             mig_layout=[{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]}],
                             mig_prices={"3g.40gb": Decimal("0.70")})
    with transaction.atomic():
        node_apply_mig_slices(node=Node.objects.select_for_update().get(pk=again.pk), slices=slices, listable=True)
    assert sorted(MigSlice.objects.filter(node=again, status=SliceStatus.FREE).values_list("uuid", flat=True)) == \
        uuids_
    assert slice_uuid  # the helper's UUIDs, as make_mig_node proved them


# --------------------------------------------------------------- a wrong fingerprint given at registration

def _verify_as_worker(node: Node) -> tuple[Node, Job]:
    """The check as a worker runs it (its failure handled as the task does: node_verify_failed)."""
    job = node_verify_request(node=node)
    deliver_until_closed(tasks.node_verify, job)
    node.refresh_from_db()
    job.refresh_from_db()
    return node, job


@pytest.mark.django_db
def test_a_wrong_declared_fingerprint_at_first_contact_is_a_registration_error_not_a_quarantine(
        server, simbase, client_for):
    provider = UserFactory()
    node = register(server, simbase, provider=provider, pin=False, name="typo")
    Node.objects.filter(pk=node.pk).update(host_key_fingerprint=WRONG)  # as if typed so at registration
    node.refresh_from_db()

    node, job = _verify_as_worker(node)
    assert node.state == NodeState.PENDING, (node.state, node.last_error)
    assert node.control_proven_at is None and node.host_key_fingerprint == WRONG  # nothing pinned
    presented = server["host_key_fingerprint"]
    for text in (node.last_error, job.error):
        assert f"{presented} (ed25519)" in text and WRONG in text, text
        assert "ssh_host_ed25519_key.pub" in text and "operator" not in text and "changed" not in text
    assert not NodeEvent.objects.filter(node=node, kind="host_key_changed").exists()
    assert node.seen_host_key_fingerprint == ""

    # The provider corrects it and verifies again: no operator involved.
    api = client_for(provider)
    r = api.patch(f"{NODES}{node.pk}/", {"host_key_fingerprint": presented}, format="json")
    assert r.status_code == 200, r.content
    node, _ = _verify_as_worker(node)
    assert (node.state, node.verdict) == (NodeState.ACTIVE, Verdict.VERIFIED), node.last_error
    assert node.host_key_fingerprint == presented and node.control_proven_at is not None

    # Proven now: the key is pinned, not the provider's to change any more.
    r = api.patch(f"{NODES}{node.pk}/", {"host_key_fingerprint": WRONG}, format="json")
    assert r.status_code == 409, r.content
    assert Node.objects.get(pk=node.pk).host_key_fingerprint == presented


@pytest.mark.django_db
def test_a_proven_nodes_other_key_still_quarantines_it(server, simbase):
    """The rule for a key that changed after first contact is unchanged."""
    node, _ = verify(register(server, simbase, pin=False, name="proven"))
    assert node.control_proven_at is not None
    Node.objects.filter(pk=node.pk).update(host_key_fingerprint=WRONG)
    node, job = _verify_as_worker(Node.objects.get(pk=node.pk))
    assert node.state == NodeState.QUARANTINED
    assert "operator confirms the new key" in node.last_error
    assert NodeEvent.objects.filter(node=node, kind="host_key_changed").count() == 1
