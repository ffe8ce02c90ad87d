"""An operator's refund holds its amount from the wallet while Stripe's answer is awaited (billing.services.refunds).

Before, a pending refund only held its amount back from other refunds: the booking and start funds check,
enforcement, auto top-up and the balance API counted it as spendable, and the refund's confirmation then debited
the whole amount, driving the wallet below zero (found by review, reproduced against PostgreSQL: $50 topped up,
$50 refunded with Stripe's answer lost, an hour at $10/h run on it, the confirmation left -$10.00). Now the hold is
posted with the pending refund (wallet → refunds pending), made (→ payment clearing) or given back (→ wallet) once.

Against PostgreSQL and a real localstripe; a lost answer is tests/billing/lossy_proxy.py. The ledger's invariants,
the holds' among them, are checked after each test (tests/billing/invariants.py).
"""
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from billing.models import Account, AccountKind, LedgerTransaction, Refund, RefundStatus, TopUp, TransactionKind
from billing.services import reconcile
from billing.services.ledger import LedgerError, ledger_reverse
from billing.services.metering import usage_close
from billing.services.refunds import (
    REFUND_HOLD_NOTE,
    REFUND_RELEASED_NOTE,
    _refund_reserve,
    refund_confirm,
    refund_not_made,
    stripe_refund_apply,
)
from billing.services.refunds import refund_create as refund_create_service
from core.errors import Conflict, UpstreamRefused
from marketplace.services.funds import InsufficientFunds
from tests.billing.helpers import balance, book, fund, node, running
from tests.billing.lossy_proxy import LossyProxy
from tests.billing.test_payments import _credited_top_up, deliver, stripe_client
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db
LATER = timedelta(minutes=10)  # past BILLING_TOP_UP_RECONCILE_AFTER_S
REFUNDS = "/api/v1/billing/refunds/"


@pytest.fixture
def lossy(localstripe, settings):
    proxy = LossyProxy(localstripe.url)
    settings.STRIPE_API_BASE = proxy.url
    yield proxy
    proxy.close()


def _reserve(top_up, amount_micros: int) -> Refund:
    """What refund_create does before it calls Stripe (as the reviewer ran it): a pending refund, its hold posted."""
    return _refund_reserve(top_up=top_up, amount_micros=amount_micros, reason="customer asked",
                           created_by=UserFactory(is_staff=True), customer_note="", idempotency_key="",
                           request_fingerprint="")


def _keys(refund: Refund) -> list[str]:
    """The ledger keys that moved the refund's money, oldest first."""
    keys = [f"refund-hold:{refund.pk}", f"refund-hold-release:{refund.pk}", f"refund-failed:{refund.pk}"]
    if refund.stripe_refund_id:
        keys.append(f"refund:{refund.stripe_refund_id}")
    return list(LedgerTransaction.objects.filter(idempotency_key__in=keys).order_by("pk")
                .values_list("idempotency_key", flat=True))


def _held() -> int:
    pending = Account.objects.filter(kind=AccountKind.REFUNDS_PENDING)
    return pending.values_list("balance_micros", flat=True).first() or 0


# --- the reviewer's reproduction ----------------------------------------------------------------------------------


def test_money_held_for_a_pending_refund_cannot_pay_for_a_booking(localstripe, api):
    top_up = _credited_top_up(localstripe, api, "50.00")
    refund = _reserve(top_up, 50_000_000)  # Stripe's answer lost: the refund stays pending
    assert refund.status == RefundStatus.PENDING and refund.hold is not None
    assert balance(api.user) == 0 and _held() == 50_000_000
    assert api.get("/api/v1/billing/balance/").json()["balance"] == "0.000000"
    with pytest.raises(InsufficientFunds):
        book(api.user, node("10.000000"))
    confirmed = refund_confirm(refund_id=refund.pk, stripe_refund_id="re_1")
    assert confirmed.status == RefundStatus.SUCCEEDED
    assert balance(api.user) == 0 and _held() == 0  # never below zero
    assert _keys(confirmed) == [f"refund-hold:{refund.pk}", "refund:re_1"]


def test_what_a_pending_refund_leaves_can_be_spent_and_its_confirmation_never_goes_below_zero(localstripe, api):
    top_up = _credited_top_up(localstripe, api, "50.00")
    refund = _reserve(top_up, 30_000_000)
    assert balance(api.user) == 20_000_000
    instance = running(api.user, node("10.000000"))  # $20 covers the first hour
    usage_close(instance=instance, until=instance.started_at + timedelta(hours=1))
    assert balance(api.user) == 10_000_000
    refund_confirm(refund_id=refund.pk, stripe_refund_id="re_1")
    assert balance(api.user) == 10_000_000  # the hold paid the refund; the wallet is not debited again


