"""Text a receiver chose, recorded as an attempt's error (found by review): a webhook receiver's reason phrase with a
NUL (http.client keeps any byte of the status line) was written into attempt.error / delivery.last_error; PostgreSQL
refuses NUL in text, the recording raised, and the counted attempt was never logged (the delivery stayed claimed;
the resender re-sent it without backoff, each time crashing). A mail server's refusal with a NUL did the same to
the notification's e-mail_error. What is recorded now has no control characters, whatever its source."""
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from notifications.models import DeliveryStatus, EmailStatus, Kind
from notifications.services import notify as notify_svc
from notifications.services import webhooks
from notifications.services.email import notification_email_send
from notifications.services.retry import recordable

from .test_email import smtp  # noqa: F401 (the fixture)

pytestmark = pytest.mark.django_db


@pytest.fixture
def nul_reason_receiver():
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(500, "Bad\x00Gateway")  # written as latin-1: the NUL goes on the wire
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()


def test_a_reason_phrase_with_a_nul_is_recorded_as_a_failed_attempt(owner, nul_reason_receiver, settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 3
    endpoint, _ = webhooks.endpoint_create(user=owner, url=nul_reason_receiver)
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    attempt = webhooks.webhook_attempt(delivery_id=delivery.pk)  # raised: DataError on the NUL
    assert attempt is not None and attempt.status_code == 500 and attempt.retry_in_s is not None
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.RETRYING and delivery.claimed_at is None
    (logged,) = delivery.attempt_log.all()
    assert logged.status_code == 500 and logged.error == "Answered 500 Bad Gateway"
    assert delivery.last_error == logged.error


def test_a_mail_servers_refusal_with_a_nul_is_recorded(owner, smtp):  # noqa: F811 (the fixture)
    smtp.rcpt_answers.append("550 5.1.1 no\x00such user")
    notification = notify_svc.notify(user=owner, kind=Kind.PAYOUT_SENT, dedupe_key="payout_sent:44",
                                     payload={"payout": 44, "amount": "1.00", "message": "Sent to you."})
    assert notification is not None
    assert not notification_email_send(notification_id=notification.pk).sent  # raised: DataError on the NUL
    notification.refresh_from_db()
    assert (notification.email_status, notification.email_attempts) == (EmailStatus.FAILED, 1)
    assert notification.email_error == "The mail server refused it: 550 5.1.1 no such user"


def test_recordable_text_has_no_control_characters_and_is_bounded():
    assert recordable("a\x00b\r\nc\x7fd\x85e\ud800f") == "a b c d e f"
    assert recordable("x" * 600) == "x" * 500
    assert recordable(" \x00 ", limit=10) == ""
