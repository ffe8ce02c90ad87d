"""The fleet's health checks as batch tasks (provisioning/services/fleet.py): the dispatcher's split, one run
per batch and cycle, one batch at a time per node, and each batch's results written in a fixed number of
set-based statements (fleet_record.nodes_record_health) with the same outcome as node_record_health node by node.
"""
import socket
import uuid
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from marketplace.models import Node, NodeState, Verdict
from provisioning import tasks
from provisioning.agent.gpumarket_agent import inventory_hash as gpus_hash
from provisioning.concurrency import slot_key
from provisioning.models import HealthSample, Job, JobKind, JobStatus, NodeEvent
from provisioning.services import fleet
from provisioning.services.fleet_record import node_record_health, nodes_record_health
from provisioning.services.nodes import OFFLINE_AFTER_FAILED_CHECKS, HealthResult
from provisioning.ssh_pool import SshPool
from tests.billing.helpers import fund, running
from tests.billing.helpers import node as billing_node
from tests.factories import UserFactory, make_listed_node, make_node


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    """Jobs handed to Celery on commit are recorded instead (no worker here)."""
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    return sent


class Broker:
    """Stands in for the broker's client: records each task sent (or refuses after `up_to` of them)."""

    def __init__(self, up_to=None):
        self.sent, self.up_to = [], up_to

    def send_task(self, name, args=None, **options):
        if self.up_to is not None and len(self.sent) >= self.up_to:
            raise ConnectionError("broker down")
        self.sent.append((name, args, options))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: a connect is refused at once


def unreachable_node(**fields) -> Node:
    return make_listed_node(address="127.0.0.1", ssh_port=closed_port(), **fields)


def listed(state=NodeState.ACTIVE, **row) -> Node:
    """A verified node in `state`, its row then set to `row` (health_failures, inventory...)."""
    node = make_node(state=state, verdict=Verdict.VERIFIED)
    if row:
        Node.objects.filter(pk=node.pk).update(**row)
        node.refresh_from_db()
    return node


def test_batches_are_consecutive_slices_in_node_order():
    assert fleet.fleet_batches([1, 2, 3, 4, 5, 6, 7], 3) == [[1, 2, 3], [4, 5, 6], [7]]
    assert fleet.fleet_batches([1, 2], 5) == [[1, 2]]
    assert fleet.fleet_batches([], 5) == []
    with pytest.raises(ValueError):
        fleet.fleet_batches([1], 0)


def test_the_dispatcher_queues_one_task_per_batch_of_watched_nodes(db, settings, monkeypatch):
    settings.FLEET_BATCH_SIZE = 2
    watched = [make_listed_node(), make_listed_node(), listed(NodeState.OFFLINE),
               listed(NodeState.MAINTENANCE), make_listed_node()]
    make_node()  # pending: not health-checked
    broker = Broker()
    monkeypatch.setattr(fleet, "current_app", broker)
    summary = fleet.nodes_health_dispatch()
    assert summary == {"nodes": 5, "batches": 3, "send_failed": 0}
    ids = sorted(n.pk for n in watched)
    assert [args[0] for _, args, _ in broker.sent] == [ids[0:2], ids[2:4], ids[4:]]
    assert {name for name, _, _ in broker.sent} == {fleet.FLEET_HEALTH_BATCH}
    assert len({args[1] for _, args, _ in broker.sent}) == 1  # one cycle
    # Within the interval, less the beat ticks' margin (tests/provisioning/test_fleet_round44_batch_expiry.py).
    assert all(options["expires"] == settings.HEALTH_CHECK_INTERVAL_S - fleet.BATCH_EXPIRY_MARGIN_S
               for _, _, options in broker.sent)
    # The task registered under the name the dispatcher queues.
    assert tasks.fleet_health_batch.name == fleet.FLEET_HEALTH_BATCH
    assert tasks.fleet_reconcile_batch.name == fleet.FLEET_RECONCILE_BATCH

    reconcile = Broker()
    monkeypatch.setattr(fleet, "current_app", reconcile)
    assert fleet.nodes_reconcile_dispatch()["batches"] == 3
    assert {name for name, _, _ in reconcile.sent} == {fleet.FLEET_RECONCILE_BATCH}


