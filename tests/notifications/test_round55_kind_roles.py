"""Review r55 (MEDIUM-1, MEDIUM-2): an API key limited to one role (scopes `renter` or `provider`) read the other
role's rows through views open to any key: a provider-only key the wallet's balance in `low_balance` notices and
webhook deliveries (and could add an endpoint sent every wallet event), a renter-only key the provider's payouts in
/billing/events/ and `payout_sent` notices. Each kind now says whose it is (notifications.models.KIND_ROLES)."""
import json

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from billing.models import AccountKind, EventKind
from billing.services.ledger import credit_grant
from billing.services.low_balance import low_balance_warn
from billing.services.notify import event_create
from core.api.scopes import ALL_SCOPES, PROVIDER, READ, RENTER
from marketplace.services.accounts import api_key_create
from notifications import models as notification_models
from notifications.models import Kind, Notification, WebhookDelivery, WebhookEndpoint
from notifications.services.notify import notify
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db
EARNINGS_ACCOUNT = "provider_earnings"  # notification_models.EARNINGS_ACCOUNT (the module's names read in the tests,
# so that each test fails by itself on the code before them)


def _client(user, scopes):
    raw = api_key_create(user=user, name="-".join(scopes), scopes=scopes)[1]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def _endpoint(user, scopes=None, description=""):
    endpoint = WebhookEndpoint(user=user, url="https://hooks.example.com/in", secret_encrypted=b"x",
                               secret_hint="whsec_ab", description=description)
    endpoint.scopes = list(ALL_SCOPES if scopes is None else scopes)
    endpoint.save()
    return endpoint


def _payout_sent(user, n=1):
    return notify(user=user, kind=Kind.PAYOUT_SENT, dedupe_key=f"payout_sent:{n}",
                  payload={"payout": n, "transfer": "tr_x", "amount": "1234.56", "message": "$1,234.56 sent"})


# --- the table ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [k.value for k in Kind], ids=[k.value for k in Kind])
def test_every_kind_says_whose_it_is(kind):
    """A new kind without a role fails here: which keys may read it, and which endpoints receive it, is decided
    by KIND_ROLES."""
    m = notification_models
    assert m.KIND_ROLES.get(kind) in (RENTER, PROVIDER, m.ROLE_ACCOUNT, m.ROLE_BY_ACCOUNT), kind


def test_the_table_lists_no_kind_that_does_not_exist_and_names_the_earnings_as_billing_does():
    assert set(notification_models.KIND_ROLES) == set(Kind.values)
    assert notification_models.EARNINGS_ACCOUNT == EARNINGS_ACCOUNT == AccountKind.PROVIDER_EARNINGS


# --- the review's failing tests -----------------------------------------------------------------------------------

def test_provider_only_key_cannot_read_the_wallet_balance_through_notifications():
    user = UserFactory()
    low_balance_warn(renter_id=user.pk, balance=3_210_000, rate=1_000_000, remaining=3 * 3600, now=timezone.now())
    provider = _client(user, [PROVIDER])
    assert provider.get("/api/v1/billing/balance/").status_code == 403
    assert provider.get("/api/v1/billing/events/").json()["results"] == []
    rows = provider.get("/api/v1/notifications/").json()["results"]
    assert [r for r in rows if r["kind"] == "low_balance"] == [], rows
    assert [r["kind"] for r in _client(user, [RENTER]).get("/api/v1/notifications/").json()["results"]] == [
        "low_balance"]


def test_provider_only_key_cannot_read_the_wallet_balance_through_webhook_deliveries():
    user = UserFactory()
    _endpoint(user)
    low_balance_warn(renter_id=user.pk, balance=3_210_000, rate=1_000_000, remaining=3 * 3600, now=timezone.now())
    rows = _client(user, [PROVIDER]).get("/api/v1/webhook-deliveries/").json()["results"]
    assert [r for r in rows if r["kind"] == "low_balance"] == [], rows
    delivery = WebhookDelivery.objects.get(kind="low_balance")
    assert _client(user, [PROVIDER]).get(f"/api/v1/webhook-deliveries/{delivery.pk}/").status_code == 404
    assert _client(user, [RENTER]).get(f"/api/v1/webhook-deliveries/{delivery.pk}/").status_code == 200


def test_renter_only_key_cannot_read_payouts_through_billing_events_or_notifications():
    user = UserFactory()
    event_create(user=user, kind=EventKind.PAYOUT_PAID, message="$1,234.56 of your earnings was sent",
                 data={"payout": 1, "transfer": "tr_x"})
    _payout_sent(user)
    renter = _client(user, [RENTER])
    assert renter.get("/api/v1/billing/payouts/").status_code == 403
    assert renter.get("/api/v1/billing/earnings/").status_code == 403
    events = [e for e in renter.get("/api/v1/billing/events/").json()["results"] if e["kind"] == "payout_paid"]
    notices = [n for n in renter.get("/api/v1/notifications/").json()["results"] if n["kind"] == "payout_sent"]
    assert events == [] and notices == [], (events, notices)
    provider = _client(user, [PROVIDER])
    assert [e["kind"] for e in provider.get("/api/v1/billing/events/").json()["results"]] == ["payout_paid"]
    assert [n["kind"] for n in provider.get("/api/v1/notifications/").json()["results"]] == ["payout_sent"]


