"""A weekly payout holds the earnings of its week (and earlier unpaid ones), as of the end of its period_end (UTC):
earnings credited after it (Monday morning, before the run) wait for the next payout."""
from datetime import UTC, date, datetime

import pytest

from billing.models import AccountKind, BillingProfile, Payout, PayoutStatus, TransactionKind
from billing.services import payouts
from billing.services.ledger import earnings_balance, ledger_post, platform_account, user_account
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


def test_earnings_credited_after_the_period_wait_for_the_next_weekly_payout(clock, connect):
    """Review: the run paid the whole balance at run time, Monday morning's earnings with last week's payout."""

    provider = _provider()
    _earn(clock, provider, hours=5)  # Monday 2026-03-02, 12:00-17:00: $42.50 after the fee
    _to(clock, datetime(2026, 3, 9, 0, 30, tzinfo=UTC))
    _earn(clock, provider, hours=2, usd_per_hour="20.000000")  # Monday 2026-03-09, 00:30-02:30: $34.00
    assert earnings_balance(user_id=provider.pk) == 76_500_000
    [payout] = payouts.payouts_run(today=MONDAY)
    assert (payout.period_start, payout.period_end) == (date(2026, 3, 2), date(2026, 3, 8))
    assert payout.amount_micros == 42_500_000 and payout.status == PayoutStatus.PAID
    assert connect.requests[0]["form"]["amount"] == "4250"
    assert payout.transaction.memo == "Payout of earnings to 2026-03-08"
    assert earnings_balance(user_id=provider.pk) == 34_000_000  # held for the next payout
    # The next week's run pays them.
    [later] = payouts.payouts_run(today=date(2026, 3, 16))
    assert later.amount_micros == 34_000_000 and earnings_balance(user_id=provider.pk) == 0


def test_a_week_below_the_minimum_is_not_paid_with_the_next_weeks_earnings(clock, connect, settings):

    settings.BILLING_PAYOUT_MINIMUM_USD = 25
    provider = _provider()
    _earn(clock, provider, hours=1)  # $8.50 in the week
    _to(clock, datetime(2026, 3, 9, 1, 0, tzinfo=UTC))
    _earn(clock, provider, hours=1, usd_per_hour="40.000000")  # $34.00 on Monday morning, after the period
    assert payouts.payouts_run(today=MONDAY) == [] and not Payout.objects.exists() and not connect.requests
    assert earnings_balance(user_id=provider.pk) == 42_500_000
    [payout] = payouts.payouts_run(today=date(2026, 3, 16))
    assert payout.amount_micros == 42_500_000


def test_a_clawback_after_the_period_caps_the_payout_at_the_balance_and_a_negative_one_pays_nothing(clock, connect,
                                                                                                      settings):
    """Earnings taken back after the period (a correction): the payout is never more than the balance now; a
    balance below zero pays nothing and the run goes on with the others."""
    settings.BILLING_PAYOUT_MINIMUM_USD = 1

    capped, negative, other = _provider(), _provider("acct_2TestProvider"), _provider("acct_3TestProvider")
    for provider in (capped, negative, other):
        _earn(clock, provider, hours=5)  # $42.50 each
    _to(clock, datetime(2026, 3, 9, 1, 0, tzinfo=UTC))
    promotions = platform_account(kind=AccountKind.PROMOTIONS)
    for provider, taken in ((capped, 40_000_000), (negative, 50_000_000)):
        ledger_post(idempotency_key=f"test-clawback:{provider.pk}", kind=TransactionKind.DEBIT,
                    lines=[(user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), -taken),
                           (promotions, taken)], memo="test clawback")
    done = payouts.payouts_run(today=MONDAY)
    assert sorted((p.provider_id, p.amount_micros) for p in done) == [(capped.pk, 2_500_000), (other.pk, 42_500_000)]
    assert earnings_balance(user_id=capped.pk) == 0 and earnings_balance(user_id=negative.pk) == -7_500_000
