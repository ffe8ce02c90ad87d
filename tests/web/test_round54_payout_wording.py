"""Review r54 (earn #6, wording): "Not paid out yet" on /earnings/ and /payouts/ is the earnings balance, which
leaves out what a pending payout holds: with a payout queued below, the figure read as less than is still owed.
It reads "Available (not in a payout yet)", and /payouts/ shows the pending payouts' total beside it. The
earnings month table's "Paid out" counts the payouts made that month that Stripe confirmed (a payout made on
30 March and confirmed on 1 April is March's there, 1 April on /payouts/): its header says so."""
import pytest
from django.utils import timezone

from billing.models import AccountKind, Payout, PayoutStatus
from billing.services.ledger import ledger_post, platform_account, user_account
from tests.api_contract import world
from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def _earn(provider, amount: int) -> None:
    ledger_post(idempotency_key=f"r54-wording-{provider.pk}", kind="credit", lines=[
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), amount),
        (platform_account(kind=AccountKind.PROMOTIONS), -amount)])


def test_the_payouts_page_names_the_balance_and_shows_pending_payouts_apart():
    provider = UserFactory()
    _earn(provider, 50_000_000)
    world.payout(provider)
    world.payout(provider)  # two pending payouts of $10.00 each, out of the $50.00 earned
    page = logged_in(provider).get("/payouts/").content.decode()
    assert "Not paid out yet" not in page
    assert 'Available (not in a payout yet): <strong id="earnings-balance">$30.00</strong>' in page
    assert '<strong id="payouts-pending">$20.00</strong>' in page


def test_no_pending_payout_no_pending_figure():
    provider = UserFactory()
    paid = world.payout(provider)
    Payout.objects.filter(pk=paid.pk).update(status=PayoutStatus.PAID, transfer_id="tr_r54", paid_at=timezone.now())
    page = logged_in(provider).get("/payouts/").content.decode()
    assert "Available (not in a payout yet)" in page and 'id="payouts-pending"' not in page


def test_the_earnings_page_names_the_balance_and_what_paid_out_counts():
    provider = UserFactory()
    world.payout(provider)
    page = logged_in(provider).get("/earnings/").content.decode()
    assert "Not paid out yet" not in page
    assert '<span class="label">Available (not in a payout yet)</span>' in page
    assert "Paid out <span class=\"small\">(payouts made this month, confirmed by Stripe)</span></th>" in page
    assert '<span class="label">Payout pending</span><span class="value">$10.00</span>' in page