def test_a_broker_refusing_a_batch_ends_the_dispatch(db, settings, monkeypatch):
    settings.FLEET_BATCH_SIZE = 1
    for _ in range(3):
        make_listed_node()
    monkeypatch.setattr(fleet, "current_app", Broker(up_to=1))
    assert fleet.nodes_health_dispatch() == {"nodes": 3, "batches": 1, "send_failed": 2}


def test_a_batch_delivered_twice_in_one_cycle_runs_once(db):
    nodes = [unreachable_node(), unreachable_node()]
    ids = [n.pk for n in nodes]
    cycle = f"test-{uuid.uuid4().hex}"
    pool = SshPool()
    first = fleet.nodes_health_batch(ids, cycle=cycle, pool=pool)
    assert first["checked"] == 2 and first["failed"] == 2
    assert fleet.nodes_health_batch(ids, cycle=cycle, pool=pool) == {"skipped": "this batch already ran"}
    assert [n.health_failures for n in Node.objects.filter(pk__in=ids)] == [1, 1]  # counted once
    fleet.nodes_health_batch(ids, cycle=f"{cycle}-next", pool=pool)  # the next cycle runs
    assert [n.health_failures for n in Node.objects.filter(pk__in=ids)] == [2, 2]


def test_a_node_another_batch_is_checking_is_skipped(db):
    busy, free = unreachable_node(), unreachable_node()
    with fleet.node_locks("health", [busy.pk]) as held:  # an earlier, slow batch still has it
        assert held == [busy.pk]
        summary = fleet.nodes_health_batch([busy.pk, free.pk], pool=SshPool())
        with fleet.node_locks("reconcile", [busy.pk]) as other_kind:
            assert other_kind == [busy.pk]  # a reconcile batch is not held up by a health batch
    assert summary["locked"] == 1 and summary["checked"] == 1
    busy.refresh_from_db()
    free.refresh_from_db()
    assert busy.health_failures == 0 and free.health_failures == 1
    with fleet.node_locks("health", [busy.pk, free.pk]) as held:  # released at the end of the batch
        assert held == sorted([busy.pk, free.pk])


def test_the_batch_task_checks_its_nodes(db):
    node = unreachable_node()
    summary = tasks.fleet_health_batch.apply(args=[[node.pk], f"test-{uuid.uuid4().hex}"]).get()
    assert summary["checked"] == 1 and summary["failed"] == 1


def _fleet(n):
    """n nodes in the states a check meets: answering, failing, about to go offline, offline and answering."""
    nodes = []
    for i in range(n):
        kind = i % 4
        if kind == 2:
            nodes.append(listed(health_failures=2))
        elif kind == 3:
            nodes.append(listed(NodeState.OFFLINE, health_failures=5, last_error="gone"))
        else:
            nodes.append(make_listed_node())
    return nodes


def _results(nodes, probed_at):
    results = []
    for i, node in enumerate(nodes):
        ok = i % 4 in (0, 3)
        results.append(HealthResult(node.pk, ok, "" if ok else "No SSH answer", vms={} if ok else None,
                                    probed_at=probed_at))
    return results


def _outcome(nodes):
    rows = {n.pk: n for n in Node.objects.filter(pk__in=[n.pk for n in nodes])}
    out = []
    for node in nodes:
        row = rows[node.pk]
        sample = HealthSample.objects.get(node=row)
        events = sorted(NodeEvent.objects.filter(node=row).exclude(kind="host_key_pinned")
                        .values_list("kind", flat=True))
        out.append((row.state, row.health_failures, row.last_error, row.reliability, row.last_seen_at is not None,
                    sample.ok, sample.failed, events))
    return out


