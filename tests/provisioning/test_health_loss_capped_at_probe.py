"""What a health check's answer finds lost is billed no further than the moment its probe began.

The check bills a lost VM (a stopped one's disk, a running one's time) up to the node's previous healthy answer,
its last sighting. But that "previous" answer is whatever the node's row holds when the check is recorded: a check
of the same node whose probe began later, and that did not look at the VMs (or could not read this one's state),
may have been recorded while this probe ran, moving last_seen_at past this probe's start. Before, the disk (or the
run) was billed up to that later answer, after the moment this probe found it gone. The reconciler, in the same
case, bills no further than its list (reconcile._last_sighting); the health check now does the same."""
from datetime import UTC, datetime, timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from billing.selectors import instance_cost
from billing.services.metering import usage_meter
from billing.services.storage import storage_cost, storage_meter
from marketplace.models import Gpu, Instance, InstanceStatus, Interruption, Volume, VolumeState
from marketplace.services import instances as instance_svc
from marketplace.services import volumes as volume_svc
from provisioning import tasks
from provisioning.models import JobKind
from provisioning.services.fleet_record import node_record_health
from provisioning.services.reconcile import node_reconcile
from tests.billing.conftest import Clock
from tests.billing.helpers import fund, node, running, stop
from tests.billing.invariants import assert_billing_invariants
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import book
from tests.provisioning.test_gpu_presence import with_uuids
from tests.provisioning.test_vm_vanished import docker_node, failed_long_ago, node_with_one_gpu, run_job  # noqa: F401

pytestmark = pytest.mark.django_db
PRICE = 300_000  # µ$ per GB-month


@pytest.fixture
def clock(monkeypatch):
    c = Clock(datetime(2026, 3, 2, 12, 0, 0, 250_000, tzinfo=UTC))
    monkeypatch.setattr("django.utils.timezone.now", c)
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    monkeypatch.setattr("core.dispatch.send", lambda name, *args, task_id=None: None)
    return c


def _host():
    host = node("1.000000")
    host.disk_price_per_gb_month_micros = PRICE
    host.save()
    return host


def _ticked_meanwhile(clock, meter) -> None:
    """The meter ticks after the later check was recorded: it bills up to that check (last_seen_at)."""
    clock.advance(2)
    meter()
    clock.advance(3)


def test_a_meter_tick_after_the_later_check_is_given_back_past_the_probe(clock):
    """The same with the meters' ticks between the later check and this one: the run and the disk were billed up to
    the later check, and the check gives back what was billed after this probe's start."""
    renter = UserFactory()
    fund(renter, "20")
    host = _host()
    run, disk = running(renter, host), running(renter, host)
    clock.advance(60)
    disk = stop(disk)
    started_at, stopped_at = Instance.objects.get(pk=run.pk).started_at, Instance.objects.get(pk=disk.pk).stopped_at
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={run.vm_id: "running", disk.vm_id: "stopped"},
                       probed_at=clock.now)
    clock.advance(60)
    probed_at = clock.now  # this probe's answer lists neither VM
    clock.advance(30)
    node_record_health(node_id=host.pk, ok=True, probed_at=clock.now)  # begun after, no look at the VMs
    _ticked_meanwhile(clock, lambda: (usage_meter(), storage_meter()))
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed_at)
    run, disk = Instance.objects.get(pk=run.pk), Instance.objects.get(pk=disk.pk)
    assert (run.status, disk.status) == (InstanceStatus.INTERRUPTED, InstanceStatus.FAILED)
    ran = int((probed_at - started_at).total_seconds())
    assert instance_cost(instance=run)["billed_seconds"] == ran
    seconds = int((probed_at - stopped_at).total_seconds())
    assert instance_cost(instance=disk)["disk_amount_micros"] == storage_cost(
        size_gb=disk.disk_gb, price_per_gb_month_micros=PRICE, seconds=seconds)
    assert_billing_invariants()


