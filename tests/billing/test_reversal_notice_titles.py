"""A ledger reversal's notices have titles that say what happened to whose money, with the amount in cents as the
messages read it. Before, a provider whose earnings a reversal gave back read "0.500000 USD was credited to your
balance" (the credit_posted kind's title, the payload's exact decimal), and one whose earnings were taken back "A
credit of 0.800000 USD was reversed"."""
import pytest

from billing.models import AccountKind, TransactionKind
from billing.services.ledger import ledger_post, ledger_reverse, platform_account, user_account
from notifications.models import Kind, Notification
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _told(user) -> Notification:
    return Notification.objects.get(user=user)


def test_a_service_credit_reversal_gives_the_provider_earnings_back_in_those_words():
    renter, provider = UserFactory(), UserFactory()
    credit, _ = ledger_post(idempotency_key="t-sc", kind=TransactionKind.SERVICE_CREDIT, memo="interruption",
                            lines=[(user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET), 500_000),
                                   (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), -500_000)])
    ledger_reverse(txn=credit, reason="x")
    to_provider, to_renter = _told(provider), _told(renter)
    assert to_provider.kind == Kind.CREDIT_POSTED and to_provider.title == "$0.50 given back to your earnings"
    assert to_renter.kind == Kind.CREDIT_REVERSED
    assert to_renter.title == "A credit of $0.50 to your balance was reversed"
    # The data stays exact (API, webhooks): only the words round.
    assert to_provider.payload["amount"] == "0.500000" and to_renter.payload["amount"] == "0.500000"


def test_a_storage_reversal_takes_from_the_providers_earnings_and_gives_back_to_the_renters_balance():
    renter, provider = UserFactory(), UserFactory()
    storage, _ = ledger_post(idempotency_key="t-storage", kind=TransactionKind.STORAGE, memo="disk", lines=[
        (user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET), -1_234_567_890),
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), 1_000_000_000),
        (platform_account(kind=AccountKind.PLATFORM_REVENUE), 234_567_890)])
    ledger_reverse(txn=storage, reason="x")
    to_provider, to_renter = _told(provider), _told(renter)
    assert to_provider.kind == Kind.CREDIT_REVERSED and to_provider.title == "$1,000.00 taken from your earnings"
    assert to_renter.kind == Kind.CREDIT_POSTED and to_renter.title == "$1,234.57 given back to your balance"


def test_less_than_a_cent_given_back_says_so():
    provider = UserFactory()
    credit, _ = ledger_post(idempotency_key="t-tiny", kind=TransactionKind.SERVICE_CREDIT, memo="tiny", lines=[
        (user_account(user_id=UserFactory().pk, kind=AccountKind.CUSTOMER_WALLET), 4_000),
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), -4_000)])
    ledger_reverse(txn=credit, reason="x")
    assert _told(provider).title == "Less than $0.01 given back to your earnings"
