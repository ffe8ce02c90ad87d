"""A GPU that vanishes from a node's nvidia-smi while the node answers (provisioning.services.gpu_presence), through
the health check's recording (fleet_record.nodes_record_health), and what follows: its instance interrupted at the
last check that saw the card, the card kept off the offers, the instance left waiting by the reconciler, and all of
it undone when the card is listed again. Before, nothing noticed: the renter paid for a card that was gone."""
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import BillingEvent, EventKind
from marketplace.models import Gpu, GpuStatus, Instance, Interruption, NodeState
from marketplace.selectors import offers_search
from marketplace.services import instances as instance_svc
from provisioning.models import NodeEvent
from provisioning.services.fleet import _nodes_with_instances_to_recover
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.gpu_presence import instance_waits_for_gpu
from provisioning.services.nodes import HealthResult, node_apply_inventory
from provisioning.services.reconcile import node_reconcile
from tests.billing.helpers import fund, running
from tests.billing.helpers import node as billing_node
from tests.factories import UserFactory
from tests.provisioning.test_reconcile_instances import fake_node  # noqa: F401 (a fixture, by name)


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)


def with_uuids(node):
    for gpu in node.gpus.all():
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{node.pk}-{gpu.index}")
    return {g.index: g.uuid for g in node.gpus.all()}


def check(node, uuids, *, vms=None, at=None):
    result = HealthResult(node.pk, True, vms=vms if vms is not None else {}, gpu_uuids=list(uuids),
                          probed_at=at or timezone.now())
    return nodes_record_health([result], running_vm_ids={}).get(node.pk, [])


def held_gpu(instance):
    return Gpu.objects.get(allocations__instance=instance, allocations__released_at__isnull=True)


def test_a_lost_card_interrupts_only_its_instance_billed_to_the_check_that_last_saw_it(db):
    renter = UserFactory()
    fund(renter, "50")
    host = billing_node(gpu_count=2)
    uuids = with_uuids(host)
    check(host, uuids.values())
    instance = running(renter, host)
    gpu = held_gpu(instance)
    other = host.gpus.exclude(pk=gpu.pk).get()
    vm = {f"inst-{instance.pk}": "running"}
    check(host, uuids.values(), vms=vm)
    seen = host.__class__.objects.get(pk=host.pk).last_seen_at

    assert check(host, [uuids[other.index]], vms=vm) == [instance.pk]
    instance.refresh_from_db()
    assert instance.status == "interrupted"
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.cause == "gpu_lost" and interruption.started_at == seen
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.INSTANCE_INTERRUPTED).exists()
    gpu.refresh_from_db()
    other.refresh_from_db()
    assert gpu.lost_at is not None and gpu.status == GpuStatus.RENTED  # still its instance's
    assert other.lost_at is None and other.status == GpuStatus.FREE
    event = NodeEvent.objects.get(node=host, kind="gpu_lost")
    assert f"GPU {gpu.index} ({uuids[gpu.index]})" in event.message
    assert instance_waits_for_gpu(instance_id=instance.pk)

    # Still missing at the next check: nothing more happens (one event per loss).
    assert check(host, [uuids[other.index]], vms=vm) == []
    assert NodeEvent.objects.filter(node=host, kind="gpu_lost").count() == 1

    # The renter destroys it: the card is let go, but not offered while lost.
    instance_svc.instance_destroy(instance=instance)
    instance_svc.instance_cleanup_done(instance_id=instance.pk)
    gpu.refresh_from_db()
    assert gpu.status == GpuStatus.UNAVAILABLE

    # Listed again: free, no longer lost.
    check(host, uuids.values())
    gpu.refresh_from_db()
    assert gpu.lost_at is None and gpu.status == GpuStatus.FREE
    assert NodeEvent.objects.filter(node=host, kind="gpu_back").exists()


def test_a_free_card_lost_leaves_the_offers_and_comes_back(db):
    host = billing_node(gpu_count=2)
    uuids = with_uuids(host)
    check(host, uuids.values())
    assert check(host, [uuids[0]]) == []
    lost = host.gpus.get(index=1)
    assert lost.status == GpuStatus.UNAVAILABLE and lost.lost_at is not None
    listed = {o.pk: o for o in offers_search()}
    assert listed[host.pk].num_gpus_free == 1
    check(host, uuids.values())
    lost.refresh_from_db()
    assert lost.status == GpuStatus.FREE and lost.lost_at is None