def test_a_vanished_stopped_disk_is_not_billed_past_the_probe_that_found_it_gone(clock):
    renter = UserFactory()
    fund(renter, "20")
    host = _host()
    instance = running(renter, host)
    clock.advance(60)
    instance = stop(instance)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    clock.advance(60)
    probed_at = clock.now  # this probe's answer lists no VM: the disk is gone
    clock.advance(30)
    # Another check of the node, begun after, that did not look at the VMs, is recorded first.
    node_record_health(node_id=host.pk, ok=True, probed_at=clock.now)
    clock.advance(5)
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed_at)
    failed = Instance.objects.get(pk=instance.pk)
    assert failed.status == InstanceStatus.FAILED
    seconds = int((probed_at - stopped_at).total_seconds())
    assert failed.disk_billed_until is not None and failed.disk_billed_until <= probed_at, \
        f"disk billed up to {failed.disk_billed_until}, after the probe that found it gone began ({probed_at})"
    assert failed.disk_billed_seconds == seconds
    assert failed.disk_cost_micros == storage_cost(size_gb=failed.disk_gb, price_per_gb_month_micros=PRICE,
                                                   seconds=seconds)
    assert_billing_invariants()


def test_a_vanished_running_vm_is_not_billed_past_the_probe_that_found_it_gone(clock):
    renter = UserFactory()
    fund(renter, "20")
    host = _host()
    instance = running(renter, host)
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "running"}, probed_at=clock.now)
    clock.advance(60)
    probed_at = clock.now  # this probe's answer lists no VM: the VM is gone
    clock.advance(30)
    node_record_health(node_id=host.pk, ok=True, probed_at=clock.now)  # begun after, no look at the VMs
    clock.advance(5)
    assert node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed_at) == [instance.pk]
    lost = Instance.objects.get(pk=instance.pk)
    assert lost.status == InstanceStatus.INTERRUPTED
    assert lost.billed_until is not None and lost.billed_until <= probed_at, \
        f"billed up to {lost.billed_until}, after the probe that found the VM gone began ({probed_at})"
    assert Interruption.objects.get(instance=lost).started_at <= probed_at
    assert_billing_invariants()


def test_a_lost_cards_holder_is_not_billed_past_the_probe_that_found_it_gone(clock):
    renter = UserFactory()
    fund(renter, "20")
    host = node("1.000000", gpu_count=2)
    uuids = with_uuids(host)
    instance = running(renter, host)
    held = Gpu.objects.get(allocations__instance=instance, allocations__released_at__isnull=True)
    vm = {instance.vm_id: "running"}
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms=vm, gpu_uuids=list(uuids.values()), probed_at=clock.now)
    clock.advance(60)
    probed_at = clock.now  # this probe's nvidia-smi lists the other card only
    clock.advance(30)
    node_record_health(node_id=host.pk, ok=True, probed_at=clock.now)  # begun after, no look at VMs nor cards
    clock.advance(5)
    others = [uuid for index, uuid in uuids.items() if index != held.index]
    assert node_record_health(node_id=host.pk, ok=True, vms=vm, gpu_uuids=others, probed_at=probed_at) \
        == [instance.pk]
    lost = Instance.objects.get(pk=instance.pk)
    assert lost.status == InstanceStatus.INTERRUPTED
    assert lost.billed_until is not None and lost.billed_until <= probed_at, \
        f"billed up to {lost.billed_until}, after the probe that found its card gone began ({probed_at})"
    assert_billing_invariants()


def test_a_run_stopped_between_the_probe_and_its_record_keeps_only_the_time_up_to_the_probe(clock):
    """The renter's stop came after the probe that found the VM gone, and after a later check moved last_seen_at
    on: the stop billed the run up to itself; the check gives back what was billed after the probe's start."""
    renter = UserFactory()
    fund(renter, "20")
    host = _host()
    instance = running(renter, host)
    started_at = Instance.objects.get(pk=instance.pk).started_at
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "running"}, probed_at=clock.now)
    clock.advance(60)
    probed_at = clock.now
    clock.advance(20)
    node_record_health(node_id=host.pk, ok=True, probed_at=clock.now)  # begun after, no look at the VMs
    clock.advance(5)
    stop(Instance.objects.get(pk=instance.pk))
    clock.advance(1)
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed_at)
    paid = instance_cost(instance=Instance.objects.get(pk=instance.pk))["billed_seconds"]
    assert paid == int((probed_at - started_at).total_seconds()), \
        f"{paid} s paid for, {int((probed_at - started_at).total_seconds())} s up to the probe that found it gone"
    assert_billing_invariants()


