"""Separation of duties in the operators' money actions: no operator, superuser or not, credits, reverses or refunds
on their own account (review r46b #1: a staff account with billing.add_ledgertransaction credited its own wallet
$100,000, and could then refund it to its card). Each refusal is per row: a bulk action does the others."""
import pytest
from django.utils import timezone

from billing.models import AccountKind, LedgerTransaction, Refund, TopUp, TopUpStatus
from billing.services.ledger import credit_grant, user_account, wallet_balance
from billing.services.refunds import OWN_ACCOUNT_REFUSED, refund_create
from core.errors import Conflict
from marketplace.models import User
from tests.factories import UserFactory
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act, staff

pytestmark = pytest.mark.django_db

MONEY_PERMS = ("billing.view_account", "billing.view_ledgertransaction", "billing.add_ledgertransaction",
               "billing.view_topup", "billing.add_refund")


def credit_form(token: str) -> dict:
    return {"apply": "1", "amount": "100000", "reason": "because", "customer_note": "", "form_token": token}


@pytest.mark.parametrize("superuser", [False, True])
def test_an_operator_cannot_credit_their_own_wallet(superuser):
    me = staff(*MONEY_PERMS) if not superuser else UserFactory(is_staff=True, is_superuser=True)
    wallet = user_account(user_id=me.pk, kind=AccountKind.CUSTOMER_WALLET)
    r = act(logged_in(me), "billing/account", "credit", wallet.pk, **credit_form("tok123"))
    assert wallet_balance(user_id=me.pk) == 0, "an operator credited their own wallet $100,000"
    assert r.status_code == 400 and OWN_ACCOUNT_REFUSED.encode() in r.content


def test_a_bulk_credit_that_includes_the_operators_own_wallet_credits_the_others():
    me = staff(*MONEY_PERMS)
    customer = UserFactory()
    mine = user_account(user_id=me.pk, kind=AccountKind.CUSTOMER_WALLET)
    theirs = user_account(user_id=customer.pk, kind=AccountKind.CUSTOMER_WALLET)
    r = act(logged_in(me), "billing/account", "credit", mine.pk, theirs.pk, **credit_form("tok456"))
    assert wallet_balance(user_id=customer.pk) == 100_000_000_000
    assert wallet_balance(user_id=me.pk) == 0
    # The form comes back with the refused row alone still selected, and says why.
    assert r.status_code == 400 and OWN_ACCOUNT_REFUSED.encode() in r.content
    assert r.context["selected"] == [str(mine.pk)]


@pytest.mark.parametrize("superuser", [False, True])
def test_an_operator_cannot_reverse_a_transaction_on_their_own_account(superuser):
    me = staff(*MONEY_PERMS) if not superuser else UserFactory(is_staff=True, is_superuser=True)
    debit, _ = credit_grant(user=me, amount_micros=5_000_000, reason="r")  # any transaction touching their wallet
    customer = UserFactory()
    other, _ = credit_grant(user=customer, amount_micros=5_000_000, reason="r")
    r = act(logged_in(me), "billing/ledgertransaction", "reverse", debit.pk, other.pk, apply="1", reason="x",
            customer_note="")
    assert not LedgerTransaction.objects.filter(reverses=debit).exists(), "an operator reversed their own transaction"
    assert LedgerTransaction.objects.filter(reverses=other).exists()  # the other row went through
    assert r.status_code == 400 and OWN_ACCOUNT_REFUSED.encode() in r.content


@pytest.mark.parametrize("superuser", [False, True])
def test_an_operator_cannot_refund_their_own_top_up(superuser):
    me = staff(*MONEY_PERMS) if not superuser else UserFactory(is_staff=True, is_superuser=True)
    paid_in, _ = credit_grant(user=me, amount_micros=10_000_000, reason="stands for the top-up's credit")
    top_up = TopUp.objects.create(user=me, amount_micros=10_000_000, status=TopUpStatus.SUCCEEDED,
                                  payment_intent_id="pi_own_refund_test", transaction=paid_in,
                                  credited_at=timezone.now())
    r = act(logged_in(me), "billing/topup", "refund", top_up.pk, apply="1", amount="", reason="because",
            customer_note="", form_token="tok789")
    assert not Refund.objects.exists(), "an operator refunded their own top-up to their card"
    assert r.status_code == 400 and OWN_ACCOUNT_REFUSED.encode() in r.content
    # The service refuses it too (the refunds API calls it).
    with pytest.raises(Conflict):
        refund_create(top_up=top_up, amount_micros=1_000_000, reason="because", created_by=User.objects.get(pk=me.pk))
    assert not Refund.objects.exists()
