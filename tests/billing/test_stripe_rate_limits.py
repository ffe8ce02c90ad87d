"""Stripe's rate limit (a 429, or the older 400 `rate_limit`) is a refusal for now, not for good: what was asked is
kept and settled or tried again later, never failed on it.

Found by review: `stripe_gateway.is_definite` counted any 4xx as a definite refusal, a 429 too, so a rate-limited
transfer failed its payout (its earnings given back, the provider told by e-mail to check their Stripe account) and
a rate-limited refund or top-up charge was failed while its message said the outcome was not known.
"""
import http.client
import json
import threading
from datetime import UTC, date, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import stripe
from django.core import mail
from django.utils import timezone

from billing.models import (
    BillingEvent,
    BillingProfile,
    LedgerTransaction,
    PayoutStatus,
    Refund,
    RefundStatus,
    TopUp,
    TopUpStatus,
)
from billing.services import payments, payouts, reconcile
from billing.services.ledger import earnings_balance
from billing.services.reconcile import refunds_reconcile
from billing.services.stripe_gateway import is_definite, translate
from core.errors import Unavailable
from marketplace.services import instances as svc
from tests.billing.helpers import balance, fund, node, running
from tests.billing.test_payments import _credited_top_up, save_card, stripe_client
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

MONDAY = date(2026, 3, 9)
LATER = timedelta(minutes=10)  # past BILLING_TOP_UP_RECONCILE_AFTER_S

RATE_LIMITED = (429, {"error": {"type": "invalid_request_error", "code": "rate_limit",
                                "message": "Too many requests hit the API too quickly."}})
LOCK_TIMEOUT = (429, {"error": {"type": "invalid_request_error", "code": "lock_timeout",
                                "message": "This object cannot be accessed right now because another API request "
                                           "or Stripe process is currently accessing it."}})
OLD_RATE_LIMIT = (400, {"error": {"type": "invalid_request_error", "code": "rate_limit",
                                  "message": "Too many requests hit the API too quickly."}})
LIMITS = pytest.mark.parametrize("limit", [RATE_LIMITED, LOCK_TIMEOUT, OLD_RATE_LIMIT],
                                 ids=["429", "429_lock_timeout", "400_rate_limit"])


def _error(cls, status, **kwargs):
    return cls("refused", http_status=status, json_body={"error": {"message": "refused"}}, **kwargs)


@pytest.mark.parametrize(("exc", "definite"), [
    (_error(stripe.RateLimitError, 429), False),
    (_error(stripe.RateLimitError, 400), False),  # the older `rate_limit` code
    (_error(stripe.APIError, 429), False),
    (_error(stripe.APIError, 409), False),
    (_error(stripe.IdempotencyError, 400), False),
    (_error(stripe.APIError, 500), False),
    (_error(stripe.APIError, 422), False),  # an answer stripe-python could not place: not known
    (stripe.APIConnectionError("no answer"), False),
    (_error(stripe.InvalidRequestError, 400, param="destination"), True),
    (_error(stripe.InvalidRequestError, 404, param=None), True),
    (_error(stripe.CardError, 402, param=None, code="card_declined"), True),
    (_error(stripe.PermissionError, 403), True),
    (_error(stripe.AuthenticationError, 401), True),
], ids=lambda value: value if isinstance(value, bool) else f"{type(value).__name__}_{value.http_status}")
def test_only_a_refusal_for_good_is_definite_the_same_line_as_the_message(exc, definite):
    assert is_definite(exc) is definite
    # What callers fail on is what the message does not call "not known yet" (translate's Unavailable).
    assert isinstance(translate(exc, "doing it"), Unavailable) is not definite


# ---------------------------------------------------------------------------------------------- payouts


