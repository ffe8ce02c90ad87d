"""Every reader of what an instance's GPU time cost agrees with the ledger once a charge was given back.

A VM found lost just as its renter stopped it (tests/billing/test_vm_lost_stop_race.py) has what it was billed
after its last sighting given back: a REVERSAL of its usage charge (metering.usage_give_back), credited to the
renter's wallet, on the statement as an adjustment. The instance's own intervals and totals stay what was charged
(the meter's cumulative arithmetic reads them). Before, the renter's usage API (GET /api/v1/billing/usage/), the
usage page and the instance's page read those and said the renter paid what was charged; an operator's reversal
of a usage charge read the same. Now they read what the ledger says, net of reversals; the provider's earnings
(API, page, per server) already came from the ledger and are checked alongside. Real services on PostgreSQL."""
from decimal import Decimal

import pytest

from billing.models import AccountKind, Entry, UsageInterval
from billing.services.ledger import earnings_balance, ledger_reverse
from billing.services.metering import fee_for, usage_meter
from marketplace.money import micros_to_usd
from tests.billing.helpers import fund, node, running, stop
from tests.billing.test_vm_lost_stop_race import (  # noqa: F401 (rented: a fixture)
    BACK,
    BPS,
    KEPT,
    _after_the_answer,
    _check,
    _given_back,
    _renter_does,
    rented,
)
from tests.conftest import _client_for
from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def _ledger_paid(instance) -> int:
    """What the renter's wallet paid for the instance's GPU time, from the ledger: its usage charges and their
    reversals."""
    charges = list(UsageInterval.objects.filter(instance=instance).exclude(transaction=None)
                   .values_list("transaction_id", flat=True))
    entries = Entry.objects.filter(account__kind=AccountKind.CUSTOMER_WALLET).filter(
        transaction_id__in=charges) | Entry.objects.filter(account__kind=AccountKind.CUSTOMER_WALLET,
                                                           transaction__reverses_id__in=charges)
    return -sum(entries.values_list("amount_micros", flat=True))


def _ledger_earned(instance) -> tuple[int, int]:
    """(provider's earnings, platform's fee) from the instance's usage charges and their reversals."""
    charges = list(UsageInterval.objects.filter(instance=instance).exclude(transaction=None)
                   .values_list("transaction_id", flat=True))
    rows = Entry.objects.filter(transaction_id__in=charges) | Entry.objects.filter(
        transaction__reverses_id__in=charges)
    by_kind: dict[str, int] = {}
    for kind, amount in rows.values_list("account__kind", "amount_micros"):
        by_kind[kind] = by_kind.get(kind, 0) + amount
    return by_kind.get(AccountKind.PROVIDER_EARNINGS, 0), by_kind.get(AccountKind.PLATFORM_REVENUE, 0)


def _usd(micros: int) -> Decimal:
    return micros_to_usd(micros)


@pytest.fixture
def given_back(rented, clock, monkeypatch):  # noqa: F811 (the fixture imported above)
    """The renter stopped the instance between the check's answer (its VM gone) and its interruption: what it was
    billed after the VM's last sighting is given back."""
    renter, host, lost, kept, since = rented
    _after_the_answer(monkeypatch, _renter_does("stop", lost, clock))
    _check(host, lost, kept, clock, "gone")
    monkeypatch.undo()
    assert _given_back(lost) and _ledger_paid(lost) == KEPT
    usage_meter()  # the instance beside it: charged on, nothing given back
    return renter, host, lost, kept


def _api_usage(user, instance) -> list[dict]:
    answer = _client_for(user).get("/api/v1/billing/usage/", {"instance": instance.pk, "page_size": 100})
    assert answer.status_code == 200, answer.content
    return answer.json()["results"]


