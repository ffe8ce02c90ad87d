"""The fleet's dispatchers queue one cycle per interval (found by review): a backlog of beat ticks left while the
fleet workers were away, or a tick delivered twice, ran as a burst of cycles, each checking every node again."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import NodeState
from provisioning.services import fleet
from provisioning.ssh_pool import SshPool
from tests.billing.helpers import fund, running
from tests.factories import UserFactory, make_listed_node
from tests.provisioning.test_fleet_batches import Broker, closed_port


def test_a_backlog_of_beat_health_dispatches_checks_a_node_once_not_once_per_missed_tick(db, settings, monkeypatch):
    entry = settings.CELERY_BEAT_SCHEDULE["nodes-health-check"]
    expires = entry.get("options", {}).get("expires")
    renter = UserFactory()
    fund(renter, "50")
    dead = make_listed_node(address="127.0.0.1", ssh_port=closed_port())  # silent right when the worker is back
    instance = running(renter, dead)
    interval = settings.HEALTH_CHECK_INTERVAL_S
    t0 = timezone.now()
    ticks = [t0 + timedelta(seconds=i * interval) for i in range(3)]  # 3 ticks while the fleet workers were away
    back = ticks[-1] + timedelta(seconds=interval / 2)  # a worker takes the queue again
    delivered = [t for t in ticks if expires is None or t + timedelta(seconds=expires) > back]
    broker = Broker()
    monkeypatch.setattr(fleet, "current_app", broker)
    for i, _ in enumerate(delivered):
        fleet.nodes_health_dispatch(now=back + timedelta(seconds=i))  # back to back, a second apart
    pool = SshPool()
    for _, (ids, cycle), _ in broker.sent:
        fleet.nodes_health_batch(ids, cycle=cycle, pool=pool)
    dead.refresh_from_db()
    instance.refresh_from_db()
    assert (len(delivered), dead.health_failures) == (1, 1), "one silent moment counted as several checks"
    assert instance.status == "running" and dead.state == NodeState.ACTIVE


@pytest.mark.parametrize("entry", ["nodes-health-check", "nodes-reconcile"])
def test_the_fleet_dispatchers_beat_entries_expire_within_their_interval(settings, entry):
    interval = {"nodes-health-check": settings.HEALTH_CHECK_INTERVAL_S,
                "nodes-reconcile": settings.RECONCILE_INTERVAL_S}[entry]
    expires = settings.CELERY_BEAT_SCHEDULE[entry].get("options", {}).get("expires")
    assert expires is not None and interval / 2 < expires < interval


@pytest.mark.parametrize("kind", ["health", "reconcile"])
def test_a_dispatch_delivered_again_soon_after_its_cycle_queues_nothing(db, settings, monkeypatch, kind):
    dispatch = {"health": fleet.nodes_health_dispatch, "reconcile": fleet.nodes_reconcile_dispatch}[kind]
    interval = {"health": settings.HEALTH_CHECK_INTERVAL_S, "reconcile": settings.RECONCILE_INTERVAL_S}[kind]
    make_listed_node()
    broker = Broker()
    monkeypatch.setattr(fleet, "current_app", broker)
    start = timezone.now() + timedelta(days=3650)  # a time no other test dispatched at
    assert dispatch(now=start)["batches"] == 1
    again = dispatch(now=start + timedelta(seconds=2))  # the same tick delivered twice (a worker lost after it)
    assert "skipped" in again and len(broker.sent) == 1
    # The next tick, on time (or a little early: beat's jitter), is a cycle of its own.
    assert dispatch(now=start + timedelta(seconds=interval - 3))["batches"] == 1
    assert len({args[1] for _, args, _ in broker.sent}) == 2
