"""A health batch's recovering nodes (answering after failures, or with interrupted instances) are reconciled in
parallel threads under a deadline, after the batch's other results are recorded, and Celery's soft time limit is
not swallowed on the way (found by review: one after another before anything was recorded, a few slow ones took
the batch past its soft limit, and `except Exception` caught the limit itself)."""
import threading
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.utils import timezone

from marketplace.models import NodeState
from provisioning.services import fleet
from provisioning.services.nodes import HealthResult
from tests.billing.helpers import fund, running
from tests.factories import UserFactory, make_listed_node
from tests.provisioning.test_fleet_batches import listed


def _all_answer(monkeypatch):
    monkeypatch.setattr(fleet, "nodes_probe", lambda nodes, parallelism, pool=None: [
        HealthResult(n.pk, True, vms={}, probed_at=timezone.now()) for n in nodes])


def test_a_health_batch_does_not_reconcile_its_recovering_nodes_one_after_another(db, monkeypatch):
    back = [listed(NodeState.OFFLINE, health_failures=3) for _ in range(8)]
    _all_answer(monkeypatch)

    def reconcile(node, pool=None):
        time.sleep(0.5)
        return {"resumed": 0, "restarted": 0, "instances_failed": 0}
    monkeypatch.setattr(fleet, "node_reconcile", reconcile)
    start = time.monotonic()
    summary = fleet.nodes_health_batch([n.pk for n in back], pool=object())
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, f"8 reconciles of 0.5 s took {elapsed:.1f} s: one after another"
    assert summary["checked"] == 8 and summary["failed"] == 0
    for node in back:
        node.refresh_from_db()
        assert (node.state, node.health_failures) == (NodeState.ACTIVE, 0)


def test_a_recovering_nodes_reconcile_past_its_deadline_costs_not_the_batchs_other_checks(db, monkeypatch):
    slow = listed(NodeState.OFFLINE, health_failures=3)
    quick = listed(NodeState.OFFLINE, health_failures=3)
    silent = listed(NodeState.ACTIVE)
    answering = listed(NodeState.ACTIVE)
    monkeypatch.setattr(fleet, "nodes_probe", lambda nodes, parallelism, pool=None: [
        HealthResult(n.pk, n.pk != silent.pk, "" if n.pk != silent.pk else "No SSH answer",
                     vms={} if n.pk != silent.pk else None, probed_at=timezone.now()) for n in nodes])
    release = threading.Event()

    def reconcile(node, pool=None):
        if node.pk == slow.pk:
            release.wait(30)
        return {"resumed": 0, "restarted": 0, "instances_failed": 0}
    monkeypatch.setattr(fleet, "node_reconcile", reconcile)
    monkeypatch.setattr(fleet, "HEALTH_RECONCILE_DEADLINE_S", 3.0)  # from the batch's start
    try:
        start = time.monotonic()
        summary = fleet.nodes_health_batch([slow.pk, quick.pk, silent.pk, answering.pk], pool=object())
        elapsed = time.monotonic() - start
    finally:
        release.set()
    assert elapsed < 10.0
    assert summary["unfinished"] == 1 and summary["failed"] == 1
    for node in (slow, quick, silent, answering):
        node.refresh_from_db()
    # The one not reconciled in time is not recorded back (it must not take rentals before it is reconciled).
    assert (slow.state, slow.health_failures) == (NodeState.OFFLINE, 3)
    assert (quick.state, quick.health_failures) == (NodeState.ACTIVE, 0)
    assert silent.health_failures == 1 and answering.last_checked_at is not None


def test_the_soft_time_limit_in_a_recovering_nodes_reconcile_is_not_swallowed(db, monkeypatch):
    first, second = listed(NodeState.OFFLINE, health_failures=3), listed(NodeState.OFFLINE, health_failures=3)
    answering = listed(NodeState.ACTIVE)
    _all_answer(monkeypatch)
    calls = []

    def reconcile(node, pool=None):
        calls.append(node.pk)
        if node.pk == first.pk:
            raise SoftTimeLimitExceeded()
        time.sleep(0.5)
        return {"resumed": 0, "restarted": 0, "instances_failed": 0}
    monkeypatch.setattr(fleet, "node_reconcile", reconcile)
    monkeypatch.setattr(fleet, "HEALTH_RECONCILE_PARALLELISM", 1)  # one after another: the second one waits
    with pytest.raises(SoftTimeLimitExceeded):
        fleet.nodes_health_batch([first.pk, second.pk, answering.pk], pool=object())
    time.sleep(1.0)
    assert calls == [first.pk], "after the soft time limit the batch went on to reconcile another node"
    # What needed no reconcile was recorded before it.
    answering.refresh_from_db()
    assert answering.last_checked_at is not None


def test_a_soft_time_limit_while_the_batch_waits_for_its_reconciles_records_those_done_and_starts_no_more(
        db, monkeypatch):
    """Celery raises the soft time limit in the batch's own thread, where it waits for the reconciles."""
    quick, slow, queued = (listed(NodeState.OFFLINE, health_failures=3) for _ in range(3))
    _all_answer(monkeypatch)
    calls, release = [], threading.Event()

    def reconcile(node, pool=None):
        calls.append(node.pk)
        if node.pk == slow.pk:
            release.wait(30)
        return {"resumed": 0, "restarted": 0, "instances_failed": 0}
    monkeypatch.setattr(fleet, "node_reconcile", reconcile)
    monkeypatch.setattr(fleet, "HEALTH_RECONCILE_PARALLELISM", 1)  # quick, then slow; queued waits for a thread
    real_wait = fleet.wait

    def wait_until_the_soft_limit(futures, timeout=None, return_when=None):
        real_wait(futures, timeout=1.0, return_when=return_when)
        raise SoftTimeLimitExceeded()
    monkeypatch.setattr(fleet, "wait", wait_until_the_soft_limit)
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            fleet.nodes_health_batch([quick.pk, slow.pk, queued.pk], pool=object())
    finally:
        release.set()
    time.sleep(0.5)
    assert calls == [quick.pk, slow.pk]  # none started after the limit
    for node in (quick, slow, queued):
        node.refresh_from_db()
    assert (quick.state, quick.health_failures) == (NodeState.ACTIVE, 0)  # reconciled before it: recorded
    assert (slow.state, slow.health_failures) == (NodeState.OFFLINE, 3)
    assert (queued.state, queued.health_failures) == (NodeState.OFFLINE, 3)


def test_the_soft_time_limit_in_a_lost_vms_reconcile_is_not_swallowed(db, monkeypatch):
    renter = UserFactory()
    fund(renter, "50")
    node = make_listed_node()
    running(renter, node)
    # It answers, but lists none of its VMs: its instance is interrupted, then reconciled in the same pass.
    monkeypatch.setattr(fleet, "nodes_probe", lambda nodes, parallelism, pool=None: [
        HealthResult(n.pk, True, vms={}, probed_at=timezone.now()) for n in nodes])

    def reconcile(node, pool=None):
        raise SoftTimeLimitExceeded()
    monkeypatch.setattr(fleet, "node_reconcile", reconcile)
    with pytest.raises(SoftTimeLimitExceeded):
        fleet.nodes_health_batch([node.pk], pool=object())
