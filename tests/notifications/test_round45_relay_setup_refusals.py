"""The platform's own mail relay refusing the platform, not the message, is retried (found by review, round 45).

A 5xx greeting (the platform's address on a blocklist, the relay's access list not updated after a move) raised
SMTPConnectError and a 5xx to STARTTLS (the relay's certificate not installed) a bare SMTPResponseException; both
were judged by their code, so every notification e-mail tried then was failed for good at its first attempt and
never sent, even once the operator had fixed the relay. Now only the answers about the message (RCPT TO for every
recipient, DATA) fail it for good; the set-up's (greeting, EHLO/HELO, STARTTLS, AUTH, MAIL FROM) are retried.

Django's SMTP backend talks to a real SMTP server on 127.0.0.1 that answers each step as scripted."""
import socketserver
import threading

import pytest

from notifications.models import EmailStatus, Kind, Notification
from notifications.services import email as email_svc
from notifications.services import notify as notify_svc

pytestmark = pytest.mark.django_db


class Relay:
    """A real SMTP server on 127.0.0.1. `answers[verb]` are the next answers to that step ("GREETING", "EHLO",
    "HELO", "STARTTLS", "AUTH", "MAIL", "RCPT", "DATA" for the DATA command, "END" for the message's end); then
    the usual ones. STARTTLS and AUTH are offered only while they have a scripted answer. Records each message."""

    def __init__(self):
        self.answers: dict[str, list[str]] = {}
        self.messages: list[bytes] = []
        relay = self

        def next_answer(verb: str, default: str) -> str:
            queue = relay.answers.get(verb) or []
            return queue.pop(0) if queue else default

        class Session(socketserver.StreamRequestHandler):
            def reply(self, line: str) -> None:
                self.wfile.write(line.encode() + b"\r\n")

            def handle(self):
                greeting = next_answer("GREETING", "220 mail.test ESMTP")
                self.reply(greeting)
                if not greeting.startswith("220"):
                    return
                while line := self.rfile.readline():
                    verb = line.split(b" ", 1)[0].split(b":", 1)[0].strip().upper().decode()
                    if verb == "EHLO":
                        answer = next_answer("EHLO", "250 mail.test")
                        extensions = [e for e in ("STARTTLS", "AUTH PLAIN") if relay.answers.get(e.split()[0])]
                        if answer.startswith("250") and extensions:
                            self.reply("250-mail.test")
                            for extension in extensions[:-1]:
                                self.reply(f"250-{extension}")
                            self.reply(f"250 {extensions[-1]}")
                        else:
                            self.reply(answer)
                    elif verb in ("HELO", "STARTTLS", "AUTH", "MAIL", "RCPT"):
                        self.reply(next_answer(verb, "250 OK"))
                    elif verb == "DATA":
                        answer = next_answer("DATA", "354 go ahead")
                        self.reply(answer)
                        if not answer.startswith("354"):
                            continue
                        data = b""
                        while (chunk := self.rfile.readline()) not in (b".\r\n", b""):
                            data += chunk
                        answer = next_answer("END", "250 OK")
                        if answer.startswith("250"):
                            relay.messages.append(data)
                        self.reply(answer)
                    elif verb in ("RSET", "NOOP"):
                        self.reply("250 OK")
                    elif verb == "QUIT":
                        self.reply("221 bye")
                        return
                    else:
                        self.reply("502 not implemented")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Session)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def relay(settings):
    server = Relay()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", server.port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    settings.EMAIL_TIMEOUT = 5
    yield server
    server.stop()


def _notify(user, key: str) -> Notification:
    notification = notify_svc.notify(user=user, kind=Kind.PAYOUT_SENT, dedupe_key=key, payload={
        "payout": 4, "amount": "12.50", "message": "Your payout of $12.50 was sent."})
    assert notification is not None
    return notification


# (the step, its answer, the settings that make Django's backend take that step)
SETUP_REFUSALS = [
    ("GREETING", "554 5.7.1 mail.test: access denied for 127.0.0.1", {}),
    ("STARTTLS", "554 5.7.3 TLS not available: certificate not installed", {"EMAIL_USE_TLS": True}),
    ("EHLO", "550 5.7.1 not welcome", {}),  # smtplib falls back to HELO: refused too below
    ("AUTH", "535 5.7.8 authentication credentials invalid",
     {"EMAIL_HOST_USER": "platform", "EMAIL_HOST_PASSWORD": "pw"}),
    ("MAIL", "553 5.7.1 sender address not owned by the platform's account", {}),
]


@pytest.mark.parametrize("step, answer, setup", SETUP_REFUSALS, ids=[s for s, _, _ in SETUP_REFUSALS])
def test_the_relay_refusing_the_platform_is_retried_and_sent_once_fixed(owner, relay, settings, step, answer,
                                                                        setup):
    relay.answers[step] = [answer]
    if step == "EHLO":
        relay.answers["HELO"] = [answer]
    for name, value in setup.items():
        setattr(settings, name, value)
    notification = _notify(owner, f"payout_sent:{step}")

    first = email_svc.notification_email_send(notification_id=notification.pk, after_attempts=0)
    notification.refresh_from_db()
    assert first.retry_in_s is not None, f"the relay's {step} refusal was not retried"
    assert (notification.email_status, notification.email_attempts) == (EmailStatus.PENDING, 1)
    assert notification.email_error == f"The mail server refused it: {answer}"
    assert relay.messages == []

    # The operator fixes the relay (its access list, its certificate, the platform's log-in); the retry comes.
    relay.answers.clear()
    settings.EMAIL_USE_TLS = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    second = email_svc.notification_email_send(notification_id=notification.pk, after_attempts=1)
    notification.refresh_from_db()
    assert second.sent and notification.email_status == EmailStatus.SENT and len(relay.messages) == 1
    assert notification.email_error == ""


@pytest.mark.parametrize("step, answer", [
    ("RCPT", "550 5.1.1 <someone@example.com>: no such user here"),
    ("DATA", "554 5.5.1 no valid recipients"),
    ("END", "554 5.7.1 message refused as spam"),
])
def test_a_5xx_about_the_message_or_its_recipient_still_fails_it_for_good(owner, relay, step, answer):
    relay.answers[step] = [answer] * 3
    notification = _notify(owner, f"payout_sent:{step}")
    outcome = email_svc.notification_email_send(notification_id=notification.pk, after_attempts=0)
    notification.refresh_from_db()
    assert outcome.retry_in_s is None and not outcome.sent
    assert (notification.email_status, notification.email_attempts) == (EmailStatus.FAILED, 1)
    assert notification.email_error == f"The mail server refused it: {answer}"
    assert len(relay.answers[step]) == 2 and relay.messages == []


def test_a_setup_refusal_is_still_given_up_after_the_attempts_bound(owner, relay):
    relay.answers["GREETING"] = ["554 5.7.1 access denied"] * (email_svc.MAX_ATTEMPTS + 2)
    notification = _notify(owner, "payout_sent:bound")
    for attempt in range(email_svc.MAX_ATTEMPTS):
        outcome = email_svc.notification_email_send(notification_id=notification.pk, after_attempts=attempt)
        assert outcome.retry_in_s is not None or attempt == email_svc.MAX_ATTEMPTS - 1
    notification.refresh_from_db()
    assert notification.email_status == EmailStatus.FAILED
    assert notification.email_error.startswith(f"Given up after {email_svc.MAX_ATTEMPTS} attempts")
    assert relay.messages == []