def test_a_refund_whose_answer_is_lost_holds_its_amount_until_stripe_is_asked(localstripe, lossy, api,
                                                                              refund_operator_api):
    top_up = _credited_top_up(localstripe, api, "50.00")
    lossy.lose.add(("POST", "/v1/refunds"))
    response = refund_operator_api.post(REFUNDS, {"top_up": top_up.pk, "amount": "50.00", "reason": "asked"},
                                        format="json")
    assert response.status_code == 503 and "held from the customer's balance" in response.json()["detail"]
    refund = Refund.objects.get(pk=response.json()["refund"])
    assert refund.status == RefundStatus.PENDING and balance(api.user) == 0
    with pytest.raises(InsufficientFunds):  # the funds check sees the held money as gone
        book(api.user, node("10.000000"))
    # The statement says where the money went: a refund, pending, its amount held.
    statement = api.get(f"/api/v1/billing/statements/{timezone.now():%Y-%m}/").json()
    assert statement["refunds"] == "50.000000" and statement["closing_balance"] == "0.000000"
    [line] = statement["refund_lines"]
    assert line["status"] == "pending" and line["amount"] == "50.000000" and line["refunded_at"] is None
    assert line["debited_at"] is not None
    assert LedgerTransaction.objects.get(idempotency_key=f"refund-hold:{refund.pk}").customer_note == REFUND_HOLD_NOTE

    assert reconcile.refunds_reconcile(now=timezone.now() + LATER) == {"succeeded": 1}  # Stripe made it
    refund.refresh_from_db()
    assert refund.status == RefundStatus.SUCCEEDED and balance(api.user) == 0 and _held() == 0
    assert _keys(refund) == [f"refund-hold:{refund.pk}", f"refund:{refund.stripe_refund_id}"]
    statement = api.get(f"/api/v1/billing/statements/{timezone.now():%Y-%m}/").json()
    assert statement["refunds"] == "50.000000" and statement["adjustment_lines"] == []
    [line] = statement["refund_lines"]
    assert line["status"] == "succeeded" and line["refunded_at"] is not None


# --- each way out of pending moves the hold once -------------------------------------------------------------------


def test_a_refund_made_moves_its_hold_to_payment_clearing_once(localstripe, api, refund_operator_api):
    top_up = _credited_top_up(localstripe, api)  # $40
    response = refund_operator_api.post(REFUNDS, {"top_up": top_up.pk, "amount": "15.00", "reason": "asked"},
                                        format="json")
    assert response.status_code == 201, response.content
    refund = Refund.objects.get(pk=response.json()["id"])
    clearing = Account.objects.get(kind=AccountKind.PAYMENT_CLEARING).balance_micros
    for _ in range(2):  # the create's answer, then Stripe's event for it: once
        refund_confirm(refund_id=refund.pk, stripe_refund_id=refund.stripe_refund_id)
        with transaction.atomic():
            stripe_refund_apply(stripe_refund=stripe_client(localstripe).refunds.retrieve(
                refund.stripe_refund_id).to_dict())
    assert balance(api.user) == 25_000_000 and _held() == 0
    assert Account.objects.get(kind=AccountKind.PAYMENT_CLEARING).balance_micros == clearing
    assert _keys(refund) == [f"refund-hold:{refund.pk}", f"refund:{refund.stripe_refund_id}"]
    made = LedgerTransaction.objects.get(idempotency_key=f"refund:{refund.stripe_refund_id}")
    assert made.kind == TransactionKind.REFUND and not made.entries.filter(
        account__kind=AccountKind.CUSTOMER_WALLET).exists()
    with pytest.raises(LedgerError, match="given back by itself"):  # an operator cannot undo the hold by hand
        ledger_reverse(txn=refund.hold, reason="oops")