def test_a_card_taken_out_by_an_operator_is_not_judged(db):
    host = billing_node(gpu_count=2)
    uuids = with_uuids(host)
    Gpu.objects.filter(node=host, index=1).update(status=GpuStatus.UNAVAILABLE)
    check(host, [uuids[0]])
    check(host, uuids.values())
    gpu = host.gpus.get(index=1)
    assert gpu.status == GpuStatus.UNAVAILABLE and gpu.lost_at is None  # not freed by its return
    assert not NodeEvent.objects.filter(node=host, kind__in=["gpu_lost", "gpu_back"]).exists()


def test_an_instance_started_on_a_lost_card_is_interrupted_by_the_next_check(db):
    """A card rented in the instant after it was found missing: still missing at the next check, its instance
    goes too (every check judges every missing card, not only the newly missing)."""
    renter = UserFactory()
    fund(renter, "50")
    host = billing_node(gpu_count=1)
    uuids = with_uuids(host)
    check(host, uuids.values())
    check(host, [])
    Gpu.objects.filter(node=host).update(status=GpuStatus.FREE)  # as if booked before the loss was written
    instance = running(renter, host)
    assert check(host, [], vms={f"inst-{instance.pk}": "running"}) == [instance.pk]


def test_a_verification_that_claims_the_card_again_ends_its_loss(db):
    host = billing_node(gpu_count=2)
    uuids = with_uuids(host)
    check(host, [uuids[0]])
    assert host.gpus.get(index=1).lost_at is not None
    gpus = [{"index": i, "uuid": u, "name": "x"} for i, u in uuids.items()]
    node_apply_inventory(node=host, inventory={"gpus": gpus})
    gpu = host.gpus.get(index=1)
    assert gpu.lost_at is None and gpu.status == GpuStatus.FREE


def test_the_reconciler_leaves_an_instance_waiting_for_its_card(db, fake_node):  # noqa: F811
    """Its VM may still run: resumed, it would be billed for a card that does not answer. Nor is its node reconciled
    at every health check for it (an SSH pass that would pass it by), until the card answers again."""
    renter = UserFactory()
    fund(renter, "50")
    host = billing_node(gpu_count=1)
    uuids = with_uuids(host)
    check(host, uuids.values())
    instance = running(renter, host)
    fake_node.vms[instance.vm_id] = "running"
    check(host, [], vms={instance.vm_id: "running"}, at=timezone.now() + timedelta(seconds=1))
    assert Instance.objects.get(pk=instance.pk).status == "interrupted"
    assert _nodes_with_instances_to_recover([host.pk]) == set()
    node_reconcile(host)
    assert Instance.objects.get(pk=instance.pk).status == "interrupted"  # not resumed while the card is lost

    check(host, uuids.values(), vms={instance.vm_id: "running"})
    assert _nodes_with_instances_to_recover([host.pk]) == {host.pk}
    node_reconcile(host)
    assert Instance.objects.get(pk=instance.pk).status == "running"
    host.refresh_from_db()
    assert host.state == NodeState.ACTIVE


def test_a_rejection_while_interrupted_does_not_tell_its_renter_it_runs(db):
    """Walking the demo: the card's loss changed the node's inventory, its re-verification rejected it (gpu_count),
    and the interrupted instance's status then read "Your instance keeps running". Only running ones are told so."""
    from provisioning.models import Job, JobKind
    from provisioning.services.verification import node_verify_conclude

    renter = UserFactory()
    fund(renter, "50")
    host = billing_node(gpu_count=2)
    uuids = with_uuids(host)
    check(host, uuids.values())
    lost, kept = running(renter, host), running(UserFactory(), host)
    check(host, [uuids[held_gpu(kept).index]], vms={lost.vm_id: "running", kept.vm_id: "running"},
          at=timezone.now() + timedelta(seconds=1))
    said = Instance.objects.get(pk=lost.pk).status_message
    assert said.startswith("Interrupted: a GPU it holds vanished")
    job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=host, status="running",
                             deadline=timezone.now() + timedelta(hours=1))
    node_verify_conclude(job=job, verdict="rejected", score=None, inventory={}, findings=[
        {"severity": "reject", "code": "gpu_count", "message": "1 GPU of 2", "gpu_index": None}])
    assert Instance.objects.get(pk=lost.pk).status_message == said
    assert "keeps running" in Instance.objects.get(pk=kept.pk).status_message


