"""Every reader of an instance's seconds billed shows the seconds paid for once usage was given back.

A VM found lost just as its renter stopped it (tests/billing/test_vm_lost_stop_race.py) has its run's 129 s billed,
69 s of them given back (billing.services.metering.usage_give_back): the renter paid for 60 s. The seconds given
back are recorded on the instance (Instance.given_back_seconds, in the give-back's transaction); the row's
billed_seconds and cost_micros stay what was charged (the meter's arithmetic, tests/billing/invariants.py). Before,
the instance page (and its live panel) said "2 min 09 s metered", the provider's earnings counted the 69 s as time
sold (GPU time sold: 258 GPU-seconds for 120 paid), and the usage page's total said "for 2 min 09 s of running
time". Real services on PostgreSQL. The instance page's selector: tests/billing/test_given_back_seconds_shown.py.

Left as it is: the statement's usage lines (charges of the month, in seconds and micro-dollars as charged; the
give-back is an adjustment line of its own month) and each usage interval's own seconds (what it charged; its
amount reads net). A later run of the same instance costs what the seconds paid for cost, to the micro-dollar (the
give-back re-bases the meter; before, it could be one micro-dollar off): the last test.
"""

import importlib
from datetime import timedelta

import pytest
from django.apps import apps
from django.db import transaction

from billing.models import BillingEvent, EventKind, UsageInterval
from billing.services.metering import cost_for, usage_give_back, usage_meter
from marketplace.models import Instance
from marketplace.templatetags.marketplace_web import duration
from tests.billing.helpers import fund, node, running, start, stop
from tests.billing.test_round45_given_back_usage_readers import _ledger_paid, given_back  # noqa: F401 (a fixture)
from tests.billing.test_vm_lost_stop_race import SEEN_S, TOTAL_S, rented  # noqa: F401 (a fixture)
from tests.conftest import _client_for
from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

BACK_S = TOTAL_S - SEEN_S  # 69


def test_the_give_back_records_its_seconds_on_the_instance(given_back):  # noqa: F811 (the fixture imported above)
    renter, host, lost, kept = given_back
    lost.refresh_from_db()
    assert (lost.billed_seconds, lost.given_back_seconds) == (TOTAL_S, BACK_S)
    [event] = [
        e for e in BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT) if "billing_stopped_at" in e.data
    ]
    assert event.data["instance"] == lost.pk and event.data["seconds"] == BACK_S  # what the renter was told
    assert Instance.objects.get(pk=kept.pk).given_back_seconds == 0  # the neighbour: nothing given back


def test_the_instance_page_and_its_live_panel_say_the_seconds_paid_for(given_back):  # noqa: F811 (the fixture imported above)
    renter, host, lost, kept = given_back
    client = logged_in(renter)
    for url in (f"/instances/{lost.pk}/", f"/instances/{lost.pk}/live/"):
        page = client.get(url)
        assert page.status_code == 200
        html = page.content.decode()
        assert f"({duration(SEEN_S)} metered, after {duration(BACK_S)} given back;" in html, url  # 1 min 00 s
        assert f"{duration(TOTAL_S)} metered" not in html, url  # was: 2 min 09 s metered
    kept.refresh_from_db()
    kept_page = logged_in(kept.renter).get(f"/instances/{kept.pk}/")
    assert f"({duration(kept.billed_seconds)} metered;" in kept_page.content.decode()  # nothing given back


def test_the_providers_earnings_count_the_seconds_sold(given_back):  # noqa: F811 (the fixture imported above)
    renter, host, lost, kept = given_back
    kept.refresh_from_db()
    answer = _client_for(host.provider).get("/api/v1/billing/earnings/")
    assert answer.status_code == 200, answer.content
    data = answer.json()
    assert data["billed_seconds"] == SEEN_S + kept.billed_seconds  # was TOTAL_S + kept's
    assert data["gpu_seconds_sold"] == SEEN_S * lost.num_gpus + kept.billed_seconds * kept.num_gpus
    page = logged_in(host.provider).get("/earnings/")
    assert page.context["earnings"].gpu_seconds == data["gpu_seconds_sold"]