def test_a_batch_is_recorded_in_a_fixed_number_of_statements_with_the_per_node_outcome(db):
    counts = {}
    for size in (4, 12):
        probed_at = timezone.now()
        one_by_one, batched = _fleet(size), _fleet(size)
        for node in (one_by_one[1], batched[1]):  # a failed job counts against the reliability figure
            Job.objects.create(node=node, kind=JobKind.INSTANCE_START, status=JobStatus.FAILED, fault="node",
                               finished_at=timezone.now(), deadline=timezone.now())
        for node in (one_by_one[0], batched[0]):  # today's row exists already
            HealthSample.objects.create(node=node, day=timezone.now().date(), ok=5, failed=1)
        for result in _results(one_by_one, probed_at):
            node_record_health(node_id=result.node_id, ok=result.ok, error=result.error, vms=result.vms,
                               probed_at=probed_at)
        with CaptureQueriesContext(connection) as captured:
            interrupted = nodes_record_health(_results(batched, probed_at), running_vm_ids={})
        assert interrupted == {}
        assert _outcome(batched) == _outcome(one_by_one)
        assert [r[0] for r in _outcome(batched)[:4]] == ["active", "active", "offline", "active"]
        counts[size] = [q["sql"] for q in captured.captured_queries
                        if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))]
    # samples: INSERT ... ON CONFLICT DO NOTHING, one UPDATE; reliability: two grouped reads; nodes: SELECT ...
    # FOR UPDATE, one UPDATE; events: one INSERT; silent nodes with running instances: one read; stopped instances
    # of the nodes whose answers list their VMs (a VM gone with its disk): one read. And per node gone offline (one
    # in four here), its provider's notification: the provider, its preference, the row, its webhooks.
    assert len(counts[4]) == 9 + 4 * 1 and len(counts[12]) == 9 + 4 * 3, "\n".join(counts[12])


def test_changed_gpus_queue_a_verification_from_a_batch_too(db, sent_jobs):
    gpus = [{"index": 0, "uuid": "GPU-1", "name": "NVIDIA A100"}]
    node = listed(inventory={"gpus": gpus})
    same = listed(inventory={"gpus": gpus})
    results = [HealthResult(node.pk, True, inventory_hash="0" * 16, probed_at=timezone.now()),
               HealthResult(same.pk, True, inventory_hash=gpus_hash(gpus), probed_at=timezone.now())]
    nodes_record_health(results, running_vm_ids={})
    assert NodeEvent.objects.filter(node=node, kind="inventory_changed").exists()
    assert Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY).exists()
    assert not Job.objects.filter(node=same, kind=JobKind.NODE_VERIFY).exists()


def test_a_batch_interrupts_instances_of_a_lost_node(db, settings):
    """The rare per-node path: a node silent for NODE_INTERRUPT_AFTER_FAILED_CHECKS checks."""
    renter = UserFactory()
    fund(renter, "50")
    host = billing_node()
    nodes_record_health([HealthResult(host.pk, True, probed_at=timezone.now())], running_vm_ids={})
    instance = running(renter, host)
    failures = settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS
    for i in range(failures):
        interrupted = nodes_record_health([HealthResult(host.pk, False, "No SSH answer")], running_vm_ids={})
        assert interrupted == ({host.pk: [instance.pk]} if i == failures - 1 else {})
    instance.refresh_from_db()
    assert instance.status == "interrupted"
    assert NodeEvent.objects.filter(node=host, kind="instances_interrupted").exists()


def test_a_batch_interrupts_an_instance_whose_vm_stopped(db):
    renter = UserFactory()
    fund(renter, "50")
    host = billing_node()
    nodes_record_health([HealthResult(host.pk, True, probed_at=timezone.now())], running_vm_ids={})
    instance = running(renter, host)
    probed = timezone.now() + timedelta(seconds=1)
    vm = f"inst-{instance.pk}"
    result = HealthResult(host.pk, True, vms={vm: "stopped"}, probed_at=probed)
    assert nodes_record_health([result], running_vm_ids={host.pk: {vm}}) == {host.pk: [instance.pk]}
    instance.refresh_from_db()
    assert instance.status == "interrupted"


