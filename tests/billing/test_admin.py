"""The operators' panel: everything about money is visible and read-only; credits, reversals and refunds
go through actions that record the operator and a reason. And the demo's starting credit."""
import re

import pytest
from django.test import Client

from billing.models import (
    Account,
    AccountKind,
    BillingEvent,
    BillingProfile,
    Card,
    LedgerTransaction,
    Payout,
    Refund,
    StripeEvent,
    TopUp,
    UsageInterval,
)
from billing.services.ledger import demo_credit_grant, wallet_balance
from billing.services.metering import usage_meter
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

MODELS = [Account, LedgerTransaction, UsageInterval, TopUp, Refund, StripeEvent, Payout, BillingProfile, Card,
          BillingEvent]


@pytest.fixture
def operator():
    user = UserFactory(is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    client.user = user
    return client


def _url(model, view="changelist", *args):
    from django.urls import reverse

    return reverse(f"admin:billing_{model._meta.model_name}_{view}", args=args)


def test_every_billing_page_shows_and_nothing_can_be_added_or_edited(clock, operator):
    renter = UserFactory()
    fund(renter, "10")
    running(renter, node("1.000000"))
    clock.advance(60)
    usage_meter()
    StripeEvent.objects.create(event_id="evt_1", type="customer.created", payload={"id": "evt_1"})
    for model in MODELS:
        assert operator.get(_url(model)).status_code == 200, model
        obj = model.objects.first()
        if obj is not None:
            page = operator.get(_url(model, "change", obj.pk))
            assert page.status_code == 200, model
            if model is not BillingProfile:
                assert b'name="_save"' not in page.content, f"{model.__name__} is editable"
        if model is not BillingProfile:
            assert operator.get(_url(model, "add")).status_code == 403, model
    txn = LedgerTransaction.objects.first()
    assert operator.post(_url(LedgerTransaction, "delete", txn.pk), {"post": "yes"}).status_code == 403


def test_an_operator_credits_a_wallet_with_a_reason_through_an_action(operator):
    renter = UserFactory()
    fund(renter, "1")
    wallet = Account.objects.get(user=renter, kind=AccountKind.CUSTOMER_WALLET)
    form = operator.post(_url(Account), {"action": "credit", "_selected_action": [wallet.pk]})
    assert form.status_code == 200 and b"reason" in form.content
    token = re.search(r'name="form_token" value="([A-Za-z0-9]+)"', form.content.decode()).group(1)
    apply = {"action": "credit", "_selected_action": [wallet.pk], "apply": "1", "amount": "12.50",
             "reason": "outage on node 7", "form_token": token}
    done = operator.post(_url(Account), apply)
    assert done.status_code == 302
    assert wallet_balance(user_id=renter.pk) == 13_500_000
    again = operator.post(_url(Account), apply)  # the form sent twice (found by review: it credited twice)
    assert again.status_code == 400 and b"already credited by this form" in again.content
    assert wallet_balance(user_id=renter.pk) == 13_500_000
    txn = LedgerTransaction.objects.filter(kind="credit").latest("pk")
    assert txn.created_by == operator.user and txn.reason == "outage on node 7"
    refused = operator.post(_url(Account), {"action": "credit", "_selected_action": [wallet.pk], "apply": "1",
                                            "amount": "5", "reason": "", "form_token": "t2"})
    assert refused.status_code == 400 and wallet_balance(user_id=renter.pk) == 13_500_000
    assert b'value="5"' in refused.content  # the form comes back with what was typed


def test_an_operator_reverses_a_transaction_through_an_action(operator):
    renter = UserFactory()
    fund(renter, "3")
    txn = LedgerTransaction.objects.get(kind="credit")
    operator.post(_url(LedgerTransaction), {"action": "reverse", "_selected_action": [txn.pk], "apply": "1",
                                            "reason": "credited by mistake"})
    reversal = LedgerTransaction.objects.get(reverses=txn)
    assert reversal.created_by == operator.user and reversal.reason == "credited by mistake"
    assert wallet_balance(user_id=renter.pk) == 0


def test_an_operator_sets_a_providers_connect_account_in_the_admin(operator):
    profile = BillingProfile.objects.create(user=UserFactory())
    response = operator.post(_url(BillingProfile, "change", profile.pk), {"stripe_connect_account_id": "acct_9"})
    assert response.status_code == 302
    profile.refresh_from_db()
    assert profile.stripe_connect_account_id == "acct_9"


def test_the_demo_credit_is_an_ordinary_ledger_credit_posted_once():
    customer = UserFactory()
    first, created = demo_credit_grant(user=customer)
    again, created_again = demo_credit_grant(user=customer)
    assert created and not created_again and first.pk == again.pk
    assert wallet_balance(user_id=customer.pk) == 100_000_000
    assert first.kind == "credit" and first.idempotency_key == f"demo-credit:{customer.pk}"


def test_an_operator_refunds_a_top_up_through_an_action(localstripe, operator, api):
    from tests.billing.test_payments import _credited_top_up

    top_up = _credited_top_up(localstripe, api, "20.00")
    operator.post(_url(TopUp), {"action": "refund", "_selected_action": [top_up.pk], "apply": "1",
                                "amount": "", "reason": "duplicate payment", "form_token": "t1"})
    refund = Refund.objects.get(top_up=top_up)
    assert refund.status == "succeeded" and refund.amount_micros == 20_000_000
    assert refund.transaction.created_by == operator.user and refund.transaction.reason == "duplicate payment"
    assert wallet_balance(user_id=api.user.pk) == 0


def test_an_operators_refund_form_sent_twice_refunds_once(localstripe, operator, api):
    """A double click or a page sent again refunded twice: $20 back for a $10 refund (found by review). Each top-up's
    refund is keyed by the form's token; a fresh form refunds again."""
    from tests.billing.test_payments import _credited_top_up

    top_up = _credited_top_up(localstripe, api, "50.00")
    form = operator.post(_url(TopUp), {"action": "refund", "_selected_action": [top_up.pk]})
    token = re.search(r'name="form_token" value="([A-Za-z0-9]+)"', form.content.decode()).group(1)
    apply = {"action": "refund", "_selected_action": [top_up.pk], "apply": "1", "amount": "10.00",
             "reason": "goodwill", "customer_note": "", "form_token": token}
    assert operator.post(_url(TopUp), apply).status_code == 302
    again = operator.post(_url(TopUp), apply)
    assert again.status_code == 400 and b"already refunded by this form" in again.content
    assert Refund.objects.filter(top_up=top_up).count() == 1
    assert wallet_balance(user_id=api.user.pk) == 40_000_000
    assert operator.post(_url(TopUp), {**apply, "form_token": "another"}).status_code == 302  # a new form
    assert wallet_balance(user_id=api.user.pk) == 30_000_000
    assert operator.post(_url(TopUp), {**apply, "form_token": ""}).status_code == 400  # no token: refused
    assert Refund.objects.filter(top_up=top_up).count() == 2


def test_the_stripe_event_page_does_not_show_a_payment_intent_client_secret(operator):
    """Events stored before webhook_receive redacted them still hold the secret (found by review)."""
    event = StripeEvent.objects.create(event_id="evt_1", type="payment_intent.succeeded", payload={
        "id": "evt_1", "type": "payment_intent.succeeded",
        "data": {"object": {"id": "pi_3Abc", "client_secret": "pi_3Abc_secret_ZZZtopsecretZZZ", "amount": 100}}})
    page = operator.get(_url(StripeEvent, "change", event.pk)).content.decode()
    assert "ZZZtopsecretZZZ" not in page
    assert "pi_3Abc" in page and "[redacted]" in page


def test_reversing_a_transaction_twice_is_refused_not_reported_as_done(operator):
    """The second reversal posted nothing yet was reported "1 done" (found by review)."""
    from billing.services.ledger import credit_grant, ledger_reverse

    txn, _ = credit_grant(user=UserFactory(), amount_micros=5_000_000, reason="r")
    first, _ = ledger_reverse(txn=txn, reason="first")
    r = operator.post(_url(LedgerTransaction), {"action": "reverse", "_selected_action": [txn.pk], "apply": "1",
                                                "reason": "again", "customer_note": ""})
    assert r.status_code == 400
    assert f"already reversed by #{first.pk}" in r.content.decode()
    assert "done" not in " ".join(str(m) for m in r.context["messages"])
    assert LedgerTransaction.objects.filter(reverses=txn).count() == 1
