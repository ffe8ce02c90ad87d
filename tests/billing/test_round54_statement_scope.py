"""Review r54 (earn #3): the statements are the renter wallet's (opening and closing balance, top-ups with their
card labels, refunds), but they declared RENTER_OR_PROVIDER: a `provider`-only key, refused on /billing/balance/
and /billing/top-ups/, read all of it there. They are `renter` (or `read`) now. The billing events mixed the
same wallet events in: a provider-only key lists the provider's events only (payouts, service credits and
reversals charged to the earnings)."""
import pytest
from django.db import transaction
from rest_framework.test import APIClient

from billing.models import AccountKind, BillingEvent, Card, EventKind, TopUp
from billing.services.top_ups import top_up_credit
from marketplace.services.accounts import api_key_create
from tests.billing.helpers import fund
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _client(user, scopes) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_create(user=user, name='k', scopes=scopes)[1]}")
    return client


def _credited_top_up(user) -> TopUp:
    card = Card.objects.create(user=user, stripe_payment_method_id=f"pm_r54_{user.pk}", brand="visa", last4="4242",
                               exp_month=12, exp_year=2040)
    top_up = TopUp.objects.create(user=user, amount_micros=25_000_000, card=card, card_label=str(card))
    with transaction.atomic():
        top_up_credit(top_up_id=top_up.pk, payment_intent_id=f"pi_r54_{top_up.pk}", amount_micros=25_000_000)
    return top_up


@pytest.fixture
def wallet_user(clock):
    user = UserFactory()
    fund(user, "10")
    _credited_top_up(user)
    return user


def test_a_provider_only_key_reads_no_statement(wallet_user, clock):
    provider_key = _client(wallet_user, ["provider"])
    assert provider_key.get("/api/v1/billing/balance/").status_code == 403
    for path in ("/api/v1/billing/statements/", f"/api/v1/billing/statements/{clock.now:%Y-%m}/"):
        response = provider_key.get(path)
        assert response.status_code == 403, (path, response.content[:300])
        assert "`renter`" in response.json()["detail"]


@pytest.mark.parametrize("scopes", [["renter"], ["read"], ["read", "provider"], ["renter", "provider"]])
def test_a_key_that_may_read_the_wallet_reads_the_statements(wallet_user, clock, scopes):
    key = _client(wallet_user, scopes)
    assert key.get("/api/v1/billing/statements/").status_code == 200
    response = key.get(f"/api/v1/billing/statements/{clock.now:%Y-%m}/")
    assert response.status_code == 200
    assert [line["card_label"] for line in response.data["top_up_lines"]] == [str(Card.objects.get(user=wallet_user))]


def _events(client) -> set[str]:
    response = client.get("/api/v1/billing/events/?page_size=200")
    assert response.status_code == 200
    return {e["kind"] for e in response.json()["results"]}


def test_a_provider_only_key_lists_the_provider_events_only(wallet_user):
    user = wallet_user  # a credit and a top-up to the wallet: two wallet events
    BillingEvent.objects.create(user=user, kind=EventKind.LOW_BALANCE, message="Low.", data={})
    BillingEvent.objects.create(user=user, kind=EventKind.PAYOUT_PAID, message="Paid.", data={})
    BillingEvent.objects.create(user=user, kind=EventKind.PAYOUT_FAILED, message="Failed.", data={})
    BillingEvent.objects.create(user=user, kind=EventKind.SERVICE_CREDIT, message="Charged.", data={})
    BillingEvent.objects.create(user=user, kind=EventKind.CREDIT_REVERSED, message="Taken from earnings.",
                                data={"account": AccountKind.PROVIDER_EARNINGS})
    BillingEvent.objects.create(user=user, kind=EventKind.CREDIT_REVERSED, message="Taken from the balance.",
                                data={"account": AccountKind.CUSTOMER_WALLET})
    provider_only = _events(_client(user, ["provider"]))
    assert provider_only == {"payout_paid", "payout_failed", "service_credit", "credit_reversed"}
    response = _client(user, ["provider"]).get("/api/v1/billing/events/?kind=credit_reversed")
    assert [e["message"] for e in response.json()["results"]] == ["Taken from earnings."]
    everything = provider_only | {"top_up_succeeded", "credit", "low_balance"}
    for scopes in (["read"], ["renter", "provider"], ["read", "provider"]):
        assert _events(_client(user, scopes)) == everything, scopes
    # And the other way (review r55): a renter-only key reads no payouts nor what was taken from earnings.
    assert _events(_client(user, ["renter"])) == {"top_up_succeeded", "credit", "low_balance", "credit_reversed"}
    response = _client(user, ["renter"]).get("/api/v1/billing/events/?kind=credit_reversed")
    assert [e["message"] for e in response.json()["results"]] == ["Taken from the balance."]
