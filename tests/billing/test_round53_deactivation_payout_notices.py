"""A deactivated provider's payouts are held (billing.services.payouts: none made, one pending not sent) and go out
after reactivation, but the deactivation and reactivation notices said nothing of it: a provider read "your servers
take no new rentals" and waited for a weekly payout that did not come. Now the notices say so, to accounts payouts
matter to (servers, earnings, a payout not sent) only."""
import pytest

from billing.services import payouts
from marketplace.services.account_status import account_deactivate, account_reactivate
from notifications.models import Notification
from tests.billing.helpers import fund
from tests.billing.test_payouts import _provider_with_earnings
from tests.billing.test_round53_payouts_deactivated import WEEK
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

HELD = "Your earnings are not paid out while your account is deactivated"


def _notice(user, kind):
    return Notification.objects.filter(user=user, kind=kind).latest("pk").body


def test_a_provider_is_told_their_payouts_are_held_and_resume(clock):
    boss = UserFactory(is_staff=True, is_superuser=True)
    provider = _provider_with_earnings(clock)
    assert payouts.payout_create(provider_id=provider.pk, period_start=WEEK[0], period_end=WEEK[1]) is not None

    account_deactivate(user=provider, by=boss, reason="account taken over")
    off = _notice(provider, "account_deactivated")
    assert HELD in off and "a payout not sent yet is held" in off and "after it is reactivated" in off

    account_reactivate(user=provider, by=boss, reason="cleared")
    on = _notice(provider, "account_reactivated")
    assert "Your payouts resume: the payout held while your account was off is sent within minutes" in on


def test_a_provider_without_a_payout_waiting_is_told_only_that_weekly_payouts_resume(clock):
    boss = UserFactory(is_staff=True, is_superuser=True)
    provider = _provider_with_earnings(clock)
    account_deactivate(user=provider, by=boss)
    assert HELD in _notice(provider, "account_deactivated")
    account_reactivate(user=provider, by=boss)
    on = _notice(provider, "account_reactivated")
    assert "Your payouts resume: your earnings are paid out with the weekly payouts again." in on
    assert "held" not in on


def test_a_renter_is_told_nothing_of_payouts():
    boss, renter = UserFactory(is_staff=True, is_superuser=True), UserFactory()
    fund(renter, "10")
    account_deactivate(user=renter, by=boss)
    account_reactivate(user=renter, by=boss)
    assert "paid out" not in _notice(renter, "account_deactivated")
    assert "payout" not in _notice(renter, "account_reactivated")
