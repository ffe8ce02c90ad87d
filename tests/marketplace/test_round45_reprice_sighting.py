"""A re-verification's price change between two health checks, and the meter. The meter bills a running instance up
to its node's `last_seen_at`, which is also the last sighting of its VM (test_meter_seen_by_verification). A price
change (a cut by a worse re-check, node_instances_price_cut; a raise back by a better one,
node_instances_price_follow) billed each running instance up to the change itself at the old price and re-based the
meter there: a VM gone since the last check was paid for up to the change, and the check that then found it gone
interrupted it there (instance_interrupt keeps what was billed): the renter paid for a dead VM's time, never given
back, and its credit counted from the change instead of the sighting. Now a price change bills a running instance
only as far as the meter's tick would (the last sighting) and re-bases there; the next tick bills from there to the
next sighting at the new price, once. Real services on PostgreSQL; only the order in which they run is chosen
here. Amounts to the micro-dollar."""
from datetime import timedelta

import pytest

from billing.models import BillingEvent, EventKind
from billing.services.metering import cost_for, usage_meter
from marketplace.models import Gpu, Instance, Interruption, Node
from marketplace.services import instances as svc
from marketplace.services.instances.interruptions import _at
from provisioning.services.fleet_record import node_record_health, nodes_record_health
from provisioning.services.nodes import HealthResult
from tests.billing.conftest import (  # noqa: F401 (the billing fixtures: fake clock, ledger invariants, ...)
    billing_settings,
    clock,
    ledger_invariants,
    no_task_queue,
    sent_jobs_fixture,
)
from tests.billing.helpers import balance, fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

SECOND = timedelta(seconds=1)
LOST_PRICE, KEPT_PRICE = 3_000_000, 1_500_000  # $/h of the 2-GPU and the 1-GPU instance, in micro-dollars
TICKS = pytest.mark.parametrize("set_based", [True, False], ids=["sql-tick", "per-instance-tick"])


@pytest.fixture
def rented(clock):  # noqa: F811 (the fixture imported above)
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
    return renter, neighbour, Node.objects.get(pk=host.pk), lost, kept


def _check(host, lost, kept, clock, *, gone):  # noqa: F811
    """One health check of `host`, probed now, recorded a second later; `gone`: it finds `lost`'s VM gone. Returns
    the instances it interrupted, and the node's last_seen_at after it."""
    probed = clock.now
    clock.advance(1)
    vms = {kept.vm_id: "running"} if gone else {kept.vm_id: "running", lost.vm_id: "running"}
    result = HealthResult(host.pk, True, vms=vms, probed_at=probed,
                          gpu_uuids=list(Gpu.objects.filter(node=host).values_list("uuid", flat=True)))
    interrupted = nodes_record_health([result], running_vm_ids={host.pk: {lost.vm_id, kept.vm_id}}).get(host.pk, [])
    seen = Node.objects.get(pk=host.pk).last_seen_at
    assert seen == probed
    return interrupted, seen


def _intervals(instance):
    return list(Instance.objects.get(pk=instance.pk).usage_intervals.order_by("started_at")
                .values_list("started_at", "ended_at", "price_per_hour_micros"))


def _price_event(user, kind):
    return BillingEvent.objects.get(user=user, kind=kind).message