def test_a_batch_takes_and_gives_back_the_nodes_ssh_slots_in_one_round_trip_each(db):
    mine, theirs = unreachable_node(), unreachable_node()
    assert cache.add(slot_key(theirs.pk, 0), "another-worker", timeout=60)  # another worker's session
    try:
        with fleet.batch_slots([mine.pk, theirs.pk]) as held:
            assert held == {mine.pk}  # theirs: its probe waits for a slot itself (node_slot)
            assert cache.get(slot_key(mine.pk, 0)) not in (None, "another-worker")
            assert not fleet.nodes_probe([mine], pool=SshPool())[0].busy  # (a fresh batch: nothing of mine free)
        assert cache.get(slot_key(mine.pk, 0)) is None  # given back
        assert cache.get(slot_key(theirs.pk, 0)) == "another-worker"  # not ours: left alone
        summary = fleet.nodes_health_batch([mine.pk, theirs.pk], pool=SshPool())
        assert summary["checked"] == 2 and summary["busy"] == 0
        assert [cache.get(slot_key(n.pk, s)) for n in (mine, theirs) for s in range(1, 4)] == [None] * 6
        assert cache.get(slot_key(mine.pk, 0)) is None
    finally:
        cache.delete(slot_key(theirs.pk, 0))


def test_a_node_verified_again_while_renters_are_on_it_stays_watched(db, monkeypatch):
    """A node verified again from offline or maintenance (node_verify_request: -> verifying) with renters on it is
    still health-checked and reconciled: its interrupted instances are resumed without waiting up to the check's
    length for it to end, and a VM lost meanwhile is noticed. One being verified with nobody on it is left to its
    check (its key may not be installed yet: failed probes would send it offline mid-check)."""
    from marketplace.models import GpuAllocation, Instance, InstanceStatus

    renter = UserFactory()
    fund(renter, "50")
    host = billing_node()
    instance = running(renter, host)
    Instance.objects.filter(pk=instance.pk).update(status=InstanceStatus.INTERRUPTED)
    Node.objects.filter(pk=host.pk).update(state=NodeState.VERIFYING)
    alone = listed(NodeState.VERIFYING)
    ended = billing_node()
    gone = running(renter, ended)
    Instance.objects.filter(pk=gone.pk).update(status=InstanceStatus.DESTROYED)
    Node.objects.filter(pk=ended.pk).update(state=NodeState.VERIFYING)
    assert fleet._watched_ids() == [host.pk, ended.pk]  # the destroyed one's GPUs are held: its VM is to remove
    GpuAllocation.objects.filter(instance=gone).update(released_at=timezone.now())
    assert fleet._watched_ids() == [host.pk]

    reconciled = []
    monkeypatch.setattr(fleet, "nodes_probe", lambda nodes, parallelism, pool=None: [
        HealthResult(n.pk, True, vms={}, probed_at=timezone.now()) for n in nodes])
    monkeypatch.setattr(fleet, "node_reconcile", lambda node, pool=None: reconciled.append(node.pk) or {
        "resumed": 1, "restarted": 0, "instances_failed": 0})
    summary = fleet.nodes_health_batch([host.pk, alone.pk, ended.pk], pool=object())
    assert (summary["checked"], summary["recovered"], reconciled) == (1, 1, [host.pk])
    assert fleet.nodes_reconcile_batch([host.pk, alone.pk, ended.pk], pool=object())["nodes"] == 1
    assert reconciled == [host.pk, host.pk]
    host.refresh_from_db()
    assert host.state == NodeState.VERIFYING  # the check decides where it goes next


def test_a_rejected_node_with_renters_back_from_offline_is_active_through_the_batch_too(db):
    """The batch path sent an offline node back to pending when its verdict was not listable, where the per-node
    path (node_record_health) keeps a node with renters active: watched, not listed. Pending, its renters' VMs were
    no longer checked nor their interrupted instances resumed (found by review)."""
    renter = UserFactory()
    fund(renter, "50")
    host = billing_node()
    running(renter, host)
    Node.objects.filter(pk=host.pk).update(state=NodeState.OFFLINE, verdict=Verdict.REJECTED, health_failures=3)
    alone = listed(NodeState.OFFLINE, verdict=Verdict.REJECTED, health_failures=3)
    nodes_record_health([HealthResult(n.pk, True, probed_at=timezone.now()) for n in (host, alone)],
                        running_vm_ids={})
    host.refresh_from_db()
    alone.refresh_from_db()
    assert (host.state, alone.state) == (NodeState.ACTIVE, NodeState.PENDING)
    assert Node.objects.get(pk=host.pk, verdict=Verdict.REJECTED)  # still not listed