def test_a_pending_refund_stripe_fails_gives_its_hold_back_once(localstripe, api):
    top_up = _credited_top_up(localstripe, api)  # $40
    refund = _reserve(top_up, 15_000_000)
    assert balance(api.user) == 25_000_000
    failed = {"id": "re_failed", "object": "refund", "status": "failed", "failure_reason": "expired_or_canceled_card",
              "amount": 1_500, "currency": "usd", "metadata": {"refund_id": str(refund.pk)}}
    for event_id, kind in [("evt_f1", "refund.failed"), ("evt_f2", "charge.refund.updated"),
                           ("evt_f1", "refund.failed")]:
        assert deliver(api, {"id": event_id, "type": kind, "data": {"object": failed}}).json()["status"] \
            == "processed"
    refund.refresh_from_db()
    assert refund.status == RefundStatus.FAILED and refund.stripe_refund_id == "re_failed"
    assert "back in the balance" in refund.failure_message
    assert balance(api.user) == 40_000_000 and _held() == 0
    assert _keys(refund) == [f"refund-hold:{refund.pk}", f"refund-hold-release:{refund.pk}"]
    release = LedgerTransaction.objects.get(idempotency_key=f"refund-hold-release:{refund.pk}")
    assert release.reverses_id == refund.hold_id and release.customer_note == REFUND_RELEASED_NOTE
    # The create's answer, late, for the very refund Stripe failed: failed stays failed, nothing moves.
    refund_confirm(refund_id=refund.pk, stripe_refund_id="re_failed")
    assert balance(api.user) == 40_000_000 and len(_keys(refund)) == 2
    # The statement: the refund, failed, and its hold given back (an adjustment), the month's net nothing.
    statement = api.get(f"/api/v1/billing/statements/{timezone.now():%Y-%m}/").json()
    assert [(line["status"], line["amount"]) for line in statement["refund_lines"]] == [("failed", "15.000000")]
    assert [(line["amount"], line["note"]) for line in statement["adjustment_lines"]] == [
        ("15.000000", REFUND_RELEASED_NOTE)]
    assert statement["closing_balance"] == "40.000000"


def test_a_refund_stripe_never_made_gives_its_hold_back_once_at_the_lookup(localstripe, api, refund_operator_api,
                                                                          settings):
    top_up = _credited_top_up(localstripe, api)  # $40
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # the request never arrives
    response = refund_operator_api.post(REFUNDS, {"top_up": top_up.pk, "amount": "15.00", "reason": "asked"},
                                        format="json")
    assert response.status_code == 503
    refund = Refund.objects.get(pk=response.json()["refund"])
    assert balance(api.user) == 25_000_000 and _held() == 15_000_000
    settings.STRIPE_API_BASE = localstripe.url
    assert reconcile.refund_reconcile(refund_id=refund.pk) == "failed"
    assert reconcile.refund_reconcile(refund_id=refund.pk) == "settled"  # again: nothing
    refund.refresh_from_db()
    assert refund.status == RefundStatus.FAILED and "made no refund" in refund.failure_message
    assert balance(api.user) == 40_000_000 and _held() == 0
    assert _keys(refund) == [f"refund-hold:{refund.pk}", f"refund-hold-release:{refund.pk}"]


def test_a_refund_stripe_refuses_gives_its_hold_back_once(localstripe, api):
    """Stripe's definite error (a 4xx: it made no refund): here it does not know the top-up's payment."""
    top_up = _credited_top_up(localstripe, api)  # $40
    TopUp.objects.filter(pk=top_up.pk).update(payment_intent_id="pi_unknown_here")
    top_up.refresh_from_db()
    with pytest.raises(UpstreamRefused, match="refused refunding the card"):
        refund_create_service(top_up=top_up, amount_micros=15_000_000, reason="asked",
                              created_by=UserFactory(is_staff=True))
    refund = Refund.objects.get()
    assert refund.status == RefundStatus.FAILED and "back in the balance" in refund.failure_message
    assert balance(api.user) == 40_000_000 and _held() == 0
    assert _keys(refund) == [f"refund-hold:{refund.pk}", f"refund-hold-release:{refund.pk}"]


def test_a_refund_failed_here_that_stripe_made_after_all_is_debited_from_the_wallet_once(localstripe, api):
    """Its hold was given back when it failed: the late confirmation debits the wallet, as before holds."""
    top_up = _credited_top_up(localstripe, api)  # $40
    refund = _reserve(top_up, 15_000_000)
    reconcile_not_found = "The payment provider made no refund for it."
    assert refund_not_made(refund_id=refund.pk, failure_message=reconcile_not_found)
    assert not refund_not_made(refund_id=refund.pk, failure_message=reconcile_not_found)  # once
    assert balance(api.user) == 40_000_000
    with transaction.atomic():  # Stripe's event: it made it after all
        stripe_refund_apply(stripe_refund={"id": "re_late", "status": "succeeded", "amount": 1_500,
                                           "currency": "usd", "metadata": {"refund_id": str(refund.pk)}})
    refund.refresh_from_db()
    assert refund.status == RefundStatus.SUCCEEDED and balance(api.user) == 25_000_000 and _held() == 0
    assert _keys(refund) == [f"refund-hold:{refund.pk}", f"refund-hold-release:{refund.pk}", "refund:re_late"]


