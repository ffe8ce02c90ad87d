"""An operator's reversal of a usage, storage or manual-debit transaction (review r53 admin #2). Before, every
reversal's default note was "an earlier credit to your balance was taken back", also on the statement of a renter a
usage charge was given back to, and only a reversed credit's customer was told, while the admin's form promised
"the notice they get". Now each account holder whose wallet or earnings the reversal moves reads wording for their
side and is told (a billing event and a notification); the platform's accounts are no one's."""
import pytest
from django.test import Client
from django.urls import reverse

from billing.models import AccountKind, BillingEvent, EventKind, LedgerTransaction, TransactionKind
from billing.selectors import statement_for
from billing.services import ledger
from billing.services.ledger import earnings_balance, ledger_post, ledger_reverse, platform_account, user_account
from billing.services.metering import usage_meter
from notifications.models import Notification
from tests.billing.helpers import balance, fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _told(user):
    return list(Notification.objects.filter(user=user).order_by("pk"))


def _admin_reverse(txn, note=""):
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client.post(reverse("admin:billing_ledgertransaction_changelist"), {
        "action": "reverse", "_selected_action": [txn.pk], "apply": "1", "reason": "internal: billed in error",
        "customer_note": note})


@pytest.fixture
def usage(clock):
    renter, provider = UserFactory(), UserFactory()
    fund(renter, "10")
    running(renter, node("1.000000", provider=provider))
    clock.advance(600)
    usage_meter()
    txn = LedgerTransaction.objects.get(kind=TransactionKind.USAGE)
    return renter, provider, txn


def test_a_usage_reversal_reads_as_money_back_to_the_renter_and_earnings_taken_from_the_provider(usage, clock):
    renter, provider, txn = usage
    renter_before, provider_before = _told(renter), _told(provider)
    wallet_before, earned_before = balance(renter), earnings_balance(user_id=provider.pk)

    response = _admin_reverse(txn)

    assert response.status_code == 302
    reversal = LedgerTransaction.objects.get(reverses=txn)
    back = reversal.entries.get(account__user=renter).amount_micros
    taken = -reversal.entries.get(account__user=provider).amount_micros
    assert back > 0 and taken > 0 and sum(reversal.entries.values_list("amount_micros", flat=True)) == 0
    assert balance(renter) == wallet_before + back
    assert earnings_balance(user_id=provider.pk) == earned_before - taken
    assert "taken back" not in reversal.customer_note
    assert reversal.customer_note == ledger.USAGE_GIVEN_BACK_NOTE
    # The renter's statement line says a charge was given back.
    lines = [a for a in statement_for(user=renter, month=clock().date().replace(day=1)).adjustments
             if a["kind"] == TransactionKind.REVERSAL]
    assert [(a["amount_micros"], a["note"]) for a in lines] == [(back, ledger.USAGE_GIVEN_BACK_NOTE)]
    # The renter is told of money back, the provider of earnings taken back, each e-mailed by their preference.
    [to_renter] = _told(renter)[len(renter_before):]
    assert to_renter.kind == "credit_posted" and "given back" in to_renter.body
    assert ledger.USAGE_GIVEN_BACK_NOTE in to_renter.body and to_renter.email_status == "pending"
    [to_provider] = _told(provider)[len(provider_before):]
    assert to_provider.kind == "credit_reversed" and to_provider.email_status == "pending"
    assert "added to your earnings" in to_provider.body and "your earnings from it were taken back" in to_provider.body
    assert "internal" not in to_renter.body + to_provider.body
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT, data__transaction=reversal.pk).count() == 1
    assert BillingEvent.objects.filter(user=provider, kind=EventKind.CREDIT_REVERSED,
                                       data__transaction=reversal.pk).count() == 1

    # Reversed once: a second reversal is refused, and no one is told again.
    again = _admin_reverse(txn)
    assert again.status_code == 400 and b"already reversed" in again.content
    assert LedgerTransaction.objects.filter(reverses=txn).count() == 1
    assert len(_told(renter)) == len(renter_before) + 1 and len(_told(provider)) == len(provider_before) + 1


def test_an_operators_own_wording_goes_to_the_statement_and_to_everyone_told(usage):
    renter, provider, txn = usage
    _admin_reverse(txn, note="We billed time your server was unreachable.")
    reversal = LedgerTransaction.objects.get(reverses=txn)
    assert reversal.customer_note == "We billed time your server was unreachable."
    for user in (renter, provider):
        assert _told(user)[-1].body.endswith("We billed time your server was unreachable.")


def test_a_storage_and_a_manual_debit_reversal_give_money_back_in_those_words():
    renter, provider = UserFactory(), UserFactory()
    wallet = user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET)
    earnings = user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS)
    revenue = platform_account(kind=AccountKind.PLATFORM_REVENUE)
    storage, _ = ledger_post(idempotency_key="t-storage", kind=TransactionKind.STORAGE, memo="disk",
                             lines=[(wallet, -1_000_000), (earnings, 800_000), (revenue, 200_000)])
    debit, _ = ledger_post(idempotency_key="t-debit", kind=TransactionKind.DEBIT, memo="debit",
                           lines=[(wallet, -2_000_000), (platform_account(kind=AccountKind.PROMOTIONS), 2_000_000)])

    storage_back, _ = ledger_reverse(txn=storage, reason="x")
    debit_back, _ = ledger_reverse(txn=debit, reason="x")

    assert storage_back.customer_note == "A correction: a storage charge was given back to your balance."
    assert debit_back.customer_note == ledger.WALLET_GIVEN_BACK_NOTE
    assert [n.kind for n in _told(renter)] == ["credit_posted", "credit_posted"]
    assert [n.kind for n in _told(provider)] == ["credit_reversed"]
    assert "storage charge was given back to them" in _told(provider)[0].body
    assert balance(renter) == 0 and earnings_balance(user_id=provider.pk) == 0


def test_a_service_credit_reversal_tells_the_provider_their_earnings_came_back_too():
    renter, provider = UserFactory(), UserFactory()
    credit, _ = ledger_post(idempotency_key="t-sc", kind=TransactionKind.SERVICE_CREDIT, memo="interruption",
                            lines=[(user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET), 500_000),
                                   (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), -500_000)])
    reversal, _ = ledger_reverse(txn=credit, reason="x")
    assert reversal.customer_note == ledger.REVERSAL_NOTE  # the renter's statement: their credit was taken back
    [to_renter], [to_provider] = _told(renter), _told(provider)
    assert to_renter.kind == "credit_reversed" and "taken back" in to_renter.body
    assert to_provider.kind == "credit_posted" and ledger.EARNINGS_GIVEN_BACK_NOTE in to_provider.body
    assert "taken from your earnings" in to_provider.body


def test_the_reverse_form_says_who_is_told(usage):
    _, _, txn = usage
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    page = client.post(reverse("admin:billing_ledgertransaction_changelist"),
                       {"action": "reverse", "_selected_action": [txn.pk]})
    assert page.status_code == 200
    text = page.content.decode()
    assert "its renter and its provider" in text and "charge for GPU time was given back" in text
