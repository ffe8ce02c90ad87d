"""The meter tick between a health check's two steps: the check records the node's answer (its `last_seen_at`, up
to which the meter bills), then interrupts the instances whose VM it found gone or stopped, or whose GPU it found
missing, billing them up to the check before (the last moment the VM, or the card, was seen). Before, the answer
was committed first and the interruptions followed, each in a transaction of its own: a tick between them billed
the lost instance up to the new answer, past the loss, and the interruption, which never bills back what was
metered, kept it (up to a health interval, never given back). A check stopped between the two (Celery's soft time
limit, a crash) left the new answer recorded and the instance running, so the next check interrupted it from that
answer, as if its VM had been seen then. Now a check that finds a loss records that node's answer only once the
instances are interrupted. Real services on PostgreSQL; only the order in which they run is chosen here."""
from datetime import timedelta

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from billing.services.metering import cost_for, usage_meter
from marketplace.models import Gpu, Instance, Interruption, Node
from marketplace.services import instances as instance_pkg
from marketplace.services.instances import interruptions
from provisioning.services.fleet_record import node_record_health, nodes_record_health
from provisioning.services.nodes import HealthResult
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


def _uuids(host, *, without=None):
    held = set(Gpu.objects.filter(allocations__instance=without, allocations__released_at__isnull=True)
               .values_list("uuid", flat=True)) if without else set()
    return [u for u in Gpu.objects.filter(node=host).order_by("index").values_list("uuid", flat=True) if u not in held]


def _check(host, lost, kept, clock, loss):
    """One health check of `host`, probed now, recorded a second later: `loss` says what it finds of `lost`."""
    probed = clock.now
    clock.advance(1)
    vms = {kept.vm_id: "running", lost.vm_id: "running"}
    if loss == "gone":
        del vms[lost.vm_id]
    elif loss == "stopped":
        vms[lost.vm_id] = "stopped"
    uuids = _uuids(host, without=lost if loss == "gpu" else None)
    result = HealthResult(host.pk, True, vms=vms, probed_at=probed, gpu_uuids=uuids)
    running_vms = {host.pk: {lost.vm_id, kept.vm_id}}
    return nodes_record_health([result], running_vm_ids=running_vms).get(host.pk, []), probed


def _between_the_steps(monkeypatch, action):
    """Run `action` once, just before the check interrupts its first instance (after it recorded the answer, on the
    code before the fix), then the real interruption."""
    real = interruptions.instance_interrupt
    done = []

    def interrupt(**kwargs):
        if not done:
            done.append(True)
            action()
        return real(**kwargs)

    monkeypatch.setattr(interruptions, "instance_interrupt", interrupt)  # node_instances_interrupt's
    monkeypatch.setattr(instance_pkg, "instance_interrupt", interrupt)  # gpu_presence's
    return done


@pytest.mark.parametrize("set_based", [True, False], ids=["sql-tick", "per-instance-tick"])
@pytest.mark.parametrize("loss", ["gone", "stopped", "gpu"])
def test_a_tick_between_the_answer_and_the_interruption_bills_only_to_the_last_sighting(
        rented, clock, monkeypatch, loss, set_based):
    renter, host, lost, kept = rented
    started = Instance.objects.get(pk=lost.pk).started_at
    clock.advance(60)
    _check(host, lost, kept, clock, "none")  # everything seen at +60
    last_seen = Node.objects.get(pk=host.pk).last_seen_at
    usage_meter(set_based=set_based)
    assert Instance.objects.get(pk=lost.pk).billed_until == last_seen
    clock.advance(60)  # the VM (or its card) goes somewhere in here

    ticks = _between_the_steps(monkeypatch, lambda: usage_meter(set_based=set_based))
    interrupted, probed = _check(host, lost, kept, clock, loss)
    assert ticks and interrupted == [lost.pk]

    instance = Instance.objects.get(pk=lost.pk)
    interruption = Interruption.objects.get(instance=instance)
    assert instance.status == "interrupted"
    assert interruption.started_at == last_seen  # where its billing closes: the last check that saw it
    billed = (last_seen - started) // timedelta(seconds=1)
    assert instance.billed_until == last_seen and instance.billed_seconds == billed, (
        f"billed up to {instance.billed_until} ({instance.billed_seconds} s), its VM last seen at {last_seen}")
    assert instance.cost_micros == cost_for(PRICE, billed)
    assert not instance.usage_intervals.filter(ended_at__gt=last_seen).exists()
    assert balance(renter) == 50_000_000 - cost_for(PRICE, billed) + interruption.credited_micros

    # The answer is recorded once the loss is: the meter bills the instance beside it up to that answer.
    assert Node.objects.get(pk=host.pk).last_seen_at == probed
    usage_meter(set_based=set_based)
    assert Instance.objects.get(pk=kept.pk).billed_until == probed
    # The same loss found again by the next check: nothing more is billed, credited twice or interrupted.
    clock.advance(60)
    credited = Interruption.objects.get(pk=interruption.pk).credited_micros
    again, _ = _check(host, lost, kept, clock, loss)
    assert again == []
    assert Interruption.objects.filter(instance=instance).count() == 1
    assert Instance.objects.get(pk=lost.pk).billed_seconds == billed
    assert Interruption.objects.get(pk=interruption.pk).credited_micros == credited


@pytest.mark.parametrize("loss", ["gone", "gpu"])
def test_a_check_stopped_before_it_interrupted_leaves_the_answer_unrecorded(rented, clock, monkeypatch, loss):
    """Celery's soft time limit (or a crash) between the answer and the interruption: the answer must not stay
    recorded without it, or the meter bills the lost instance up to it and the next check takes it as the VM's last
    sighting."""
    renter, host, lost, kept = rented
    clock.advance(60)
    _check(host, lost, kept, clock, "none")
    last_seen = Node.objects.get(pk=host.pk).last_seen_at
    clock.advance(60)

    def limit():
        raise SoftTimeLimitExceeded()

    _between_the_steps(monkeypatch, limit)
    with pytest.raises(SoftTimeLimitExceeded):
        _check(host, lost, kept, clock, loss)
    assert Instance.objects.get(pk=lost.pk).status == "running"
    assert Node.objects.get(pk=host.pk).last_seen_at == last_seen
    usage_meter()
    assert Instance.objects.get(pk=lost.pk).billed_until == last_seen

    monkeypatch.undo()
    clock.advance(60)
    interrupted, probed = _check(host, lost, kept, clock, loss)
    assert interrupted == [lost.pk]
    instance = Instance.objects.get(pk=lost.pk)
    assert Interruption.objects.get(instance=instance).started_at == last_seen
    assert instance.billed_until == last_seen
    assert Node.objects.get(pk=host.pk).last_seen_at == probed
