"""Operators' money actions (issue 16, item 6): the operator's internal reason stays with the operators; the
customer reads only the wording written for them, on statements, billing events and notifications; a credit and
its reversal both tell the customer; a refused action (an over-refund) comes back with what the operator typed."""
import pytest
from django.test import Client
from django.urls import reverse

from billing.models import Account, AccountKind, BillingEvent, LedgerTransaction, Refund, TopUp
from billing.services.ledger import wallet_balance
from notifications.models import Notification
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

INTERNAL = "internal: ticket 4711, customer threatened a chargeback"
FOR_CUSTOMER = "Sorry for Monday's outage: here is a credit."


@pytest.fixture
def operator():
    user = UserFactory(is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    client.user = user
    return client


def _changelist(model):
    return reverse(f"admin:billing_{model._meta.model_name}_changelist")


def _seen_by(customer) -> str:
    """Everything the customer can read about their money: API statements and events, pages, notifications."""
    client = Client()
    client.force_login(customer)
    from django.utils import timezone

    month = timezone.now().strftime("%Y-%m")
    api = Client()
    api.force_login(customer)
    parts = [
        api.get(f"/api/v1/billing/statements/{month}/").content.decode(),
        api.get("/api/v1/billing/events/").content.decode(),
        api.get("/api/v1/notifications/").content.decode(),
        client.get(f"/account/statements/{month}/").content.decode(),
        client.get("/account/notifications/").content.decode(),
    ]
    return "\n".join(parts)


def test_a_credit_and_its_reversal_tell_the_customer_only_the_customer_wording(operator):
    customer = UserFactory()
    wallet = Account.objects.create(user=customer, kind=AccountKind.CUSTOMER_WALLET)
    form = operator.post(_changelist(Account), {"action": "credit", "_selected_action": [wallet.pk]})
    assert b"Internal reason (operators only)" in form.content and b"What the customer reads" in form.content
    done = operator.post(_changelist(Account), {
        "action": "credit", "_selected_action": [wallet.pk], "apply": "1", "amount": "15.00",
        "reason": INTERNAL, "customer_note": FOR_CUSTOMER, "form_token": "t1"})
    assert done.status_code == 302 and wallet_balance(user_id=customer.pk) == 15_000_000
    txn = LedgerTransaction.objects.get(kind="credit")
    assert txn.reason == INTERNAL and txn.customer_note == FOR_CUSTOMER and txn.created_by == operator.user

    seen = _seen_by(customer)
    assert FOR_CUSTOMER in seen.replace("&#x27;", "'") and "ticket 4711" not in seen
    assert Notification.objects.get(user=customer, kind="credit_posted").body.endswith(FOR_CUSTOMER)

    operator.post(_changelist(LedgerTransaction), {
        "action": "reverse", "_selected_action": [txn.pk], "apply": "1",
        "reason": "internal: credited the wrong account", "customer_note": "We corrected a credit made in error."})
    assert wallet_balance(user_id=customer.pk) == 0
    reversal = LedgerTransaction.objects.get(reverses=txn)
    assert reversal.reason == "internal: credited the wrong account"
    told = Notification.objects.get(user=customer, kind="credit_reversed")
    assert "We corrected a credit made in error." in told.body and "15.00" in told.title
    assert BillingEvent.objects.filter(user=customer, kind="credit_reversed").count() == 1
    seen = _seen_by(customer)
    assert "wrong account" not in seen and "ticket 4711" not in seen


def test_a_credit_without_customer_wording_shows_a_neutral_default(operator):
    customer = UserFactory()
    wallet = Account.objects.create(user=customer, kind=AccountKind.CUSTOMER_WALLET)
    operator.post(_changelist(Account), {"action": "credit", "_selected_action": [wallet.pk], "apply": "1",
                                         "amount": "2.00", "reason": INTERNAL, "customer_note": "",
                                         "form_token": "t1"})
    seen = _seen_by(customer)
    assert "A credit from the platform." in seen and "ticket 4711" not in seen


def test_an_over_refund_is_refused_and_the_form_keeps_what_was_typed(localstripe, operator, api):
    from tests.billing.test_payments import _credited_top_up

    top_up = _credited_top_up(localstripe, api, "20.00")
    refused = operator.post(_changelist(TopUp), {
        "action": "refund", "_selected_action": [top_up.pk], "apply": "1", "amount": "25.00",
        "reason": "internal: customer asked twice", "customer_note": "Your refund, as asked.", "form_token": "t1"})
    assert refused.status_code == 400
    page = refused.content.decode()
    assert "At most $20.00 of this top-up can still be refunded" in page
    assert 'value="25.00"' in page and "internal: customer asked twice" in page and "Your refund, as asked." in page
    assert f'name="_selected_action" value="{top_up.pk}"' in page and 'name="form_token" value="t1"' in page
    assert not Refund.objects.exists() and wallet_balance(user_id=api.user.pk) == 20_000_000

    done = operator.post(_changelist(TopUp), {
        "action": "refund", "_selected_action": [top_up.pk], "apply": "1", "amount": "20.00",
        "reason": "internal: customer asked twice", "customer_note": "Your refund, as asked.", "form_token": "t1"})
    assert done.status_code == 302
    refund = Refund.objects.get()
    assert refund.reason == "internal: customer asked twice" and refund.customer_note == "Your refund, as asked."
    seen = _seen_by(api.user)
    assert "Your refund, as asked." in seen and "asked twice" not in seen


def test_the_refund_api_takes_the_customer_wording_too(localstripe, api):
    from django.contrib.auth.models import Permission
    from rest_framework.test import APIClient

    from tests.billing.test_payments import _credited_top_up

    operator = UserFactory(is_staff=True)
    operator.user_permissions.add(Permission.objects.get(content_type__app_label="billing", codename="add_refund"))

    from tests.factories import api_key_for

    ops = APIClient()
    ops.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(operator)}")
    top_up = _credited_top_up(localstripe, api, "10.00")
    r = ops.post("/api/v1/billing/refunds/", {"top_up": top_up.pk, "amount": "4.00", "reason": "internal: goodwill",
                                              "customer_note": "Part of your top-up, back on your card."},
                 format="json")
    assert r.status_code == 201 and r.json()["customer_note"] == "Part of your top-up, back on your card."
    seen = _seen_by(api.user)
    assert "Part of your top-up, back on your card." in seen and "goodwill" not in seen