def test_a_reconcile_batch_goes_on_past_a_node_whose_reconcile_raised(db, monkeypatch, caplog):
    """Any error on one node (a bug, or a refusal such as a JobConflict from queuing a restart) crashed the whole
    batch: only a NodeError was caught, so the other nodes' outcomes were lost (found by review). Now it is
    logged with its node, counted, and the batch goes on."""
    broken, fine = listed(), listed()

    def reconcile(node, pool=None):
        if node.pk == broken.pk:
            raise RuntimeError("a bug")
        return {"resumed": 1}
    monkeypatch.setattr(fleet, "node_reconcile", reconcile)
    summary = fleet.nodes_reconcile_batch([broken.pk, fine.pk], pool=object())
    assert (summary["nodes"], summary["resumed"], summary["errors"]) == (1, 1, 1)
    assert any(f"node {broken.pk}" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_health_batch_records_its_other_nodes_when_one_nodes_reconcile_raised(db, monkeypatch, caplog):
    """A node back after failures is reconciled before its check is recorded, and a node with lost VMs after:
    an error other than a NodeError there made the batch raise before any node of it was recorded (found by
    review). Now the node whose reconcile raised is counted and left to the next check (not taking rentals
    before it is reconciled); the others are recorded."""
    back = listed(health_failures=2)
    fine = listed(health_failures=1)
    lost = listed()
    monkeypatch.setattr(fleet, "nodes_probe", lambda nodes, parallelism, pool=None: [
        HealthResult(n.pk, True, vms={}, probed_at=timezone.now()) for n in nodes])
    record = fleet.nodes_record_health
    monkeypatch.setattr(fleet, "nodes_record_health", lambda results, running_vm_ids: {
        **record(results, running_vm_ids=running_vm_ids), lost.pk: [0]})  # as if a VM of `lost` stopped

    def reconcile(node, pool=None):
        if node.pk in (back.pk, lost.pk):
            raise RuntimeError("a bug")
        return {"resumed": 0, "restarted": 0, "instances_failed": 0}
    monkeypatch.setattr(fleet, "node_reconcile", reconcile)
    summary = fleet.nodes_health_batch([back.pk, fine.pk, lost.pk], pool=object())
    assert (summary["checked"], summary["errors"], summary["failed"]) == (3, 2, 0)
    rows = {n.pk: n for n in Node.objects.filter(pk__in=[back.pk, fine.pk, lost.pk])}
    assert rows[fine.pk].health_failures == 0 and rows[lost.pk].last_seen_at is not None
    assert rows[back.pk].health_failures == 2  # judged again next time, once reconciled
    assert {back.pk, lost.pk} <= {pk for pk in (back.pk, lost.pk) for r in caplog.records
                                  if f"node {pk}" in r.getMessage() and r.exc_info}


def test_a_node_in_maintenance_stays_there_through_failed_checks(db):
    """The fleet's batch sent it offline, and its next answer then ended the provider's maintenance and listed it
    again (the single-node copy of the rule, which kept it, was only ever run by tests)."""
    node = listed(NodeState.MAINTENANCE)
    for _ in range(OFFLINE_AFTER_FAILED_CHECKS + 1):
        nodes_record_health([HealthResult(node.pk, False, "No SSH answer")], running_vm_ids={})
    node.refresh_from_db()
    assert node.state == NodeState.MAINTENANCE and node.health_failures == OFFLINE_AFTER_FAILED_CHECKS + 1
    nodes_record_health([HealthResult(node.pk, True, vms={}, probed_at=timezone.now())], running_vm_ids={})
    node.refresh_from_db()
    assert node.state == NodeState.MAINTENANCE and node.health_failures == 0
