"""A node's verification between two health checks, and the meter. The meter bills a running instance up to its
node's `last_seen_at`, which is also the last sighting of its VM: a health check lists the node's VMs, and one that
finds a VM gone or stopped interrupts its instance from the check before (fleet_record, test_meter_lost_window).
A verification's inventory (nodes.node_apply_inventory) set `last_seen_at` to its own moment whenever the node's
checks passed, without looking at the VMs: a tick after it billed a VM gone since the last check up to the
verification, and the check that then found it gone took the verification as its last sighting (the interruption
closes billing at max(since, billed_until)): the renter paid for the time the VM was gone, never given back, and was
credited from the verification on. Inside a check's wait (its answer recorded, its interruptions to come) it undid
2b1845f's fix the same way. Now a verification leaves `last_seen_at` alone while renters run on the node. Real
services on PostgreSQL; only the order in which they run is chosen here."""
from datetime import timedelta

import pytest

from billing.services.metering import cost_for, usage_meter
from marketplace.models import Gpu, Instance, Interruption, Node
from marketplace.services import instances as instance_pkg
from marketplace.services.instances import interruptions
from provisioning.services.fleet_record import node_record_health, nodes_record_health
from provisioning.services.nodes import HealthResult, node_apply_inventory
from tests.billing.helpers import balance, fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PRICE = 3_000_000  # $/h of the 2-GPU instance, in micro-dollars


@pytest.fixture
def rented(clock):
    """A running 2-GPU instance and a 1-GPU one beside it, on a node whose GPUs have UUIDs, seen healthy now."""
    host = node(price="1.500000", gpu_count=4)
    for gpu in host.gpus.all():
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{host.pk}-{gpu.index}")
    node_record_health(node_id=host.pk, ok=True)
    renter, neighbour = UserFactory(), UserFactory()
    fund(renter, "50")
    fund(neighbour, "50")
    lost = running(renter, host, num_gpus=2)
    kept = running(neighbour, host, num_gpus=1)
    return renter, Node.objects.get(pk=host.pk), lost, kept


def _verify(host):
    """A verification reads the node's inventory (every card there, as before) and stores it."""
    gpus = [{"index": index, "uuid": uuid, "name": "x"}
            for index, uuid in Gpu.objects.filter(node=host).order_by("index").values_list("index", "uuid")]
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory={"gpus": gpus})


def _check(host, lost, kept, clock, *, gone):
    """One health check of `host`, probed now, recorded a second later; `gone`: it finds `lost`'s VM gone."""
    probed = clock.now
    clock.advance(1)
    vms = {kept.vm_id: "running"} if gone else {kept.vm_id: "running", lost.vm_id: "running"}
    result = HealthResult(host.pk, True, vms=vms, probed_at=probed,
                          gpu_uuids=list(Gpu.objects.filter(node=host).values_list("uuid", flat=True)))
    running_vms = {host.pk: {lost.vm_id, kept.vm_id}}
    return nodes_record_health([result], running_vm_ids=running_vms).get(host.pk, []), probed


def _billed_to_the_last_sighting(renter, lost, started, last_seen):
    instance = Instance.objects.get(pk=lost.pk)
    interruption = Interruption.objects.get(instance=instance)
    assert instance.status == "interrupted"
    billed = (last_seen - started) // timedelta(seconds=1)
    assert (instance.billed_until, instance.billed_seconds) == (last_seen, billed), (
        f"billed up to {instance.billed_until} ({instance.billed_seconds} s), its VM last seen at {last_seen}")
    assert interruption.started_at == last_seen  # where its billing closes, and its credit counts from
    assert instance.cost_micros == cost_for(PRICE, billed)
    assert not instance.usage_intervals.filter(ended_at__gt=last_seen).exists()
    assert balance(renter) == 50_000_000 - cost_for(PRICE, billed) + interruption.credited_micros


@pytest.mark.parametrize("set_based", [True, False], ids=["sql-tick", "per-instance-tick"])
def test_a_verification_between_two_checks_does_not_bill_a_vm_gone_since_the_first(rented, clock, set_based):
    renter, host, lost, kept = rented
    started = Instance.objects.get(pk=lost.pk).started_at
    clock.advance(60)
    _check(host, lost, kept, clock, gone=False)  # both VMs seen at +60
    last_seen = Node.objects.get(pk=host.pk).last_seen_at
    usage_meter(set_based=set_based)
    clock.advance(20)  # the VM goes somewhere in here
    _verify(host)  # the provider (or the platform) verifies the node again: it reads the GPUs, not the VMs
    usage_meter(set_based=set_based)
    clock.advance(20)

    interrupted, probed = _check(host, lost, kept, clock, gone=True)
    assert interrupted == [lost.pk]
    _billed_to_the_last_sighting(renter, lost, started, last_seen)
    # The check lists the VMs: it moves the node's last healthy moment, and the instance beside is billed up to it.
    assert Node.objects.get(pk=host.pk).last_seen_at == probed
    usage_meter(set_based=set_based)
    assert Instance.objects.get(pk=kept.pk).billed_until == probed


@pytest.mark.parametrize("set_based", [True, False], ids=["sql-tick", "per-instance-tick"])
def test_a_verification_inside_a_checks_wait_does_not_bill_the_lost_vm(rented, clock, monkeypatch, set_based):
    """The check found the VM gone and recorded its answer, keeping last_seen_at at the check before until the
    instance is interrupted (2b1845f); a verification and a tick come in between."""
    renter, host, lost, kept = rented
    started = Instance.objects.get(pk=lost.pk).started_at
    clock.advance(60)
    _check(host, lost, kept, clock, gone=False)
    last_seen = Node.objects.get(pk=host.pk).last_seen_at
    usage_meter(set_based=set_based)
    clock.advance(60)

    real, done = interruptions.instance_interrupt, []

    def interrupt(**kwargs):
        if not done:
            done.append(True)
            _verify(host)
            usage_meter(set_based=set_based)
        return real(**kwargs)

    monkeypatch.setattr(interruptions, "instance_interrupt", interrupt)  # node_instances_interrupt's
    monkeypatch.setattr(instance_pkg, "instance_interrupt", interrupt)
    interrupted, probed = _check(host, lost, kept, clock, gone=True)
    assert done and interrupted == [lost.pk]
    _billed_to_the_last_sighting(renter, lost, started, last_seen)
    assert Node.objects.get(pk=host.pk).last_seen_at == probed


def test_a_verification_of_a_node_nobody_runs_on_still_records_it_seen(clock):
    """Nothing billed up to it needs the VMs seen: a verification of a node with no running instance (its first
    one, one after a quarantine) records it seen, as before."""
    host = node(price="1.500000", gpu_count=2)
    node_record_health(node_id=host.pk, ok=True)
    clock.advance(300)
    _verify(host)
    assert Node.objects.get(pk=host.pk).last_seen_at == clock.now