# --- credits: the wallet's or the earnings' -------------------------------------------------------------------------

def test_a_credit_is_the_renters_unless_it_is_to_the_earnings():
    user = UserFactory()
    credit_grant(user=user, amount_micros=5_000_000, reason="goodwill")  # to the wallet: no `account` in its data
    data = {"amount": "2.000000", "transaction": 1, "reverses": 2, "account": EARNINGS_ACCOUNT}
    event_create(user=user, kind=EventKind.CREDIT, message="$2.00 taken from your earnings was given back", data=data)
    notify(user=user, kind=Kind.CREDIT_POSTED, payload={**data, "message": "given back"}, dedupe_key="reversal:1:1",
           title="$2.00 given back to your earnings")
    wallet = {**data, "account": AccountKind.CUSTOMER_WALLET}
    notify(user=user, kind=Kind.CREDIT_REVERSED, payload={**wallet, "message": "reversed"},
           dedupe_key="credit_reversed:1")

    def seen(scopes):
        client = _client(user, scopes)
        notices = client.get("/api/v1/notifications/").json()["results"]
        events = client.get("/api/v1/billing/events/").json()["results"]
        return (sorted((n["kind"], n["payload"].get("account", "")) for n in notices),
                sorted((e["kind"], e["data"].get("account", "")) for e in events))

    renter_notices, renter_events = seen([RENTER])
    assert renter_notices == [("credit_posted", ""), ("credit_reversed", "customer_wallet")]
    assert renter_events == [("credit", "")]
    provider_notices, provider_events = seen([PROVIDER])
    assert provider_notices == [("credit_posted", EARNINGS_ACCOUNT)]
    assert provider_events == [("credit", EARNINGS_ACCOUNT)]
    every_notice, every_event = seen([READ])
    assert len(every_notice) == 3 and len(every_event) == 2


# --- unread count, mark read ---------------------------------------------------------------------------------------

def test_unread_count_and_mark_read_keep_to_the_keys_roles():
    user = UserFactory()
    low_balance_warn(renter_id=user.pk, balance=3_210_000, rate=1_000_000, remaining=3 * 3600, now=timezone.now())
    payout = _payout_sent(user)
    renter, provider = _client(user, [RENTER]), _client(user, [PROVIDER])
    assert provider.get("/api/v1/notifications/unread-count/").json() == {"unread": 1}
    assert renter.get("/api/v1/notifications/unread-count/").json() == {"unread": 1}
    assert renter.get(f"/api/v1/notifications/{payout.pk}/").status_code == 404
    assert renter.post(f"/api/v1/notifications/{payout.pk}/read/").status_code == 404
    assert renter.post("/api/v1/notifications/read-all/").status_code == 200
    payout.refresh_from_db()
    assert payout.read_at is None  # the renter key's read-all marked the renter's notice only
    assert Notification.objects.get(kind="low_balance").read_at is not None
    assert provider.get("/api/v1/notifications/unread-count/").json() == {"unread": 1}
    assert provider.post(f"/api/v1/notifications/{payout.pk}/read/").status_code == 200


def test_a_browser_session_and_a_full_key_see_every_role():
    user = UserFactory()
    low_balance_warn(renter_id=user.pk, balance=3_210_000, rate=1_000_000, remaining=3 * 3600, now=timezone.now())
    _payout_sent(user)
    session = APIClient()
    session.force_login(user)
    for client in (session, _client(user, list(ALL_SCOPES)), _client(user, [READ])):
        kinds = sorted(n["kind"] for n in client.get("/api/v1/notifications/").json()["results"])
        assert kinds == ["low_balance", "payout_sent"]
        assert client.get("/api/v1/notifications/unread-count/").json() == {"unread": 2}


# --- webhook endpoints -----------------------------------------------------------------------------------------------

def _create(client, url="https://hooks.example.com/in", **headers):
    return client.post("/api/v1/webhook-endpoints/", {"url": url}, format="json", **headers)