def test_the_usage_pages_total_says_the_seconds_paid_for(given_back):  # noqa: F811 (the fixture imported above)
    renter, host, lost, kept = given_back
    page = logged_in(renter).get("/account/usage/", {"instance": lost.pk})
    assert page.status_code == 200
    totals = page.context["totals"]
    assert totals["seconds"] == SEEN_S and totals["amount"] == _ledger_paid(lost)  # seconds were TOTAL_S
    assert f"for {duration(SEEN_S)} of running time" in page.content.decode()
    everything = logged_in(renter).get("/account/usage/").context["totals"]
    assert everything["seconds"] == SEEN_S  # the renter's only instance
    # The neighbour's renter, nothing given back: as billed.
    kept.refresh_from_db()
    assert logged_in(kept.renter).get("/account/usage/").context["totals"]["seconds"] == kept.billed_seconds


def test_the_migration_counts_the_give_backs_made_before_it(given_back):  # noqa: F811 (the fixture imported above)
    """Migration 0038 backfills given_back_seconds from each give-back's event (the disk's events left out)."""
    renter, host, lost, kept = given_back
    Instance.objects.filter(pk=lost.pk).update(given_back_seconds=0)
    BillingEvent.objects.create(
        user=kept.renter,
        kind=EventKind.CREDIT,
        message="the disk's",
        data={"instance": kept.pk, "disk": True, "seconds": 30, "billing_stopped_at": "2026-01-01T00:00:00+00:00"},
    )
    migration = importlib.import_module("marketplace.migrations.0038_instance_given_back_seconds")
    migration.given_back_seconds_from_events(apps, None)
    assert Instance.objects.get(pk=lost.pk).given_back_seconds == BACK_S
    assert Instance.objects.get(pk=kept.pk).given_back_seconds == 0


PRICE_S = (61, 129, 61)  # paid for, billed, run again: 1.5 $/h is 416⅔ µ$/s, so the fractions differ


def test_a_later_run_after_a_give_back_costs_what_the_seconds_paid_for_cost(clock):
    """A run given back in part (its instance stopped), then started and run again: the renter's total is what its
    seconds paid for cost at the cumulative rounding, as after an interruption at the last sighting (billed up to
    it, the meter going on from there), to the micro-dollar. The give-back re-bases the meter at the seconds paid
    for (rate_base_*: 68 s on, by what they were charged), so the next 61 s charge cost(61 + 61) - cost(61) =
    25,417 µ$; before, the meter went on from billed_seconds (129), which counts those given back: cost(129 + 61) -
    cost(129) = 25,416 µ$, one micro-dollar short. The meter's tick (usage_meter: SQL on PostgreSQL) bills part of
    the run, the stop's close the rest; tests/billing/invariants.py allows exactly that re-base."""
    kept_s, billed_s, again_s = PRICE_S
    renter = UserFactory()
    fund(renter, "50")
    instance = running(renter, node(price="1.500000", gpu_count=1))
    started, price = instance.started_at, instance.price_per_hour_micros
    assert price == 1_500_000
    seen_at = started + timedelta(seconds=kept_s + 30)  # a look began after the sighting, before the stop
    clock.advance(billed_s + 0.5)
    instance = stop(instance)
    assert instance.billed_seconds == billed_s
    with transaction.atomic():
        locked = Instance.objects.select_for_update().get(pk=instance.pk)
        given = usage_give_back(
            instance=locked,
            since=started + timedelta(seconds=kept_s + 0.4),
            seen_at=seen_at,
            memo="test",
            customer_note="test",
        )
    assert given is not None and given.seconds == billed_s - kept_s
    assert _ledger_paid(instance) == cost_for(price, kept_s)  # the give-back: to the micro-dollar
    instance = start(Instance.objects.get(pk=instance.pk))
    clock.advance(again_s + 0.5)
    usage_meter()
    instance = stop(Instance.objects.get(pk=instance.pk))
    assert instance.billed_seconds - instance.given_back_seconds == kept_s + again_s
    assert sum(UsageInterval.objects.filter(instance=instance).values_list("seconds", flat=True)) == billed_s + again_s
    assert _ledger_paid(instance) == cost_for(price, kept_s + again_s)
