"""A seeded random run of many instances starting, stopping, restarting, failing and being destroyed, renters
topping up and running dry, prices changing, and meter ticks at random moments (both kinds). Afterwards every
run of every instance was charged for exactly its whole seconds, with no gap and no overlap, at the price and
fee of its booking; and the ledger invariants (conftest) hold."""
import random
from datetime import timedelta

import pytest

from billing.models import BillingEvent, TopUp, TopUpStatus, UsageInterval
from billing.services import payments
from billing.services.enforcement import balances_enforce
from billing.services.metering import SECOND, usage_meter
from core.errors import ApplicationError
from marketplace.models import Instance, Node
from marketplace.services import instances as svc
from provisioning.models import OPEN_JOB_STATUSES, Job
from tests.billing.helpers import book, fund, node, run
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PRICES = ["0.333333", "1.234567", "2.718281", "0.000360", "7.000001"]


@pytest.mark.parametrize("seed", [3, 4])
def test_a_random_run_charges_every_running_second_exactly_once(clock, settings, seed):
    # Renting needs 10 minutes of the renter's whole burn rate here, not an hour: balances run dry often.
    settings.BILLING_FUNDS_REQUIRED_S = 600
    rng = random.Random(seed)
    renters = [UserFactory() for _ in range(5)]
    for renter in renters:
        fund(renter, str(rng.choice([3, 8, 40])))
    nodes = [node(rng.choice(PRICES), gpu_count=8) for _ in range(3)]
    segments: dict[int, list[list]] = {}  # instance -> [[start, end or None], ...]
    booked_price: dict[int, int] = {}
    statuses: dict[int, str] = {}
    top_ups = 0

    def observe():
        for pk, status, started_at in Instance.objects.values_list("pk", "status", "started_at"):
            was = statuses.get(pk)
            if was != "running" and status == "running":
                segments.setdefault(pk, []).append([started_at, None])
            elif was == "running" and status != "running":
                segments[pk][-1][1] = clock.now
            statuses[pk] = status

    def worker_done(instance):
        """What the worker does after recording the node's answer: close the instance's job (one open job of a
        kind per instance: provisioning.models.Job)."""
        Job.objects.filter(instance_id=instance.pk, status__in=OPEN_JOB_STATUSES).update(
            status="succeeded", finished_at=clock.now)

    def pick(*wanted):
        candidates = [pk for pk, status in statuses.items() if status in wanted]
        return Instance.objects.get(pk=rng.choice(candidates)) if candidates else None

    for _ in range(600):
        clock.advance(rng.uniform(0.05, 240))
        action = rng.choices(
            ["book", "stop", "stopped", "start", "restart", "destroy", "destroyed", "fail", "tick", "top_up",
             "price", "enforce", "running"],
            weights=[8, 3, 3, 3, 2, 2, 3, 1, 8, 1, 1, 3, 5])[0]
        try:
            if action == "book":
                instance = book(rng.choice(renters), rng.choice(nodes), rng.randint(1, 2))
                booked_price[instance.pk] = instance.price_per_hour_micros
            elif action == "running" and (i := pick("requested", "provisioning", "starting")):
                run(i)
                worker_done(i)
            elif action == "stop" and (i := pick("running")):
                svc.instance_stop(instance=i)
            elif action == "stopped" and (i := pick("stopping")):
                svc.instance_mark_stopped(instance_id=i.pk)
                worker_done(i)
            elif action == "start" and (i := pick("stopped")):
                svc.instance_start(instance=i)
            elif action == "restart" and (i := pick("running")):
                svc.instance_restart(instance=i)
            elif action == "destroy" and (i := pick("running", "stopped", "requested", "failed")):
                svc.instance_destroy(instance=i)
            elif action == "destroyed" and (i := pick("destroying")):
                svc.instance_mark_destroyed(instance_id=i.pk)
                worker_done(i)
            elif action == "fail" and (i := pick("running", "provisioning", "starting", "stopping")):
                svc.instance_mark_failed(instance_id=i.pk, message="random failure")
                worker_done(i)
            elif action == "tick":
                usage_meter(set_based=rng.random() < 0.7, batch_size=rng.choice([2, 7, 10_000]))
            elif action == "top_up":
                renter = rng.choice(renters)
                top_ups += 1
                top_up = TopUp.objects.create(user=renter, amount_micros=rng.choice([5, 10, 25]) * 1_000_000,
                                              status=TopUpStatus.PROCESSING)
                payments.top_up_credit(top_up_id=top_up.pk, payment_intent_id=f"pi_{top_ups}",
                                       amount_micros=top_up.amount_micros)
            elif action == "price":
                Node.objects.filter(pk=rng.choice(nodes).pk).update(
                    price_per_gpu_hour_micros=rng.randint(1, 9_000_000))
            elif action == "enforce":
                usage_meter()
                balances_enforce()
        except ApplicationError:
            pass  # no GPU free, no funds, a state that forbids it: refused, nothing changed
        observe()

    for pk, status in list(statuses.items()):
        if status == "running":
            svc.instance_stop(instance=Instance.objects.get(pk=pk))
    observe()

    assert len(segments) > 25 and sum(len(s) for s in segments.values()) > 40, "too few runs to mean much"
    kinds = set(BillingEvent.objects.values_list("kind", flat=True))
    assert {"balance_depleted", "low_balance"} <= kinds, "the run should have emptied some balances"
    intervals = list(UsageInterval.objects.order_by("instance_id", "started_at"))
    by_instance: dict[int, list[UsageInterval]] = {}
    for interval in intervals:
        by_instance.setdefault(interval.instance_id, []).append(interval)
    for pk in statuses:
        charged = by_instance.get(pk, [])
        assert all(i.price_per_hour_micros == booked_price[pk] for i in charged), "a price change reached a booking"
        used = 0
        for start, end in segments.get(pk, []):
            whole = (end - start) // SECOND
            mine = [i for i in charged if start <= i.started_at < end]
            used += len(mine)
            assert sum(i.seconds for i in mine) == whole, f"instance {pk}: run {start}..{end}"
            if whole:
                assert mine[0].started_at == start and mine[-1].ended_at == start + whole * SECOND
            for a, b in zip(mine, mine[1:], strict=False):
                assert b.started_at == a.ended_at, f"instance {pk}: a gap or an overlap at {a.ended_at}"
        assert used == len(charged), f"instance {pk}: charged outside its runs"
    assert Instance.objects.filter(status="running").count() == 0
    assert clock.now - timedelta(hours=1) > min(s[0] for runs in segments.values() for s in runs)