class ConnectServer:
    """POST and GET /v1/transfers as Stripe answers them, the first `limited` POSTs answered `limit` (nothing made)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.lookups: list[str] = []
        self.made: list[dict] = []
        self.limited, self.limit = 0, RATE_LIMITED
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                server.lookups.append(self.path)
                group = parse_qs(urlsplit(self.path).query).get("transfer_group", [None])[0]
                data = [t for t in server.made if group is None or t["transfer_group"] == group]
                self._answer(200, {"object": "list", "url": "/v1/transfers", "has_more": False, "data": data})

            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                form = {k: v[0] for k, v in parse_qs(body).items()}
                server.requests.append({"form": form, "idempotency_key": self.headers.get("Idempotency-Key")})
                if server.limited:
                    server.limited -= 1
                    self._answer(*server.limit)
                    return
                transfer = {"id": f"tr_test{len(server.requests):06d}", "object": "transfer",
                            "amount": int(form["amount"]), "currency": form["currency"],
                            "destination": form["destination"], "transfer_group": form.get("transfer_group"),
                            "livemode": False, "reversed": False,
                            "metadata": {k[9:-1]: v for k, v in form.items() if k.startswith("metadata[")}}
                server.made.append(transfer)
                self._answer(200, transfer)

            def _answer(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def connect(settings):
    server = ConnectServer()
    settings.STRIPE_CONNECT_API_BASE = server.url
    yield server
    server.close()


def _provider_with_earnings(clock):
    provider, renter = UserFactory(), UserFactory()
    BillingProfile.objects.create(user=provider, stripe_connect_account_id="acct_1TestProvider")
    fund(renter, "1000")
    instance = running(renter, node("10.000000", provider=provider))
    clock.advance(5 * 3600)
    svc.instance_stop(instance=instance)
    return provider  # $42.50 of earnings


@LIMITS
def test_a_rate_limited_transfer_stays_pending_and_is_sent_again_once_with_its_key(
        clock, connect, limit, django_capture_on_commit_callbacks, settings):
    provider = _provider_with_earnings(clock)
    connect.limited, connect.limit = 2, limit
    with django_capture_on_commit_callbacks(execute=True):
        [payout] = payouts.payouts_run(today=MONDAY)
    # Was: failed, its earnings given back, and "check your Stripe account id" e-mailed to the provider.
    assert payout.status == PayoutStatus.PENDING and payout.reversal is None and payout.attempts == 1
    assert "not known yet" in payout.failure_message
    assert earnings_balance(user_id=provider.pk) == 0  # still reserved: nothing to pay a second time
    assert not BillingEvent.objects.filter(user=provider, kind="payout_failed").exists()
    assert not any("payout failed" in m.subject for m in mail.outbox)
    settings.BILLING_TOP_UP_RECONCILE_AFTER_S = 0
    with django_capture_on_commit_callbacks(execute=True):
        assert payouts.payouts_send_pending(now=datetime.now(UTC) + LATER) == 1  # the follow-up: limited once more
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PENDING and payout.attempts == 2
    with django_capture_on_commit_callbacks(execute=True):
        payouts.payouts_send_pending(now=datetime.now(UTC) + LATER)
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and payout.transfer_id == connect.made[0]["id"]
    assert len(connect.made) == 1 and len(connect.requests) == 3 and len(connect.lookups) == 2  # looked up first
    assert {r["idempotency_key"] for r in connect.requests} == {f"payout-{payout.pk}"}
    assert LedgerTransaction.objects.filter(kind="payout").count() == 1
    assert not LedgerTransaction.objects.filter(kind="payout_reversal").exists()
    assert earnings_balance(user_id=provider.pk) == 0


def test_a_refused_transfer_still_fails_the_payout(clock, connect, django_capture_on_commit_callbacks):
    provider = _provider_with_earnings(clock)
    connect.limited, connect.limit = 1, (400, {"error": {"type": "invalid_request_error", "code": "resource_missing",
                                                         "param": "destination",
                                                         "message": "No such destination: 'acct_1TestProvider'"}})
    with django_capture_on_commit_callbacks(execute=True):
        [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.FAILED and "No such destination" in payout.failure_message
    assert earnings_balance(user_id=provider.pk) == 42_500_000


# ---------------------------------------------------------------------------------------------- top-ups, refunds


class RateLimitingProxy:
    """In front of localstripe: the first `limited[(method, path)]` requests to a path are answered `limit` and not
    sent on (Stripe did nothing); the others are relayed."""

    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.limited: dict[tuple[str, str], int] = {}
        self.limit = RATE_LIMITED
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                key = (self.command, self.path.partition("?")[0])
                if proxy.limited.get(key):
                    proxy.limited[key] -= 1
                    status, payload = proxy.limit
                    self._send(status, [("Content-Type", "application/json")], json.dumps(payload).encode())
                    return
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                upstream.close()
                self._send(answer.status, [(k, v) for k, v in answer.getheaders()
                                           if k.lower() not in ("transfer-encoding", "connection", "content-length")],
                           data)

            def _send(self, status, headers, data):
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _relay  # noqa: N815 (http.server's names)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def limiting(localstripe, settings):
    proxy = RateLimitingProxy(localstripe.url)
    settings.STRIPE_API_BASE = proxy.url
    yield proxy
    proxy.close()


@LIMITS
def test_a_rate_limited_charge_is_followed_up_not_taken_as_surely_failed(localstripe, limiting, api, limit):
    card = save_card(api)
    limiting.limit = limit
    limiting.limited[("POST", "/v1/payment_intents")] = 1
    response = api.post("/api/v1/billing/top-ups/", {"amount": "20.00", "card": card["id"]}, format="json")
    assert response.status_code == 503, response.content
    assert "not known yet" in response.json()["detail"]
    top_up = TopUp.objects.get(pk=response.json()["top_up"])
    # Was: failed for sure (outcome_unknown False: never looked up) while the answer said it was not known.
    assert top_up.status == TopUpStatus.FAILED and top_up.outcome_unknown and balance(api.user) == 0
    TopUp.objects.filter(pk=top_up.pk).update(updated_at=timezone.now() - LATER)
    assert reconcile.top_ups_find_lost() == {"not_charged": 1}  # the follow-up finds Stripe made no payment
    top_up.refresh_from_db()
    assert not top_up.outcome_unknown and "your card was not charged" in top_up.failure_message
    assert stripe_client(localstripe).payment_intents.list().data == []


@LIMITS
def test_a_rate_limited_refund_stays_held_until_stripe_says_it_made_none(localstripe, limiting, api,
                                                                          refund_operator_api, limit):
    top_up = _credited_top_up(localstripe, api)  # $40
    limiting.limit = limit
    limiting.limited[("POST", "/v1/refunds")] = 1
    response = refund_operator_api.post("/api/v1/billing/refunds/", {"top_up": top_up.pk, "amount": "15.00",
                                                                     "reason": "customer asked"}, format="json")
    assert response.status_code == 503, response.content
    assert "stays pending" in response.json()["detail"]
    refund = Refund.objects.get(pk=response.json()["refund"])
    # Was: failed at once and its hold given back while the answer said the outcome was not known.
    assert refund.status == RefundStatus.PENDING and balance(api.user) == 25_000_000  # held
    assert payments.refundable_micros(top_up=top_up) == 25_000_000  # not refundable twice meanwhile
    assert refunds_reconcile(now=timezone.now() + LATER) == {"failed": 1}
    refund.refresh_from_db()
    assert refund.status == RefundStatus.FAILED and "made no refund" in refund.failure_message
    assert balance(api.user) == 40_000_000 and payments.refundable_micros(top_up=top_up) == 40_000_000
    assert stripe_client(localstripe).refunds.list(params={"payment_intent": top_up.payment_intent_id}).data == []