def test_an_endpoint_added_by_a_single_role_key_receives_that_roles_kinds_only():
    user = UserFactory()
    made = _create(_client(user, [PROVIDER]), url="http://127.0.0.1:9/hooks")
    assert made.status_code == 201, made.content
    assert made.json()["scopes"] == [PROVIDER]
    session_endpoint = _endpoint(user)  # the settings page's (or one added before scopes were kept): everything
    low_balance_warn(renter_id=user.pk, balance=3_210_000, rate=1_000_000, remaining=3 * 3600, now=timezone.now())
    _payout_sent(user)
    notify(user=user, kind=Kind.ACCOUNT_REACTIVATED, dedupe_key="account_status:1", payload={})
    sent = {(d.endpoint_id, d.kind) for d in WebhookDelivery.objects.all()}
    provider_endpoint = made.json()["id"]
    assert sent == {(provider_endpoint, "payout_sent"), (provider_endpoint, "account_reactivated"),
                    (session_endpoint.pk, "low_balance"), (session_endpoint.pk, "payout_sent"),
                    (session_endpoint.pk, "account_reactivated")}


def test_existing_endpoints_keep_receiving_everything():
    assert WebhookEndpoint._meta.get_field("scopes").get_default() == list(ALL_SCOPES)
    assert notification_models.all_scopes() == list(ALL_SCOPES)


def test_a_single_role_key_lists_and_changes_only_endpoints_within_its_scopes():
    user = UserFactory()
    renters = _endpoint(user, [RENTER], "renter's")
    providers = _endpoint(user, [PROVIDER], "provider's")
    everything = _endpoint(user, None, "settings page's")
    renter, provider = _client(user, [RENTER]), _client(user, [PROVIDER])
    wide, reader = _client(user, [READ, RENTER]), _client(user, [READ])

    def listed(client):
        return sorted(e["description"] for e in client.get("/api/v1/webhook-endpoints/").json()["results"])

    assert listed(renter) == ["renter's"]
    assert listed(provider) == ["provider's"]
    assert listed(reader) == listed(wide) == ["provider's", "renter's", "settings page's"]
    for other in (providers, everything):
        for method in ("get", "patch", "delete"):
            body = {} if method == "get" else {"data": {"active": False}, "format": "json"}
            r = getattr(renter, method)(f"/api/v1/webhook-endpoints/{other.pk}/", **body)
            assert r.status_code == 404, (method, other.description, r.content)
        assert renter.post(f"/api/v1/webhook-endpoints/{other.pk}/test/").status_code == 404
    # `read` lets a key see the provider's endpoint; redirecting or deleting it needs the provider scope.
    for method in ("patch", "delete"):
        r = getattr(wide, method)(f"/api/v1/webhook-endpoints/{everything.pk}/", {"active": False}, format="json")
        assert r.status_code == 403 and "(provider)" in r.json()["detail"], (method, r.content)
    assert wide.post(f"/api/v1/webhook-endpoints/{providers.pk}/test/").status_code == 403
    everything.refresh_from_db()
    assert everything.active and WebhookEndpoint.objects.count() == 3
    assert renter.patch(f"/api/v1/webhook-endpoints/{renters.pk}/", {"active": False},
                        format="json").status_code == 200
    assert provider.delete(f"/api/v1/webhook-endpoints/{providers.pk}/").status_code == 204
    assert _client(user, list(ALL_SCOPES)).delete(f"/api/v1/webhook-endpoints/{everything.pk}/").status_code == 204


def test_another_keys_idempotency_key_does_not_give_its_endpoints_secret():
    user = UserFactory()
    made = _create(_client(user, [RENTER]), url="http://127.0.0.1:9/hooks", HTTP_IDEMPOTENCY_KEY="same-key-1")
    assert made.status_code == 201, made.content
    again = _create(_client(user, [PROVIDER]), url="http://127.0.0.1:9/hooks", HTTP_IDEMPOTENCY_KEY="same-key-1")
    assert again.status_code == 422 and "secret" not in again.json(), again.content
    replay = _create(_client(user, [RENTER]), url="http://127.0.0.1:9/hooks", HTTP_IDEMPOTENCY_KEY="same-key-1")
    assert replay.status_code == 200 and replay.json()["secret"] == made.json()["secret"]
    assert WebhookEndpoint.objects.count() == 1


def test_a_webhook_delivery_body_is_what_the_list_hides():
    """The list filters on the delivery's notice (its payload): an earnings credit's delivery is the provider's."""
    user = UserFactory()
    _endpoint(user)
    notify(user=user, kind=Kind.CREDIT_POSTED, dedupe_key="reversal:9:9", title="given back",
           payload={"amount": "1.000000", "account": EARNINGS_ACCOUNT, "message": "given back"})
    renter_rows = _client(user, [RENTER]).get("/api/v1/webhook-deliveries/").json()["results"]
    provider_rows = _client(user, [PROVIDER]).get("/api/v1/webhook-deliveries/").json()["results"]
    assert renter_rows == []
    assert [json.loads(r["body"])["data"]["account"] for r in provider_rows] == [EARNINGS_ACCOUNT]