def test_a_refund_over_the_balance_says_what_is_held_for_other_refunds_not_that_it_was_spent(localstripe, api):
    """The 409 said "The customer's balance is $X: the rest was spent" when the rest was held for another pending
    refund (found by review): it names what is held, and the most that can be refunded."""
    first, second = _credited_top_up(localstripe, api), _credited_top_up(localstripe, api)  # $40 each
    _reserve(first, 30_000_000)  # pending: $30 held
    instance = running(api.user, node("10.000000"))
    usage_close(instance=instance, until=instance.started_at + timedelta(hours=2))  # $20 spent
    assert balance(api.user) == 30_000_000
    with pytest.raises(Conflict) as refused:
        _reserve(second, 40_000_000)
    assert refused.value.message == (
        "The customer's balance is $30.00; $30.00 more is held for their other refunds, still pending. The rest of "
        "what they paid in was spent or debited. Refund at most $30.00.")
    assert balance(api.user) == 30_000_000 and _held() == 30_000_000  # nothing written


# --- refunds without a hold ------------------------------------------------------------------------------------------


def test_a_refund_pending_from_before_holds_still_settles_from_the_wallet(localstripe, api):
    first, second = _credited_top_up(localstripe, api), _credited_top_up(localstripe, api)  # $40 each
    instance = running(api.user, node("10.000000"))
    usage_close(instance=instance, until=instance.started_at + timedelta(hours=5))  # $50 spent: $30 left
    old = Refund.objects.create(top_up=first, amount_micros=15_000_000, reason="asked before migration 0017",
                                created_by=UserFactory(is_staff=True))  # as migration 0017 left it: pending, no hold
    assert balance(api.user) == 30_000_000
    # still held back from other refunds
    with pytest.raises(Conflict, match=r"balance is \$30\.00, \$15\.00 of it kept back .* at most \$15\.00\."):
        _reserve(second, 15_010_000)
    new = _reserve(second, 15_000_000)
    assert balance(api.user) == 15_000_000 and _held() == 15_000_000
    refund_confirm(refund_id=old.pk, stripe_refund_id="re_old")
    old.refresh_from_db()
    assert old.status == RefundStatus.SUCCEEDED and old.hold is None
    assert balance(api.user) == 0 and _held() == 15_000_000  # the old one debited the wallet; the new one held
    new = refund_confirm(refund_id=new.pk, stripe_refund_id="re_new")
    assert balance(api.user) == 0 and _held() == 0
    assert _keys(old) == ["refund:re_old"] and _keys(new) == [f"refund-hold:{new.pk}", "refund:re_new"]


def test_a_pending_refund_from_before_holds_that_fails_moves_no_money(localstripe, api):
    top_up = _credited_top_up(localstripe, api)  # $40
    old = Refund.objects.create(top_up=top_up, amount_micros=15_000_000, reason="asked before migration 0017",
                                created_by=UserFactory(is_staff=True))
    assert reconcile.refund_reconcile(refund_id=old.pk) == "failed"
    old.refresh_from_db()
    assert old.status == RefundStatus.FAILED and "Nothing was debited" in old.failure_message
    assert balance(api.user) == 40_000_000 and _keys(old) == []


def test_a_refund_made_at_stripe_has_no_hold_and_is_debited_as_before(localstripe, api):
    top_up = _credited_top_up(localstripe, api)  # $40
    fund(api.user, "10")
    with transaction.atomic():
        stripe_refund_apply(stripe_refund={"id": "re_dash", "status": "succeeded", "amount": 4_000,
                                           "currency": "usd", "payment_intent": top_up.payment_intent_id,
                                           "metadata": {}})
    refund = Refund.objects.get(stripe_refund_id="re_dash")
    assert refund.origin == "stripe" and refund.hold is None and refund.status == RefundStatus.SUCCEEDED
    assert balance(api.user) == 10_000_000 and _held() == 0


def test_the_statement_page_says_a_refund_is_being_made_then_that_it_was_not(localstripe, api, client):
    """The month's page lists a held refund as being made, and one Stripe did not make as not made (its hold's
    release is the adjustment line beside it): before, both read as a plain refund of the top-up."""
    top_up = _credited_top_up(localstripe, api)
    refund = _reserve(top_up, 15_000_000)
    client.force_login(api.user)
    month = timezone.now().strftime("%Y-%m")

    def row() -> str:
        page = client.get(f"/account/statements/{month}/").content.decode()
        return next(line for line in page.splitlines() if f"Refund of top-up #{top_up.pk}" in line)

    assert "(held for it: being made to your card)" in row() and "−$15.00" in row()
    assert refund_not_made(refund_id=refund.pk, failure_message="Stripe made no refund.")
    assert "(not made: the amount went back to your balance)" in row() and "being made" not in row()
    assert REFUND_RELEASED_NOTE in client.get(f"/account/statements/{month}/").content.decode()
