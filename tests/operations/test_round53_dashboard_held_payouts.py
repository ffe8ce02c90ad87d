"""The operators' dashboard's "Money waiting on Stripe" (billing.selectors.waiting_on_stripe) listed a deactivated
provider's pending payout, which the platform holds until the account is reactivated (payouts.HELD_INACTIVE) and
Stripe was never asked about: operators read it as a transfer Stripe would not answer for. Now only payouts of
active providers are counted there; a held one comes back to it once its provider is reactivated and it is due."""
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from billing.models import AccountKind, Payout
from billing.selectors import waiting_on_stripe
from billing.services.ledger import ledger_post, platform_account, user_account
from billing.services.payouts import HELD_INACTIVE
from marketplace.services.account_status import account_deactivate, account_reactivate
from tests.factories import UserFactory
from tests.web.test_admin_dashboard_permissions import dashboard

pytestmark = pytest.mark.django_db


def _pending_payout(provider, amount=42_500_000) -> Payout:
    since = timezone.now() - timedelta(hours=2)  # past the follow-up's delay
    txn, _ = ledger_post(idempotency_key=f"payout:{provider.pk}:test", kind="payout", lines=[
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), -amount),
        (platform_account(kind=AccountKind.PAYOUT_CLEARING), amount)])
    return Payout.objects.create(provider=provider, period_start=since.date(), period_end=since.date(), attempts=1,
                                 amount_micros=amount, destination="acct_1Test", transaction=txn, created_at=since)


def test_a_deactivated_providers_held_payout_is_not_money_waiting_on_stripe():
    boss = UserFactory(is_staff=True, is_superuser=True)
    held_for, waiting_for = UserFactory(), UserFactory()
    held, waiting = _pending_payout(held_for, 10_000_000), _pending_payout(waiting_for)
    account_deactivate(user=held_for, by=boss, reason="stolen key")
    Payout.objects.filter(pk=held.pk).update(failure_message=HELD_INACTIVE)  # as the follow-up marks it

    figures = waiting_on_stripe(kind="payouts")
    assert figures["count"] == 1 and figures["amount_micros"] == 42_500_000
    assert [p.pk for p in figures["oldest"]] == [waiting.pk]
    page = dashboard(boss)
    assert "Money waiting on Stripe" in page and "1 payout pending" in page
    assert f"/admin/billing/payout/{waiting.pk}/change/" in page
    assert f"/admin/billing/payout/{held.pk}/change/" not in page and "Held, not sent" not in page

    account_reactivate(user=held_for, by=boss, reason="key rotated")
    assert waiting_on_stripe(kind="payouts")["count"] == 2


def test_the_dashboards_payouts_link_lists_what_it_counts_and_held_ones_are_a_filter_of_their_own():
    boss = UserFactory(is_staff=True, is_superuser=True)
    held_for, waiting_for = UserFactory(), UserFactory()
    held, waiting = _pending_payout(held_for, 10_000_000), _pending_payout(waiting_for)
    account_deactivate(user=held_for, by=boss, reason="stolen key")
    assert "/admin/billing/payout/?status__exact=pending&amp;held=no" in dashboard(boss)
    operator = Client()
    operator.force_login(boss)

    def listed(query):
        page = operator.get(f"/admin/billing/payout/?{query}").content.decode()
        return {p.pk for p in (held, waiting) if f"/admin/billing/payout/{p.pk}/change/" in page}

    assert listed("status__exact=pending&held=no") == {waiting.pk}
    assert listed("status__exact=pending&held=yes") == {held.pk}
    assert listed("status__exact=pending") == {held.pk, waiting.pk}
