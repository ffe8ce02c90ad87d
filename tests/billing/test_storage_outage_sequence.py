"""Storage through a node's outage, driven the way production drives it: the fleet's health batch
(provisioning.services.fleet.nodes_health_batch: the probe's answer, the reconcile it runs before recording a
node that answers after failures, then fleet_record.nodes_record_health), the periodic reconciler
(provisioning.services.reconcile.node_reconcile) and the meter's tick (billing.tasks.usage_meter_tick), against
PostgreSQL, with a fake clock and a fake server (only the SSH session is faked: every service is the real one).

The rule: a volume and a stopped instance's disk are billed up to the node's last healthy moment, not for the
outage, and every second from the node's answer on, as GPU time is (interrupted at the last healthy moment,
billed again from its resume).
"""
import contextlib

import pytest

from billing.services.storage import storage_cost
from billing.tasks import usage_meter_tick
from marketplace.models import Instance, InstanceStatus, Node, Volume
from marketplace.models.renting import vm_id_of
from marketplace.services import volumes as volume_svc
from provisioning.services import fleet
from provisioning.services.nodes import HealthResult
from provisioning.services.reconcile import node_reconcile
from provisioning.ssh_errors import NodeUnreachable
from tests.billing.helpers import fund, node, running, stop

pytestmark = pytest.mark.django_db
PRICE = 300_000  # per GB-month
GB = 100
CHECK_S = 60  # HEALTH_CHECK_INTERVAL_S


class Server:
    """The node's side: its VMs and volumes as its agent lists them, and whether it answers at all."""

    def __init__(self):
        self.up = True
        self.vms: dict[str, str] = {}
        self.volumes: list[str] = []

    @contextlib.contextmanager
    def session(self, node, *args, **kwargs):
        if not self.up:
            raise NodeUnreachable(f"{node.address}: connection timed out")
        yield self

    def agent(self, command, action=None, args=None):
        if (command, action) == ("vm", "list"):
            return {"vms": [{"vm_id": vm_id, "state": state} for vm_id, state in self.vms.items()]}
        if (command, action) == ("volume", "list"):
            return {"volumes": [{"name": name, "size_gb": GB, "used_by": []} for name in self.volumes]}
        raise AssertionError(f"the reconciler asked the node for {command} {action} {args}")


@pytest.fixture
def fleet_of_one(clock, user, monkeypatch):
    """A node with a 100 GB volume, a stopped instance's disk and a running instance, all from now."""
    fund(user, "1000")
    on = node()
    on.disk_price_per_gb_month_micros = PRICE
    on.last_seen_at, on.health_failures = clock.now, 0
    on.save()
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=GB).pk)
    disk = stop(running(user, on))
    gpu = running(user, on)
    server = Server()
    server.vms = {vm_id_of(disk.pk): "stopped", vm_id_of(gpu.pk): "running"}
    server.volumes = [volume.name]
    monkeypatch.setattr("provisioning.services.reconcile.node_session", server.session)

    def probe(nodes, parallelism, pool=None):
        return [HealthResult(n.pk, True, vms=dict(server.vms), probed_at=clock.now) if server.up
                else HealthResult(n.pk, False, "connection timed out", probed_at=clock.now) for n in nodes]

    monkeypatch.setattr(fleet, "nodes_probe", probe)
    return on, server, volume, disk, gpu


def _check(on, clock, after=CHECK_S):
    """A health check `after` seconds after the last (a minute), then the meter's tick."""
    clock.advance(after)
    fleet.nodes_health_batch([on.pk], pool=object())
    usage_meter_tick()


def _reconcile(on):
    """The periodic reconciler's visit (fleet._reconcile_one): a node that does not answer is counted unreachable."""
    try:
        node_reconcile(Node.objects.get(pk=on.pk))
    except NodeUnreachable:
        return False
    return True


def _outage(on, server, clock, checks=30):
    """The node stops answering: `checks` failed checks in a row, the reconciler's visits failing meanwhile."""
    server.up = False
    for i in range(checks):
        _check(on, clock)
        if i % 5 == 4:
            assert not _reconcile(on)


def _billed(volume, disk, gpu):
    volume.refresh_from_db()
    disk.refresh_from_db()
    gpu.refresh_from_db()
    assert volume.cost_micros == storage_cost(size_gb=GB, price_per_gb_month_micros=PRICE,
                                              seconds=volume.billed_seconds)
    assert disk.disk_cost_micros == storage_cost(size_gb=disk.disk_gb, price_per_gb_month_micros=PRICE,
                                                 seconds=disk.disk_billed_seconds)
    return volume.billed_seconds, disk.disk_billed_seconds, gpu.billed_seconds