def test_a_disk_started_between_the_probe_and_its_record_keeps_only_the_time_up_to_the_probe(clock):
    """The renter's start came after the probe that found the stopped VM and its disk gone, and after a later check
    moved last_seen_at on: the start billed the disk up to itself; the check gives back what was billed after the
    probe's start."""
    renter = UserFactory()
    fund(renter, "20")
    host = _host()
    instance = running(renter, host)
    clock.advance(60)
    instance = stop(instance)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    clock.advance(60)
    probed_at = clock.now
    clock.advance(20)
    node_record_health(node_id=host.pk, ok=True, probed_at=clock.now)  # begun after, no look at the VMs
    clock.advance(5)
    instance_svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    clock.advance(1)
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed_at)
    left = Instance.objects.get(pk=instance.pk)
    assert left.status != InstanceStatus.FAILED
    seconds = int((probed_at - stopped_at).total_seconds())
    paid = instance_cost(instance=left)["disk_amount_micros"]
    assert paid == storage_cost(size_gb=left.disk_gb, price_per_gb_month_micros=PRICE, seconds=seconds), \
        f"{paid} µ$ paid for the disk, {seconds} s up to the probe that found it gone"
    assert_billing_invariants()


def test_a_volume_held_by_an_instance_the_health_check_failed_for_its_vanished_vm_is_billed_until_deleted(
        docker_node):  # noqa: F811
    """The health check (not the reconciler) fails a stopped instance whose container was removed on the node: its
    disk is no longer billed, its volume (the renter's, still on the node) is billed as any volume until its delete
    is asked for; the node's record of the VM goes at a later pass, the renter's destroy goes through on a node that
    no longer knows the VM, and the volume's delete then ends its billing and frees it on the node."""
    node = node_with_one_gpu()
    renter = UserFactory()
    volume = volume_svc.volume_create(owner=renter, node_id=node.pk, size_gb=1)
    run_job(tasks.volume_create, None, JobKind.VOLUME_CREATE, volume=volume)
    # Made a minute ago: the whole test can take under a second, and a volume billed for less than one whole second
    # has nothing charged (billed_until stays None), which made the delete's close below depend on the test's speed.
    Volume.objects.filter(pk=volume.pk).update(available_at=F("available_at") - timedelta(seconds=60))
    instance = run_job(tasks.instance_provision, book(renter, node, volumes=[{"volume": volume.pk, "mount": "/data"}]),
                       JobKind.INSTANCE_PROVISION)
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    instance_svc.instance_stop(instance=instance)
    run_job(tasks.instance_stop, instance, JobKind.INSTANCE_STOP)
    listed = docker_node.session(node).agent("vm", "list", {"runtime": "docker"})["vms"]
    node_record_health(node_id=node.pk, ok=True, vms={v["vm_id"]: v["state"] for v in listed},
                       probed_at=timezone.now())
    docker_node.prune(instance.vm_id)
    listed = docker_node.session(node).agent("vm", "list", {"runtime": "docker"})["vms"]
    assert {v["vm_id"]: v["state"] for v in listed} == {instance.vm_id: "missing"}
    node_record_health(node_id=node.pk, ok=True, vms={v["vm_id"]: v["state"] for v in listed},
                       probed_at=timezone.now())
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    disk_billed = (instance.disk_billed_until, instance.disk_cost_micros)
    storage_meter()
    instance.refresh_from_db()
    assert (instance.disk_billed_until, instance.disk_cost_micros) == disk_billed  # the lost disk: no more
    failed_long_ago(instance)
    node_reconcile(node)
    assert not (docker_node.tmp_path / "state" / "vms" / instance.vm_id).exists()  # the node's record: gone
    instance_svc.instance_destroy(instance=instance)
    assert run_job(tasks.instance_destroy, instance, JobKind.INSTANCE_DESTROY).status == InstanceStatus.DESTROYED
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    asked = Volume.objects.get(pk=volume.pk)
    assert asked.billed_until is not None and asked.billed_until <= timezone.now()
    run_job(tasks.volume_delete, None, JobKind.VOLUME_DELETE, volume=volume)
    deleted = Volume.objects.get(pk=volume.pk)
    assert deleted.state == VolumeState.DELETED and deleted.billed_until == asked.billed_until
    assert not [v for v in docker_node.session(node).agent("volume", "list", {})["volumes"]
                if v["name"] == volume.name]
