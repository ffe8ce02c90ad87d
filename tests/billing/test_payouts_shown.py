"""What providers read as "Paid out" (the earnings API and page) is what Stripe confirmed: a payout still pending
shows as pending, a failed one (its earnings given back) as neither, in its month or the next."""
from datetime import UTC, date, datetime, timedelta

import pytest

from billing.models import BillingProfile, PayoutStatus
from billing.services import payouts
from marketplace.services import instances as svc
from tests.billing.helpers import fund, node, running
from tests.billing.test_payouts import ConnectServer
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

MONDAY = date(2026, 3, 9)  # the run for the week 2026-03-02 .. 2026-03-08


@pytest.fixture
def connect(settings):
    server = ConnectServer()
    settings.STRIPE_CONNECT_API_BASE = server.url
    yield server
    server.close()


def _provider(account="acct_1TestProvider"):
    provider = UserFactory()
    BillingProfile.objects.create(user=provider, stripe_connect_account_id=account)
    return provider


def _earn(clock, provider, hours, usd_per_hour="10.000000"):
    """`hours` of a 1-GPU rental on a new server of the provider's, billed when it stops (15 % fee)."""
    renter = UserFactory()
    fund(renter, "1000")
    instance = running(renter, node(usd_per_hour, provider=provider))
    clock.advance(hours * 3600)
    svc.instance_stop(instance=instance)


def _to(clock, when):
    clock.advance((when - clock.now).total_seconds())


def test_a_pending_payout_is_shown_as_pending_not_paid_out(clock, connect, client_for):
    """Review: "Paid out" counted a payout whose transfer Stripe had not confirmed (its answer lost)."""
    provider = _provider()
    _earn(clock, provider, hours=5)
    connect.mode = "down"
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING
    api = client_for(provider)
    earnings = api.get("/api/v1/billing/earnings/").json()
    assert earnings["balance"] == "0.000000" and earnings["earned"] == "42.500000"
    assert earnings["paid_out"] == "0.000000" and earnings["payout_pending"] == "42.500000"
    assert earnings["months"] == [{"month": "2026-03", "earned": "42.500000", "paid_out": "0.000000",
                                   "payout_pending": "42.500000"}]
    connect.mode = "ok"
    payouts.payouts_run(today=MONDAY)
    earnings = api.get("/api/v1/billing/earnings/").json()
    assert earnings["paid_out"] == "42.500000" and earnings["payout_pending"] == "0.000000"


def test_a_payout_failed_in_the_next_month_is_paid_out_in_neither(clock, connect, client_for):
    """Review: a payout made in March and refused in April read "Paid out $42.50" in March and "-$42.50" in
    April. It was never paid: its earnings are back in the balance, and neither month counts it."""

    provider = _provider()
    _to(clock, datetime(2026, 3, 25, 12, 0, tzinfo=UTC))
    _earn(clock, provider, hours=5)
    _to(clock, datetime(2026, 3, 30, 3, 0, tzinfo=UTC))
    connect.mode = "down"
    [payout] = payouts.payouts_run(today=date(2026, 3, 30))
    _to(clock, datetime(2026, 4, 1, 9, 0, tzinfo=UTC))
    connect.mode = "refuse"
    payouts.payouts_send_pending(now=clock.now + timedelta(days=1))
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.FAILED
    earnings = client_for(provider).get("/api/v1/billing/earnings/").json()
    assert earnings["balance"] == "42.500000" and earnings["paid_out"] == "0.000000"
    assert earnings["payout_pending"] == "0.000000"
    assert earnings["months"] == [{"month": "2026-03", "earned": "42.500000", "paid_out": "0.000000",
                                   "payout_pending": "0.000000"}]


def test_the_earnings_page_shows_a_pending_payout_as_pending(clock, connect, client):
    provider = _provider()
    _earn(clock, provider, hours=5)
    connect.mode = "down"
    payouts.payouts_run(today=MONDAY)
    client.force_login(provider)
    page = client.get("/earnings/").content.decode()
    assert '<span class="label">Paid out</span><span class="value">$0.00</span>' in page
    assert '<span class="label">Payout pending</span><span class="value">$42.50</span>' in page
    assert "<th scope=\"col\" class=\"num\">Payout pending</th>" in page