def test_an_outage_is_not_billed_and_everything_from_the_nodes_answer_is(clock, fleet_of_one):
    """Ten healthy minutes, a 30-minute outage, then the health check finds the node answering (its reconcile runs
    first: node_storage_outage_end), then five healthy minutes: 600 + 300 s each, storage and GPU time alike."""
    on, server, volume, disk, gpu = fleet_of_one
    for _ in range(10):
        _check(on, clock)
    assert _billed(volume, disk, gpu) == (600, 600, 600)
    _outage(on, server, clock)
    assert Instance.objects.get(pk=gpu.pk).status == InstanceStatus.INTERRUPTED
    assert _billed(volume, disk, gpu) == (600, 600, 600)  # nothing past the last healthy moment
    server.up = True
    _check(on, clock)  # answers: reconciled (outage ended, instance resumed), then recorded
    on.refresh_from_db()
    assert (on.health_failures, on.state, on.last_seen_at) == (0, "active", clock.now)
    assert Instance.objects.get(pk=gpu.pk).status == InstanceStatus.RUNNING
    for _ in range(5):
        _check(on, clock)
        assert _reconcile(on)  # the periodic reconciler's visits once it is back change nothing
    assert _billed(volume, disk, gpu) == (900, 900, 900)
    assert Volume.objects.get(pk=volume.pk).billed_until == clock.now


def test_the_periodic_reconciler_reaching_the_node_first_bills_from_its_answer(clock, fleet_of_one):
    """The node answers the reconciler 30 s before the next health check: the instance resumes then, and its GPU
    time is billed from then; so is the storage (before, the health check's own reconcile moved the storage's
    billing on a second time, and the 30 s between were never billed)."""
    on, server, volume, disk, gpu = fleet_of_one
    for _ in range(10):
        _check(on, clock)
    _outage(on, server, clock)
    server.up = True
    clock.advance(30)
    assert _reconcile(on)  # the reconciler's visit; the node's checks still say it failed
    assert Instance.objects.get(pk=gpu.pk).status == InstanceStatus.RUNNING
    usage_meter_tick()
    assert _billed(volume, disk, gpu) == (600, 600, 600)  # not before the health check records the answer
    _check(on, clock, after=30)  # the check a minute after the last failed one: it answers
    for _ in range(4):
        _check(on, clock)
    assert _billed(volume, disk, gpu) == (600 + 30 + 240, 600 + 30 + 240, 600 + 30 + 240)


def test_checks_that_fail_again_after_the_reconcilers_answer_are_not_billed(clock, fleet_of_one):
    """The node answers the reconciler, then its next checks fail again (it flaps): the second silence is an
    outage too, for storage as for GPU time (interrupted again at the reconciler's answer). Storage moved on at
    the reconciler's answer is moved on again because a check was recorded since (Node.last_checked_at): without that,
    the whole second silence was billed."""
    on, server, volume, disk, gpu = fleet_of_one
    for _ in range(10):
        _check(on, clock)
    _outage(on, server, clock)
    server.up = True
    clock.advance(30)
    assert _reconcile(on)
    server.up = False
    _outage(on, server, clock, checks=10)
    assert Instance.objects.get(pk=gpu.pk).status == InstanceStatus.INTERRUPTED
    server.up = True
    for _ in range(5):
        _check(on, clock)
    assert _billed(volume, disk, gpu) == (600 + 240, 600 + 240, 600 + 240)


def test_a_verification_reaching_the_node_during_an_outage_bills_none_of_it(clock, fleet_of_one):
    """A verification that reaches the node while its health checks fail (an offline node may be verified) set its
    last healthy moment to now: the meter then billed the volume and the disk for the whole outage."""
    from provisioning.services.nodes import node_apply_inventory

    on, server, volume, disk, gpu = fleet_of_one
    for _ in range(10):
        _check(on, clock)
    _outage(on, server, clock)
    node_apply_inventory(node=Node.objects.get(pk=on.pk), inventory={"gpus": []})
    usage_meter_tick()
    assert _billed(volume, disk, gpu) == (600, 600, 600)


def test_a_quarantine_is_not_billed_to_the_storage_once_an_operator_accepts_the_new_key(
        clock, fleet_of_one, monkeypatch, django_capture_on_commit_callbacks):
    """Review: a quarantined node is not checked (its last healthy moment stays); when an operator accepts its new
    host key, the verification that follows makes it healthy now, and the meter caught the whole quarantine up on
    the volume and the disk. (Found with it: every accept was refused and rolled back, the node quarantined for
    good: the accept asked for a verification a quarantined node may not have.)"""
    from provisioning.services.nodes import node_apply_inventory, node_quarantine
    from provisioning.services.verification import node_accept_host_key

    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    on, server, volume, disk, gpu = fleet_of_one
    for _ in range(10):
        _check(on, clock)
    node_quarantine(node_id=on.pk, seen="SHA256:another-key")
    clock.advance(3600)
    usage_meter_tick()
    with django_capture_on_commit_callbacks(execute=True):
        node_accept_host_key(node=Node.objects.get(pk=on.pk), operator_email="operator@example.com")
    accepted = Node.objects.get(pk=on.pk)
    assert (accepted.state, accepted.host_key_fingerprint) == ("verifying", "SHA256:another-key")
    assert accepted.jobs.filter(kind="node_verify").exists()
    node_apply_inventory(node=Node.objects.get(pk=on.pk), inventory={"gpus": []})  # the verification reaches it
    _check(on, clock)  # and a health check a minute later
    volume_seconds, disk_seconds, _ = _billed(volume, disk, gpu)
    assert (volume_seconds, disk_seconds) == (600 + 60, 600 + 60)
