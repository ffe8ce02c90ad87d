"""The fleet's batch messages (fleet_health_batch, fleet_reconcile_batch) expire within their interval, less the
margin the dispatchers' beat ticks have (b3cfdeb), and a batch whose cycle is no longer the last one queued runs
nothing: its nodes are in the later cycle's batches. Before, a batch message expired a full interval after it was
sent, and the next cycle may come half an interval after the last (the dispatcher's guard: a tick taken late, then
the next one on time), so a late batch ran after the next cycle's had checked its nodes: a node silent at that
moment got two failed checks back to back, its renters interrupted after two."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import NodeState
from provisioning.services import fleet
from provisioning.ssh_pool import SshPool
from tests.billing.helpers import fund, running
from tests.factories import UserFactory, make_listed_node
from tests.provisioning.test_fleet_batches import Broker, closed_port

KINDS = {"health": ("nodes-health-check", "HEALTH_CHECK_INTERVAL_S", fleet.nodes_health_dispatch),
         "reconcile": ("nodes-reconcile", "RECONCILE_INTERVAL_S", fleet.nodes_reconcile_dispatch)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_batch_message_expires_within_its_interval_less_the_beat_ticks_margin(db, settings, monkeypatch, kind):
    entry, interval_setting, dispatch = KINDS[kind]
    interval = getattr(settings, interval_setting)
    make_listed_node()
    broker = Broker()
    monkeypatch.setattr(fleet, "current_app", broker)
    assert dispatch()["batches"] == 1
    expires = broker.sent[0][2]["expires"]
    assert expires < interval, "a batch message outlives its interval: it can run after the next cycle's"
    assert expires == settings.CELERY_BEAT_SCHEDULE[entry]["options"]["expires"]  # b3cfdeb's margin


def test_a_late_batch_of_a_cycle_the_next_one_followed_does_not_check_its_nodes_again(db, settings, monkeypatch):
    renter = UserFactory()
    fund(renter, "50")
    dead = make_listed_node(address="127.0.0.1", ssh_port=closed_port())  # silent at that moment
    instance = running(renter, dead)
    interval = settings.HEALTH_CHECK_INTERVAL_S
    broker = Broker()
    monkeypatch.setattr(fleet, "current_app", broker)
    tick = timezone.now() + timedelta(days=3650)  # a time no other test dispatched at
    late = tick + timedelta(seconds=interval / 2 - 1)  # its tick taken late (beat's tick expires later still)
    on_time = tick + timedelta(seconds=interval)  # the next tick, on time: half an interval later, a cycle
    assert fleet.nodes_health_dispatch(now=late)["batches"] == 1
    assert fleet.nodes_health_dispatch(now=on_time)["batches"] == 1
    (_, (ids, first_cycle), first), (_, (_, next_cycle), _) = broker.sent
    pool = SshPool()
    fleet.nodes_health_batch(ids, cycle=next_cycle, pool=pool)  # the next cycle's batch, taken at once
    taken = on_time + timedelta(seconds=2)  # the late cycle's message, taken a moment later by another worker
    if late + timedelta(seconds=first["expires"]) > taken:  # not expired yet: the worker runs it
        fleet.nodes_health_batch(ids, cycle=first_cycle, pool=pool)
    dead.refresh_from_db()
    instance.refresh_from_db()
    assert dead.health_failures == 1, "one silent moment counted as two checks: the late batch ran after the next"
    assert instance.status == "running" and dead.state == NodeState.ACTIVE