def _assert_billed(instance, started, stretches):
    """`stretches`: [(from, to, price), ...] back to back from `started`; the instance billed exactly these, with
    the meter's cumulative rounding re-based at each price change."""
    cost, seconds = 0, 0
    for begin, end, price in stretches:
        cost += cost_for(price, (end - begin) // SECOND)
        seconds += (end - begin) // SECOND
    row = Instance.objects.get(pk=instance.pk)
    assert _intervals(instance) == stretches, "billed stretches (start, end, price)"
    assert stretches[0][0] == started
    assert (row.billed_until, row.billed_seconds, row.cost_micros) == (stretches[-1][1], seconds, cost)
    return cost


@TICKS
def test_a_price_cut_between_two_checks_bills_up_to_the_last_sighting_then_the_new_price_once(
        rented, clock, set_based):  # noqa: F811
    """The reviewer's case: the VM of `lost` goes after a check, a re-check cuts the node's prices, the next check
    finds it gone. `kept`, seen by that check, is billed from the last sighting to the new one at the cut price by
    the next tick, exactly once (no gap, nothing twice: a second tick adds nothing)."""
    renter, neighbour, host, lost, kept = rented
    started = Instance.objects.get(pk=lost.pk).started_at
    assert Instance.objects.get(pk=kept.pk).started_at == started
    clock.advance(60)
    _, last_seen = _check(host, lost, kept, clock, gone=False)  # both VMs seen at +60 s
    usage_meter(set_based=set_based)
    clock.advance(40)  # the VM of `lost` goes somewhere in here
    # A re-verification concludes: the node measured worse, its renters' prices are halved. It reads the GPUs, not
    # the VMs: nothing of it is a sighting.
    assert svc.node_instances_price_cut(node_id=host.pk, ratio=0.5, reason="lower score", score_before=100.0) == [
        lost.pk, kept.pk]
    # Billed at the old price up to the last sighting, and no further: the new price from there.
    assert Instance.objects.get(pk=lost.pk).billed_until == last_seen
    assert Instance.objects.get(pk=kept.pk).billed_until == last_seen
    assert f"From {_at(last_seen)} it costs $1.50/h instead of $3.00/h" in _price_event(renter, EventKind.PRICE_CUT)
    clock.advance(15)

    interrupted, next_seen = _check(host, lost, kept, clock, gone=True)
    assert interrupted == [lost.pk]
    interruption = Interruption.objects.get(instance_id=lost.pk)
    assert interruption.started_at == last_seen  # where its billing closes, and its credit counts from
    lost_cost = _assert_billed(lost, started, [(started, last_seen, LOST_PRICE)])
    assert lost_cost == cost_for(LOST_PRICE, 60) == 50_000
    assert balance(renter) == 50_000_000 - lost_cost + interruption.credited_micros

    usage_meter(set_based=set_based)
    usage_meter(set_based=set_based)  # nothing twice
    kept_cost = _assert_billed(kept, started, [(started, last_seen, KEPT_PRICE),
                                               (last_seen, next_seen, KEPT_PRICE // 2)])
    assert (next_seen - last_seen) // SECOND == 56
    assert kept_cost == cost_for(KEPT_PRICE, 60) + cost_for(KEPT_PRICE // 2, 56) == 25_000 + 11_666
    assert balance(neighbour) == 50_000_000 - kept_cost


@TICKS
def test_a_price_raise_back_between_two_checks_bills_up_to_the_last_sighting_then_the_new_price_once(
        rented, clock, set_based):  # noqa: F811
    """The same through the raise back (node_instances_price_follow -> instance_price_follow): a cut, a check that
    sees both VMs, then a better re-check restores the full price before the check that finds `lost` gone."""
    renter, neighbour, host, lost, kept = rented
    started = Instance.objects.get(pk=lost.pk).started_at
    clock.advance(60)
    _, seen_1 = _check(host, lost, kept, clock, gone=False)
    usage_meter(set_based=set_based)
    clock.advance(9)
    assert svc.node_instances_price_cut(node_id=host.pk, ratio=0.5, reason="lower score", score_before=100.0)
    clock.advance(20)
    _, seen_2 = _check(host, lost, kept, clock, gone=False)  # both VMs seen: the cut price up to here
    usage_meter(set_based=set_based)
    clock.advance(30)  # the VM of `lost` goes somewhere in here
    assert svc.node_instances_price_follow(node_id=host.pk, score=100.0, last_score=50.0) == [lost.pk, kept.pk]
    assert Instance.objects.get(pk=lost.pk).billed_until == seen_2
    assert f"From {_at(seen_2)} it costs $3.00/h instead of $1.50/h" in _price_event(renter,
                                                                                     EventKind.PRICE_RAISED_BACK)
    clock.advance(15)

    interrupted, seen_3 = _check(host, lost, kept, clock, gone=True)
    assert interrupted == [lost.pk]
    interruption = Interruption.objects.get(instance_id=lost.pk)
    assert interruption.started_at == seen_2
    assert ((seen_1 - started) // SECOND, (seen_2 - seen_1) // SECOND, (seen_3 - seen_2) // SECOND) == (60, 30, 46)
    lost_cost = _assert_billed(lost, started, [(started, seen_1, LOST_PRICE), (seen_1, seen_2, LOST_PRICE // 2)])
    assert lost_cost == 50_000 + 12_500
    assert balance(renter) == 50_000_000 - lost_cost + interruption.credited_micros

    usage_meter(set_based=set_based)
    usage_meter(set_based=set_based)
    kept_cost = _assert_billed(kept, started, [(started, seen_1, KEPT_PRICE), (seen_1, seen_2, KEPT_PRICE // 2),
                                               (seen_2, seen_3, KEPT_PRICE)])
    assert kept_cost == 25_000 + 6_250 + 19_166
    assert balance(neighbour) == 50_000_000 - kept_cost