def test_the_usage_api_says_what_the_ledger_says_was_paid(given_back):
    renter, host, lost, kept = given_back
    rows = _api_usage(renter, lost)
    assert sum(Decimal(r["amount"]) for r in rows) == _usd(KEPT) == _usd(_ledger_paid(lost))  # was KEPT + BACK
    charged = sum(UsageInterval.objects.filter(instance=lost).values_list("amount_micros", flat=True))
    assert charged - KEPT == BACK  # what the intervals say was charged, less what was given back
    earned, fee = _ledger_earned(lost)
    assert sum(Decimal(r["platform_fee"]) for r in rows) == _usd(fee) == _usd(fee_for(KEPT, BPS))
    assert sum(Decimal(r["provider_earnings"]) for r in rows) == _usd(earned) == _usd(KEPT - fee_for(KEPT, BPS))
    for r in rows:  # each row: its charge, less what was given back of it (one charge across `since`, in part)
        interval = UsageInterval.objects.get(pk=r["id"])
        assert Decimal(r["amount"]) <= _usd(interval.amount_micros)
    assert set(rows[0]) == {"id", "instance", "started_at", "ended_at", "seconds", "price_per_hour",
                            "platform_fee_percent", "amount", "platform_fee", "provider_earnings", "created_at"}
    # The instance beside it, nothing given back: as charged.
    neighbour = _api_usage(kept.renter, kept)
    assert neighbour and all(Decimal(r["amount"]) == _usd(UsageInterval.objects.get(pk=r["id"]).amount_micros)
                             for r in neighbour)
    assert sum(Decimal(r["amount"]) for r in neighbour) == _usd(_ledger_paid(kept))


def test_the_usage_page_says_what_the_ledger_says_was_paid(given_back):
    renter, host, lost, kept = given_back
    page = logged_in(renter).get("/account/usage/", {"instance": lost.pk})
    assert page.status_code == 200
    totals = page.context["totals"]
    assert totals["amount"] == KEPT == _ledger_paid(lost) and totals["given_back"] == BACK
    html = page.content.decode()
    assert 'class="sub given-back"' in html and "given back (an adjustment on your statement)" in html
    rows = list(page.context["page"].object_list)
    assert sum(r.net_amount_micros for r in rows) == KEPT
    # All instances: the same rule.
    everything = logged_in(renter).get("/account/usage/").context["totals"]
    assert everything["amount"] == _ledger_paid(lost)


def test_the_instance_page_says_what_the_ledger_says_it_cost(given_back):
    renter, host, lost, kept = given_back
    page = logged_in(renter).get(f"/instances/{lost.pk}/")
    assert page.status_code == 200
    assert page.context["cost"]["amount_micros"] == KEPT == _ledger_paid(lost)
    assert page.context["cost"]["given_back_micros"] == BACK


def test_the_providers_earnings_agree_with_the_ledger(given_back):
    renter, host, lost, kept = given_back
    provider = host.provider
    earned = earnings_balance(user_id=provider.pk)
    lost_earned, lost_fee = _ledger_earned(lost)
    kept_earned, kept_fee = _ledger_earned(kept)
    assert earned == lost_earned + kept_earned and lost_earned == KEPT - fee_for(KEPT, BPS)
    answer = _client_for(provider).get("/api/v1/billing/earnings/")
    assert answer.status_code == 200, answer.content
    data = answer.json()
    assert Decimal(data["earned"]) == _usd(earned)
    assert Decimal(data["platform_fees"]) == _usd(lost_fee + kept_fee)
    assert Decimal(data["renters_paid"]) == _usd(_ledger_paid(lost) + _ledger_paid(kept))
    page = logged_in(provider).get("/earnings/")
    assert page.context["earnings"].earned_micros == earned
    [row] = [r for r in page.context["nodes"] if r["node"].pk == host.pk]
    assert row["earned_micros"] == earned


def test_an_operators_reversal_of_a_usage_charge_reads_as_given_back(clock):
    """The same rule for any reversal of a usage charge: an operator's, in full."""
    renter = UserFactory()
    fund(renter, "50")
    instance = running(renter, node(price="1.500000", gpu_count=2))
    clock.advance(120)
    usage_meter()
    clock.advance(30)
    instance = stop(instance)
    first, second = UsageInterval.objects.filter(instance=instance).order_by("started_at")
    assert first.transaction is not None and second.transaction is not None
    ledger_reverse(txn=first.transaction, reason="test: charged in error")
    rows = {r["id"]: r for r in _api_usage(renter, instance)}
    assert first.amount_micros > 0 and Decimal(rows[first.pk]["amount"]) == 0  # reversed in full
    assert Decimal(rows[first.pk]["platform_fee"]) == 0 == Decimal(rows[first.pk]["provider_earnings"])
    assert Decimal(rows[second.pk]["amount"]) == _usd(second.amount_micros)
    assert _ledger_paid(instance) == second.amount_micros
    assert sum(Decimal(r["amount"]) for r in rows.values()) == _usd(_ledger_paid(instance))
    page = logged_in(renter).get("/account/usage/", {"instance": instance.pk})
    assert page.context["totals"]["amount"] == second.amount_micros
    assert logged_in(renter).get(f"/instances/{instance.pk}/").context["cost"]["amount_micros"] == \
        second.amount_micros
