"""A give-back re-bases the meter at the seconds paid for (billing.services.metering.usage_give_back): what a later
run costs, whichever path prices it (the live cost, a state change's close), and what tests/billing/invariants.py
lets through (exactly that re-base: no rate base moved without a give-back, nor further or by more than it gave back).
The meter's tick on PostgreSQL: tests/billing/test_given_back_seconds_readers.py's last test."""

from datetime import timedelta

import pytest
from django.db import transaction

from billing.pricing import instance_cost_so_far
from billing.services.metering import _rebase_after_give_back, cost_for, usage_give_back
from marketplace.models import Instance
from tests.billing.helpers import fund, node, running, start, stop
from tests.billing.invariants import assert_billing_invariants
from tests.billing.test_round45_given_back_usage_readers import _ledger_paid
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

KEPT_S, BILLED_S, AGAIN_S = 61, 129, 61  # 1.5 $/h: cost(129 + 61) - cost(129) = 25,416, cost(122) - cost(61) = 25,417


def _given_back(clock) -> Instance:
    """An instance billed 129 s, its last 68 given back (stopped), as the readers' test makes it."""
    renter = UserFactory()
    fund(renter, "50")
    instance = running(renter, node(price="1.500000", gpu_count=1))
    started = instance.started_at
    assert started is not None
    clock.advance(BILLED_S + 0.5)
    instance = stop(instance)
    with transaction.atomic():
        locked = Instance.objects.select_for_update().get(pk=instance.pk)
        given = usage_give_back(
            instance=locked,
            since=started + timedelta(seconds=KEPT_S + 0.4),
            seen_at=started + timedelta(seconds=KEPT_S + 30),
            memo="test",
            customer_note="test",
        )
    assert given is not None and given.seconds == BILLED_S - KEPT_S
    instance = Instance.objects.get(pk=instance.pk)
    assert (instance.rate_base_seconds, instance.rate_base_cost_micros) == (
        BILLED_S - KEPT_S,
        given.amount_micros,
    )  # moved on by the seconds given back and what they were charged
    return instance


def test_the_live_cost_and_the_stops_close_price_a_later_run_from_the_seconds_paid_for(clock):
    instance = _given_back(clock)
    price = instance.price_per_hour_micros
    instance = start(instance)
    clock.advance(AGAIN_S + 0.5)
    next_run = cost_for(price, KEPT_S + AGAIN_S) - cost_for(price, KEPT_S)
    assert next_run != cost_for(price, BILLED_S + AGAIN_S) - cost_for(price, BILLED_S)  # the case that differs
    assert instance_cost_so_far(instance=instance) == instance.cost_micros + next_run  # the live panel
    instance = stop(Instance.objects.get(pk=instance.pk))  # no tick: the stop's close charges the whole run
    assert instance.cost_micros - cost_for(price, BILLED_S) == next_run
    assert _ledger_paid(instance) == cost_for(price, KEPT_S + AGAIN_S)


def _assert_refused(instance: Instance, **fields) -> None:
    kept = {name: getattr(instance, name) for name in fields}
    Instance.objects.filter(pk=instance.pk).update(**fields)
    with pytest.raises(AssertionError):
        assert_billing_invariants()
    Instance.objects.filter(pk=instance.pk).update(**kept)
    assert_billing_invariants()


def test_the_invariants_allow_that_re_base_and_no_other(clock):
    instance = _given_back(clock)
    price, billed = instance.price_per_hour_micros, instance.billed_seconds
    assert_billing_invariants()

    def base(seconds: int, moved_cost: int = 0) -> dict[str, int]:  # cost_micros == base + cost(billed - base) kept
        return {
            "rate_base_seconds": seconds,
            "rate_base_cost_micros": instance.cost_micros - cost_for(price, billed - seconds) + moved_cost,
        }

    _assert_refused(instance, **base(BILLED_S - KEPT_S + 1))  # moved further than the seconds given back
    _assert_refused(instance, **base(BILLED_S - KEPT_S - 1))  # not as far: its cost is not what was given back
    _assert_refused(instance, given_back_seconds=BILLED_S - KEPT_S - 1)  # moved further than the seconds given back
    # Nothing given back: a rate base away from where a price changed is refused, as before.
    _assert_refused(instance, given_back_seconds=0)


def test_a_give_back_reaching_before_the_last_price_change_bases_the_meter_at_the_seconds_charged():
    """The run given back ran across a price change (its base at 100 s billed): none of the seconds paid for are at
    the new price, so the meter starts afresh where the seconds charged end, as a price change does."""
    instance = Instance(
        price_per_hour_micros=1_000_000,
        billed_seconds=129,
        cost_micros=40_000,
        rate_base_seconds=100,
        rate_base_cost_micros=31_944,
    )
    assert _rebase_after_give_back(instance, 68) == (129, 40_000)
    assert _rebase_after_give_back(instance, 29) == (129, 40_000 - cost_for(1_000_000, 0))  # exactly to the base
    assert _rebase_after_give_back(instance, 9) == (109, 40_000 - cost_for(1_000_000, 20))
