"""A deactivated provider is not paid (review r53 #2): the weekly run paid the whole earnings balance to the Connect
account on file (perhaps a thief's, set with a stolen key) although an operator had turned the account off, and the
per-minute follow-up sent a pending payout of theirs too. Now no payout is made for them, one made before is held
(pending, earnings reserved, nothing sent, the reason recorded for operators), and both go out after reactivation."""
from datetime import date, timedelta

import pytest

from billing.models import LedgerTransaction, Payout, PayoutStatus
from billing.services import payouts
from billing.services.ledger import earnings_balance
from marketplace.services.account_status import account_deactivate, account_reactivate
from tests.billing.test_payouts import MONDAY, ConnectServer, _provider_with_earnings
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

WEEK = (date(2026, 3, 2), date(2026, 3, 8))  # MONDAY's payout period


@pytest.fixture
def connect(settings):
    server = ConnectServer()
    settings.STRIPE_CONNECT_API_BASE = server.url
    yield server
    server.close()


@pytest.fixture
def superuser():
    return UserFactory(is_staff=True, is_superuser=True)


def test_the_weekly_run_pays_a_deactivated_provider_nothing_and_pays_them_after_reactivation(clock, connect,
                                                                                              superuser):
    provider = _provider_with_earnings(clock)  # $42.50 of earnings, acct_1TestProvider
    account_deactivate(user=provider, by=superuser, reason="fraud")
    assert payouts.payouts_run(today=MONDAY) == []
    assert connect.requests == [] and not Payout.objects.exists()
    assert earnings_balance(user_id=provider.pk) == 42_500_000  # kept, not reserved
    # payout_create alone (any other caller) refuses too.
    assert payouts.payout_create(provider_id=provider.pk, period_start=WEEK[0], period_end=WEEK[1]) is None
    assert not LedgerTransaction.objects.filter(kind="payout").exists()
    account_reactivate(user=provider, by=superuser, reason="cleared")
    [payout] = payouts.payouts_run(today=MONDAY)
    assert (payout.status, payout.amount_micros) == (PayoutStatus.PAID, 42_500_000)
    assert len(connect.requests) == 1


def test_a_payout_made_before_the_deactivation_is_held_not_sent_then_sent_after_reactivation(clock, connect,
                                                                                             superuser):
    provider = _provider_with_earnings(clock)
    payout = payouts.payout_create(provider_id=provider.pk, period_start=WEEK[0], period_end=WEEK[1])
    assert payout is not None and payout.status == PayoutStatus.PENDING
    account_deactivate(user=provider, by=superuser, reason="account taken over")
    later = clock.now + timedelta(hours=1)  # past the follow-up's delay
    # The per-minute follow-up, the weekly run and an operator's "Send again" all leave it pending, unsent.
    assert payouts.payouts_send_pending(now=later) == 0  # not taken up: it takes no place in the batch
    payout.refresh_from_db()
    assert payout.failure_message == payouts.HELD_INACTIVE  # marked for the operators by the follow-up
    payouts.payouts_run(today=MONDAY)
    payouts.payout_send(payout=payout)
    assert connect.requests == [] and connect.lookups == []
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PENDING and payout.attempts == 0
    assert payout.failure_message == payouts.HELD_INACTIVE  # what the admin and the dashboard show
    assert earnings_balance(user_id=provider.pk) == 0  # still reserved for it: not paid twice later
    account_reactivate(user=provider, by=superuser, reason="cleared")
    assert payouts.payouts_send_pending(now=later) == 1
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and payout.failure_message == ""
    assert [r["form"]["amount"] for r in connect.requests] == ["4250"]


def test_a_held_payout_whose_earlier_transfer_was_made_is_recorded_paid(clock, connect, superuser):
    """Held means nothing more is sent; a transfer an earlier try made (its answer lost) went already, and is
    recorded when found, not left pending."""
    provider = _provider_with_earnings(clock)
    connect.mode = "lose"
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING and len(connect.made) == 1
    account_deactivate(user=provider, by=superuser, reason="fraud")
    connect.mode = "ok"
    payouts.payout_send(payout=payout)
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and payout.transfer_id == connect.made[0]["id"]
    assert len(connect.requests) == 1  # the lost one only
