"""Round 52 review (metering under faults), its two proven findings.

1. The live "cost so far" (GET /api/v1/instances/, the instance page) of a running instance whose node's latest
   check failed counted every second up to now, time the platform never bills (the meter stops at the node's last
   healthy moment, a state change and the interruption close there): the shown cost rose during the outage, then
   fell to what was charged. It now ends where a state change would bill (node_billable_until's rule), with the node's
   fields read in the list's own query.
2. A run that began before what was billed (`started_at < billed_until`: clocks of different hosts) was billed from
   `billed_until`, off its whole-second grid: the SQL tick rounded the seconds (11 charged for 10.5 s) and the Python
   path charged 10 s for 10.5 s. A run now begins no earlier than `billed_until`, and the SQL tick floors.
"""
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from billing.models import UsageInterval
from billing.pricing import instance_cost_so_far
from billing.selectors import instance_cost
from billing.services.metering import usage_meter
from marketplace.models import Instance, InterruptionCause, Node, NodeState
from marketplace.services import instances as svc
from tests.billing.helpers import fund, node, running, start, stop
from tests.conftest import _client_for
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PER_SECOND = "3.600000"  # per GPU-hour: 1000 µ$ a second


def _silent_since_last_healthy(clock, on) -> None:
    """The node answered 60 s after the start; its next check, 110 s later, failed (not interrupted yet)."""
    clock.advance(60)
    Node.objects.filter(pk=on.pk).update(last_seen_at=clock.now)
    usage_meter()
    clock.advance(110)
    Node.objects.filter(pk=on.pk).update(health_failures=1)
    usage_meter()


def test_cost_so_far_shown_while_its_node_is_silent_is_what_is_charged(clock):
    renter = UserFactory()
    fund(renter, "100")
    on = node(PER_SECOND)
    instance = running(renter, on)
    clock.advance(60)
    Node.objects.filter(pk=on.pk).update(last_seen_at=clock.now)  # last healthy answer
    last_healthy = clock.now
    usage_meter()
    clock.advance(110)
    Node.objects.filter(pk=on.pk).update(health_failures=1)  # its next check failed (not yet interrupted)
    usage_meter()
    instance.refresh_from_db()
    shown = instance_cost_so_far(instance=instance)  # what GET /instances/<id> says as cost_so_far
    svc.instance_interrupt(instance_id=instance.pk, since=last_healthy, cause="node_lost", detail="no answer")
    instance.refresh_from_db()
    assert instance.cost_micros == 60_000  # charged up to the last healthy moment only
    assert shown == instance.cost_micros, (shown, instance.cost_micros)


@pytest.mark.parametrize("state", [NodeState.QUARANTINED, NodeState.RETIRED])
def test_cost_so_far_on_a_node_no_longer_checked_ends_at_its_last_check(clock, state):
    renter = UserFactory()
    fund(renter, "100")
    on = node(PER_SECOND)
    instance = running(renter, on)
    clock.advance(30)
    Node.objects.filter(pk=on.pk).update(last_seen_at=clock.now)
    clock.advance(500)
    Node.objects.filter(pk=on.pk).update(state=state)
    instance.refresh_from_db()
    shown = instance_cost_so_far(instance=instance)
    svc.instance_stop(instance=instance)  # a stop bills as far as node_billable_until says
    instance.refresh_from_db()
    assert shown == instance.cost_micros == 30_000


def test_cost_so_far_on_a_node_that_answers_counts_up_to_now(clock):
    renter = UserFactory()
    fund(renter, "100")
    on = node(PER_SECOND)
    instance = running(renter, on)
    clock.advance(30)
    Node.objects.filter(pk=on.pk).update(last_seen_at=clock.now)
    clock.advance(12.5)  # healthy: a stop now bills up to now, and so does the live cost
    instance.refresh_from_db()
    assert instance_cost_so_far(instance=instance) == 42_000


def _reads(captured) -> int:
    return sum(q["sql"].startswith("SELECT") for q in captured.captured_queries)  # (an API key's use is written)


def test_the_api_and_the_page_show_the_bounded_cost_with_no_query_per_instance(clock):
    renter = UserFactory()
    fund(renter, "100")
    silent, healthy = node(PER_SECOND), node(PER_SECOND)
    first = running(renter, silent)
    on_healthy = running(renter, healthy)
    client = _client_for(renter)
    client.get("/api/v1/instances/")
    with CaptureQueriesContext(connection) as two:
        assert client.get("/api/v1/instances/").status_code == 200
    second = running(renter, silent)
    _silent_since_last_healthy(clock, silent)  # second started with first: both billed for 60 s only
    Node.objects.filter(pk=healthy.pk).update(last_seen_at=clock.now)
    with CaptureQueriesContext(connection) as three:
        rows = {r["id"]: r for r in client.get("/api/v1/instances/").json()["results"]}
    assert _reads(three) == _reads(two)  # the node's fields come with the list: no query per instance
    for instance in (first, second):
        assert Decimal(rows[instance.pk]["cost_so_far"]) == Decimal("0.06")
        assert Decimal(client.get(f"/api/v1/instances/{instance.pk}/").json()["cost_so_far"]) == Decimal("0.06")
        instance.refresh_from_db()
        assert instance_cost(instance=instance)["amount_micros"] == 60_000  # the instance page
    assert Decimal(rows[on_healthy.pk]["cost_so_far"]) == Decimal("0.17")


