"""Weekly payouts through Stripe Connect transfers, against a small local server speaking Stripe's format
(localstripe has no Connect): once per provider and week, above a minimum, reversed when refused."""
import json
import threading
from datetime import date
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import pytest
from django.core import mail

from billing.models import BillingEvent, BillingProfile, LedgerTransaction, Payout, PayoutStatus
from billing.services import payouts
from billing.services.ledger import earnings_balance
from billing.tasks import payouts_run as payouts_task
from marketplace.services import instances as svc
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

MONDAY = date(2026, 3, 9)


class ConnectServer:
    """POST /v1/transfers and GET /v1/transfers?transfer_group= answered as Stripe does; `mode` switches to a
    refusal, an outage, an idempotency conflict (409), or "lose": the transfer is made, then the connection is
    dropped before the answer (a timeout, as the platform sees it)."""

    def __init__(self):
        self.requests: list[dict] = []  # the POSTs
        self.lookups: list[str] = []  # the GETs' paths
        self.made: list[dict] = []  # the transfers made
        self.mode = "ok"
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                server.lookups.append(self.path)
                path, _, query = self.path.partition("?")
                group = parse_qs(query).get("transfer_group", [None])[0]
                if server.mode == "down":
                    self._answer(503, {"error": {"type": "api_error", "message": "Service unavailable"}})
                elif server.mode == "lookup_refused":  # a restricted key may create transfers, not list them
                    self._answer(403, {"error": {"type": "invalid_request_error", "code": "secret_key_required",
                                                 "message": "The provided key does not have the required "
                                                            "permissions for this endpoint."}})
                elif path != "/v1/transfers":
                    self._answer(404, {"error": {"type": "invalid_request_error", "message": "Unrecognized URL"}})
                else:
                    data = [t for t in server.made if group is None or t["transfer_group"] == group]
                    self._answer(200, {"object": "list", "url": "/v1/transfers", "has_more": False, "data": data})

            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                form = {k: v[0] for k, v in parse_qs(body).items()}
                server.requests.append({"path": self.path, "form": form,
                                        "idempotency_key": self.headers.get("Idempotency-Key"),
                                        "auth": self.headers.get("Authorization")})
                if server.mode == "conflict":
                    self._answer(409, {"error": {"type": "idempotency_error", "message": "There is currently "
                                                 "another in-progress request using this Idempotent Key."}})
                elif server.mode == "refuse":
                    self._answer(400, {"error": {"type": "invalid_request_error", "code": "resource_missing",
                                                 "param": "destination",
                                                 "message": f"No such destination: '{form.get('destination')}'"}})
                elif server.mode == "down":
                    self._answer(503, {"error": {"type": "api_error", "message": "Service unavailable"}})
                elif self.path != "/v1/transfers":
                    self._answer(404, {"error": {"type": "invalid_request_error", "message": "Unrecognized URL"}})
                else:
                    n = len(server.requests)
                    transfer = {
                        "id": f"tr_test{n:06d}", "object": "transfer", "amount": int(form["amount"]),
                        "currency": form["currency"], "destination": form["destination"],
                        "transfer_group": form.get("transfer_group"), "livemode": False, "reversed": False,
                        "metadata": {k[9:-1]: v for k, v in form.items() if k.startswith("metadata[")},
                    }
                    server.made.append(transfer)
                    if server.mode == "lose":
                        self.close_connection = True  # made, and no answer
                        return
                    self._answer(200, transfer)

            def _answer(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Request-Id", "req_test")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # close() waits for serve_forever to see the shutdown: every poll_interval (0.5 s by default)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def connect(settings):
    server = ConnectServer()
    settings.STRIPE_CONNECT_API_BASE = server.url
    yield server
    server.close()


def _provider_with_earnings(clock, usd_per_hour="10.000000", hours=5, account="acct_1TestProvider"):
    provider, renter = UserFactory(), UserFactory()
    BillingProfile.objects.create(user=provider, stripe_connect_account_id=account)
    fund(renter, "1000")
    instance = running(renter, node(usd_per_hour, provider=provider))
    clock.advance(hours * 3600)
    svc.instance_stop(instance=instance)
    return provider


def test_a_provider_is_paid_their_earnings_once_per_week(clock, connect, api):
    provider = _provider_with_earnings(clock)  # $50 gross, $42.50 after the 15 % fee
    assert earnings_balance(user_id=provider.pk) == 42_500_000
    done = payouts.payouts_run(today=MONDAY)
    assert [(p.provider_id, p.status, p.amount_micros) for p in done] == [(provider.pk, "paid", 42_500_000)]
    payout = done[0]
    assert (payout.period_start, payout.period_end) == (date(2026, 3, 2), date(2026, 3, 8))
    request = connect.requests[0]
    assert request["path"] == "/v1/transfers" and request["idempotency_key"] == f"payout-{payout.pk}"
    assert request["form"]["amount"] == "4250" and request["form"]["currency"] == "usd"
    assert request["form"]["destination"] == "acct_1TestProvider"
    assert request["form"]["transfer_group"] == f"payout-{payout.pk}"
    assert payout.transfer_id == "tr_test000001" and earnings_balance(user_id=provider.pk) == 0
    # Run again for the same week (a retried beat, a second worker): nothing more.
    payouts.payouts_run(today=MONDAY)
    payouts_task()  # the Celery entry point, with the real date: another week, paid by itself
    assert Payout.objects.filter(provider=provider, period_start=date(2026, 3, 2)).count() == 1
    assert len([r for r in connect.requests if r["form"]["destination"] == "acct_1TestProvider"]) <= 2
    assert BillingEvent.objects.filter(user=provider, kind="payout_paid").exists()


def test_no_payout_below_the_minimum_or_without_a_connect_account(clock, connect, settings):
    settings.BILLING_PAYOUT_MINIMUM_USD = 25
    small = _provider_with_earnings(clock, hours=1)  # $8.50
    no_account = _provider_with_earnings(clock, account="")
    assert payouts.payouts_run(today=MONDAY) == []
    assert not connect.requests and not Payout.objects.exists()
    assert earnings_balance(user_id=small.pk) == 8_500_000 and earnings_balance(user_id=no_account.pk) > 0


def test_a_refused_transfer_fails_the_payout_and_gives_the_earnings_back(clock, connect,
                                                                          django_capture_on_commit_callbacks):
    provider = _provider_with_earnings(clock)
    connect.mode = "refuse"
    with django_capture_on_commit_callbacks(execute=True):
        [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.FAILED and "No such destination" in payout.failure_message
    assert payout.reversal.reverses == payout.transaction
    assert earnings_balance(user_id=provider.pk) == 42_500_000
    assert any("payout failed" in m.subject for m in mail.outbox)
    connect.mode = "ok"
    assert payouts.payouts_run(today=MONDAY) == [payout]  # this week's payout is done (failed); next week pays
    assert Payout.objects.get(pk=payout.pk).status == PayoutStatus.FAILED


def test_an_outage_leaves_the_payout_pending_and_the_next_run_sends_it_with_the_same_key(clock, connect):
    provider = _provider_with_earnings(clock)
    connect.mode = "down"
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING and payout.attempts == 1
    assert earnings_balance(user_id=provider.pk) == 0  # reserved: it cannot be paid twice
    connect.mode = "ok"
    payouts.payouts_run(today=MONDAY)
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and payout.attempts == 2
    keys = {r["idempotency_key"] for r in connect.requests}
    assert keys == {f"payout-{payout.pk}"}
    assert LedgerTransaction.objects.filter(kind="payout").count() == 1


def test_payouts_and_earnings_in_the_api(clock, connect, client_for, other_api):
    provider = _provider_with_earnings(clock)
    payouts.payouts_run(today=MONDAY)
    api = client_for(provider)
    [row] = api.get("/api/v1/billing/payouts/").json()["results"]
    assert row["amount"] == "42.500000" and row["status"] == "paid" and row["period_start"] == "2026-03-02"
    assert other_api.get("/api/v1/billing/payouts/").json()["results"] == []
    earnings = api.get("/api/v1/billing/earnings/").json()
    assert earnings["balance"] == "0.000000" and earnings["earned"] == "42.500000"
    assert earnings["paid_out"] == "42.500000" and earnings["renters_paid"] == "50.000000"
    assert earnings["platform_fees"] == "7.500000" and earnings["billed_seconds"] == 5 * 3600
    assert earnings["platform_fee_percent"] == "15.00" and earnings["payout_account_set"] is True
    assert earnings["payout_pending"] == "0.000000"
    assert earnings["months"] == [{"month": "2026-03", "earned": "42.500000", "paid_out": "42.500000",
                                   "payout_pending": "0.000000"}]
    nothing = other_api.get("/api/v1/billing/earnings/").json()
    assert nothing["earned"] == "0.000000" and nothing["months"] == [] and nothing["payout_account_set"] is False


def test_a_transfer_whose_answer_was_lost_is_found_and_recorded_not_sent_again(clock, connect):
    """The transfer was made but its answer lost: the payout stays pending (earnings reserved), and the next try
    finds the transfer by its transfer group and records it, even a week later, when Stripe has forgotten the
    Idempotency-Key."""
    provider = _provider_with_earnings(clock)
    connect.mode = "lose"
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING and payout.attempts == 1 and len(connect.made) == 1
    assert earnings_balance(user_id=provider.pk) == 0
    connect.mode = "ok"
    payouts.payouts_run(today=MONDAY)
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and payout.transfer_id == connect.made[0]["id"]
    assert len(connect.made) == 1 and len(connect.requests) == 1  # looked up, not sent again
    [lookup] = connect.lookups
    assert lookup.startswith("/v1/transfers?") and f"transfer_group=payout-{payout.pk}" in lookup
    assert earnings_balance(user_id=provider.pk) == 0 and not LedgerTransaction.objects.filter(
        kind="payout_reversal").exists()


def test_a_lookup_stripe_refuses_leaves_the_payout_pending_never_failed(clock, connect):
    """Review: after a lost answer, a definite error of the lookup (here a 403) failed the payout and gave its
    earnings back, though Stripe had made the transfer: the next payout paid them again. Not known is not failed."""
    provider = _provider_with_earnings(clock)
    connect.mode = "lose"
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING and len(connect.made) == 1
    connect.mode = "lookup_refused"
    for _ in range(2):
        payouts.payouts_run(today=MONDAY)
        payout.refresh_from_db()
        assert payout.status == PayoutStatus.PENDING and payout.reversal is None
        assert earnings_balance(user_id=provider.pk) == 0  # still reserved: nothing to pay a second time
    assert "permissions" in payout.failure_message and len(connect.requests) == 1  # not sent again either
    connect.mode = "ok"
    payouts.payouts_run(today=MONDAY)
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and payout.transfer_id == connect.made[0]["id"]
    assert len(connect.made) == 1 and not LedgerTransaction.objects.filter(kind="payout_reversal").exists()


def test_a_lost_answer_for_a_transfer_that_was_not_made_sends_it_once_more(clock, connect):
    _provider_with_earnings(clock)
    connect.mode = "down"
    [payout] = payouts.payouts_run(today=MONDAY)
    connect.mode = "ok"
    payouts.payouts_run(today=MONDAY)
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and len(connect.made) == 1 and len(connect.lookups) == 1


def test_an_idempotency_conflict_is_not_a_refusal_the_earnings_stay_reserved(clock, connect):
    """Stripe's 409 for a key another request is using says nothing about whether that request paid: the payout
    stays pending, and nothing is given back to be paid a second time."""
    provider = _provider_with_earnings(clock)
    connect.mode = "conflict"
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING and payout.reversal is None
    assert earnings_balance(user_id=provider.pk) == 0
    assert "still handling an earlier attempt" in payout.failure_message


def test_a_payout_another_process_is_sending_is_left_to_it(clock, connect):
    """The weekly run and an operator's "send again" at once: the second sends nothing."""
    from django.db import connections

    from core.locks import lock_key

    provider = _provider_with_earnings(clock)
    payout = payouts.payout_create(provider_id=provider.pk, period_start=date(2026, 3, 2),
                                   period_end=date(2026, 3, 8))
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [lock_key(f"billing.payout_send:{payout.pk}")])
        assert payouts.payout_send(payout=payout).status == PayoutStatus.PENDING
        assert connect.requests == [] and connect.lookups == []
        # Released here, not by close(): the server ends a closed session's backend (and its locks) a moment after
        # the client has gone, and the send below once ran before it (7 xdist workers on 2 cores).
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [lock_key(f"billing.payout_send:{payout.pk}")])
    finally:
        other.close()
    assert payouts.payout_send(payout=payout).status == PayoutStatus.PAID