def _inventory(listed):
    """An inventory as nvidia-smi numbers what it lists: 0, 1, 2... whichever cards those are."""
    return {"gpus": [{"index": i, "uuid": uuid, "name": "x"} for i, uuid in enumerate(listed)]}


def test_a_verification_that_sees_a_card_missing_first_interrupts_its_holder(db):
    """A verification may read the inventory before any health check sees the card gone. It let go of the row's
    UUID, so no health check judged the card again: its renter paid on for a card that was gone."""
    renter = UserFactory()
    fund(renter, "50")
    host = billing_node(gpu_count=2)
    uuids = with_uuids(host)
    check(host, uuids.values())
    instance = running(renter, host)
    gpu, vm = held_gpu(instance), {instance.vm_id: "running"}
    check(host, uuids.values(), vms=vm)
    seen = host.__class__.objects.get(pk=host.pk).last_seen_at

    left = [{"index": i, "uuid": u, "name": "x"} for i, u in uuids.items() if i != gpu.index]
    node_apply_inventory(node=host, inventory={"gpus": left})
    instance.refresh_from_db()
    assert instance.status == "interrupted"
    assert Interruption.objects.get(instance=instance).started_at == seen
    gpu.refresh_from_db()
    assert gpu.lost_at is not None and gpu.uuid == uuids[gpu.index]  # still its card's row
    assert check(host, [u for i, u in uuids.items() if i != gpu.index], vms=vm) == []  # judged, still lost
    assert Gpu.objects.get(pk=gpu.pk).lost_at is not None
    check(host, uuids.values(), vms=vm)
    assert Gpu.objects.get(pk=gpu.pk).lost_at is None


def test_a_free_lost_cards_row_lets_it_go_and_a_new_card_takes_it(db):
    """Card 1 of 4 gone, nobody renting it: its row stays lost and off the offers but lets go of the UUID (the
    provider may put the card in another server, which claims it: review); a new card takes the row, free again."""
    host = billing_node(gpu_count=4)
    uuids = with_uuids(host)
    check(host, uuids.values())
    listed = [g for g in _inventory(uuids.values())["gpus"] if g["index"] != 1]  # as numbered before
    node_apply_inventory(node=host, inventory={"gpus": listed})
    rows = {g.index: g for g in host.gpus.all()}
    assert {i: rows[i].uuid for i in rows} == {**uuids, 1: ""}
    assert rows[1].lost_at is not None and rows[1].status == GpuStatus.UNAVAILABLE
    other = billing_node(gpu_count=1)
    node_apply_inventory(node=other, inventory=_inventory([uuids[1]]))  # no DuplicateHardware
    assert other.gpus.get().uuid == uuids[1]

    node_apply_inventory(node=host, inventory=_inventory([uuids[0], "GPU-new", uuids[2], uuids[3]]))
    row = host.gpus.get(index=1)
    assert row.uuid == "GPU-new" and row.lost_at is None and row.status == GpuStatus.FREE


def test_cards_keep_their_rows_when_nvidia_smi_numbers_them_anew(db):
    """Review: card 0 gone, nvidia-smi lists card 1 as GPU 0. Matched by index, the lost card's row took card 1's
    UUID and was marked back: its renter resumed and was billed for a card that was gone. Each card keeps its row
    (its index follows nvidia-smi's, by which the agent addresses it); the lost one, held, keeps waiting."""
    renter = UserFactory()
    fund(renter, "50")
    host = billing_node(gpu_count=2)
    uuids = with_uuids(host)
    check(host, uuids.values())
    instance = running(renter, host)
    lost = held_gpu(instance)
    kept = host.gpus.exclude(pk=lost.pk).get()
    assert (lost.index, kept.index) == (0, 1)
    vm = {instance.vm_id: "running"}
    check(host, [uuids[kept.index]], vms=vm, at=timezone.now() + timedelta(seconds=1))
    node_apply_inventory(node=host, inventory=_inventory([uuids[kept.index]]))  # numbered anew: it is GPU 0
    lost.refresh_from_db()
    kept.refresh_from_db()
    assert (kept.uuid, kept.index, lost.uuid, lost.index) == (uuids[1], 0, uuids[0], 1)
    assert lost.lost_at is not None and instance_waits_for_gpu(instance_id=instance.pk)
    assert Instance.objects.get(pk=instance.pk).status == "interrupted"