# ------------------------------------------------------------------------------------ runs before billed_until


def _billed_ahead(clock, on, set_based):
    """The tick's host is 0.5 s ahead of the others: billed_until = started + 10 s, now = started + 9.5 s."""
    clock.advance(10)
    Node.objects.filter(pk=on.pk).update(last_seen_at=clock.now + timedelta(seconds=1))
    usage_meter(now=clock.now + timedelta(seconds=0.5), set_based=set_based)
    clock.advance(-0.5)


def _next_tick_whole_seconds(clock, on, instance, set_based):
    clock.advance(11.2)
    Node.objects.filter(pk=on.pk).update(last_seen_at=clock.now)
    usage_meter(set_based=set_based)
    last = UsageInterval.objects.filter(instance=instance).order_by("-started_at").first()
    span = last.ended_at - last.started_at
    assert last.seconds == span // timedelta(seconds=1) and span % timedelta(seconds=1) == timedelta(0), \
        (last.seconds, span)


@pytest.mark.parametrize("set_based", [True, False])
def test_a_run_started_before_billed_until_bills_whole_seconds_only(clock, set_based):
    # Clock skew between hosts: the tick's host is 0.5 s ahead of the web host that stops and starts the instance.
    renter = UserFactory()
    fund(renter, "100")
    on = node(PER_SECOND)
    instance = running(renter, on)
    clock.advance(10)
    Node.objects.filter(pk=on.pk).update(last_seen_at=clock.now + timedelta(seconds=1))
    usage_meter(now=clock.now + timedelta(seconds=0.5), set_based=set_based)  # billed_until = started + 10 s
    clock.advance(-0.7)  # the web host's clock: stop at s+9.3, start at s+9.5
    instance = stop(instance)
    clock.advance(0.2)
    instance = start(instance)
    instance.refresh_from_db()
    assert instance.started_at >= instance.billed_until  # the run begins where billing got to
    _next_tick_whole_seconds(clock, on, instance, set_based)


@pytest.mark.parametrize("set_based", [True, False])
def test_a_run_resumed_after_an_interruption_begins_no_earlier_than_billed(clock, set_based):
    renter = UserFactory()
    fund(renter, "100")
    on = node(PER_SECOND)
    instance = running(renter, on)
    _billed_ahead(clock, on, set_based)
    svc.instance_interrupt(instance_id=instance.pk, since=None, cause=InterruptionCause.VM_LOST, detail="gone")
    instance.refresh_from_db()
    assert instance.status == "interrupted"
    svc.instance_resume(instance_id=instance.pk)
    instance.refresh_from_db()
    assert instance.status == "running" and instance.started_at >= instance.billed_until
    _next_tick_whole_seconds(clock, on, instance, set_based)


@pytest.mark.parametrize("set_based", [True, False])
def test_a_stop_that_never_reached_the_node_runs_again_from_no_earlier_than_billed(clock, set_based):
    renter = UserFactory()
    fund(renter, "100")
    on = node(PER_SECOND)
    instance = running(renter, on)
    _billed_ahead(clock, on, set_based)
    svc.instance_stop(instance=instance)
    instance = svc.instance_mark_running_again(instance_id=instance.pk, message="Running", only_in=("stopping",))
    instance.refresh_from_db()
    assert instance.status == "running" and instance.started_at >= instance.billed_until
    _next_tick_whole_seconds(clock, on, instance, set_based)


class _Undone(Exception):
    pass


def test_the_sql_tick_floors_a_part_second_it_is_given(clock):
    """A run already begun before what was billed (as a start before the clamp left it): the SQL tick charges the
    whole seconds in the span, as Python's //, not the span rounded. Undone after (the state breaks the ledger's
    whole-second invariant, whatever the tick does with it)."""
    renter = UserFactory()
    fund(renter, "100")
    on = node(PER_SECOND)
    instance = running(renter, on)
    clock.advance(10)
    usage_meter(set_based=True)
    instance.refresh_from_db()
    with pytest.raises(_Undone), transaction.atomic():
        Instance.objects.filter(pk=instance.pk).update(started_at=instance.billed_until - timedelta(seconds=0.5))
        clock.advance(10.7)  # 10.5 s after billed_until, on the run's grid
        usage_meter(set_based=True)
        last = UsageInterval.objects.filter(instance=instance).order_by("-started_at").first()
        assert last.ended_at - last.started_at == timedelta(seconds=10.5)
        assert last.seconds == 10, last.seconds  # was 11: the cast rounded
        raise _Undone