def test_the_per_minute_follow_up_tries_a_lost_payout_again_within_minutes_not_next_week(clock, connect, settings,
                                                                                         monkeypatch):
    from datetime import UTC, datetime, timedelta

    from billing.tasks import top_ups_reconcile

    _provider_with_earnings(clock)
    monkeypatch.setattr("django.utils.timezone.now", lambda: datetime.now(UTC))  # rows' created_at are real
    connect.mode = "lose"
    [payout] = payouts.payouts_run(today=MONDAY)
    connect.mode = "ok"
    top_ups_reconcile()  # too early: its answer may still be on its way
    assert Payout.objects.get(pk=payout.pk).status == PayoutStatus.PENDING and connect.lookups == []
    Payout.objects.filter(pk=payout.pk).update(
        created_at=payout.created_at - timedelta(seconds=settings.BILLING_TOP_UP_RECONCILE_AFTER_S + 60))
    top_ups_reconcile()
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and payout.transfer_id == connect.made[0]["id"]
    assert len(connect.made) == 1


def test_payouts_whose_lookup_stripe_refuses_do_not_hide_the_others_from_the_follow_up(clock, connect, monkeypatch):
    """The per-minute follow-up took the 100 oldest pending payouts, and one whose lookup Stripe keeps refusing stays
    pending (rightly): with a full batch of them, newer payouts were never tried again. The least recently tried go
    first now."""
    from datetime import UTC, datetime, timedelta

    monkeypatch.setattr(payouts, "PAYOUT_FOLLOW_UP_BATCH", 1)
    _provider_with_earnings(clock), _provider_with_earnings(clock, account="acct_2TestProvider")
    connect.mode = "lose"
    first, second = payouts.payouts_run(today=MONDAY)
    assert {first.status, second.status} == {PayoutStatus.PENDING} and len(connect.made) == 2
    connect.mode = "lookup_refused"
    later = datetime.now(UTC) + timedelta(hours=1)  # rows' created_at are real (the field's default)
    for _ in range(2):
        clock.advance(seconds=60)
        assert payouts.payouts_send_pending(now=later) == 1
    groups = [parse_qs(path.partition("?")[2])["transfer_group"][0] for path in connect.lookups]
    assert groups == [f"payout-{first.pk}", f"payout-{second.pk}"]
    connect.mode = "ok"
    for _ in range(2):
        clock.advance(seconds=60)
        payouts.payouts_send_pending(now=later)
    assert set(Payout.objects.values_list("status", flat=True)) == {PayoutStatus.PAID}
    assert len(connect.made) == 2 and len(connect.requests) == 2  # found by their lookups, not sent again
