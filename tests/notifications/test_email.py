"""The e-mail channel (found by review): an e-mail whose queueing the broker refused, or whose retries were lost, is
sent by the beat's resender; a permanent refusal (5xx) is recorded, not retried; a transient one is retried within
bounds and then given up, recorded; the e-mail is claimed before it is sent, so two tasks never both send it.

Django's SMTP backend talks to a real SMTP server on 127.0.0.1 (tests/notifications/mailserver.py) where the
server's answers matter; elsewhere the locmem outbox."""
from datetime import timedelta

import pytest
from celery import current_app
from django.core import mail
from django.core.mail.backends import locmem

from config.celery import TASK_ROUTES
from notifications.models import EmailStatus, Kind, Notification
from notifications.services import email as email_svc
from notifications.services import notify as notify_svc
from tests.notifications.mailserver import MailServer

from .conftest import run_queued

pytestmark = pytest.mark.django_db

EMAIL_SEND = "notifications.tasks.email_send"
EMAILS_RESEND = "notifications.tasks.emails_resend"


@pytest.fixture
def smtp(settings):
    server = MailServer()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", server.port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    settings.EMAIL_TIMEOUT = 5
    yield server
    server.stop()


def _notify(user, key="payout_sent:4") -> Notification:
    notification = notify_svc.notify(user=user, kind=Kind.PAYOUT_SENT, dedupe_key=key,
                                     payload={"payout": 4, "amount": "12.50", "message": "Sent to you."})
    assert notification is not None
    return notification


def _send_task(notification_id: int) -> None:
    """The task as the worker runs it (Celery's apply: a retry runs at once, in this process)."""
    current_app.tasks[EMAIL_SEND].apply(args=(notification_id,))


def _minutes_later(notification: Notification, minutes: float) -> None:
    """As if `minutes` had passed since the notification was written (and since it was last due or claimed)."""
    back = timedelta(minutes=minutes)
    n = Notification.objects.get(pk=notification.pk)
    Notification.objects.filter(pk=n.pk).update(
        created_at=n.created_at - back, email_next_at=n.email_next_at and n.email_next_at - back,
        email_claimed_at=n.email_claimed_at and n.email_claimed_at - back)


def test_an_email_the_broker_refused_at_commit_is_sent_by_the_beats_resender(owner, monkeypatch,
                                                                             django_capture_on_commit_callbacks):
    """enqueue_on_commit logged "it is picked up again later", and only webhook deliveries were: the e-mail was
    never sent."""
    def refused(name, *args, task_id=None):
        raise ConnectionError("broker down")

    monkeypatch.setattr("core.dispatch.send", refused)
    with django_capture_on_commit_callbacks(execute=True):
        notification = _notify(owner)
    assert mail.outbox == []
    queued: list = []
    monkeypatch.setattr("core.dispatch.send", lambda name, *args, task_id=None: queued.append((name, args)))
    current_app.tasks[EMAILS_RESEND].apply()  # the broker is back, not five minutes late yet: not yet
    assert queued == []
    _minutes_later(notification, 10)
    current_app.tasks[EMAILS_RESEND].apply()
    assert queued == [(EMAIL_SEND, (notification.pk, 0))]
    run_queued(queued)
    assert len(mail.outbox) == 1 and mail.outbox[0].to == [owner.email]
    notification.refresh_from_db()
    assert notification.email_status == EmailStatus.SENT and notification.emailed_at is not None
    _minutes_later(notification, 10)
    current_app.tasks[EMAILS_RESEND].apply()
    assert queued == [] and len(mail.outbox) == 1


def test_the_beat_runs_the_email_resender_every_minute_on_the_fleet_queue(settings):
    entries = [e for e in settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == EMAILS_RESEND]
    assert len(entries) == 1 and entries[0]["schedule"] <= 60
    assert TASK_ROUTES[EMAILS_RESEND] == {"queue": "fleet"}


def test_only_an_email_the_user_gets_is_pending(owner, queued):
    notify_svc.preference_set(user=owner, kind=Kind.CREDIT_POSTED, in_app=True, email=False, webhook=True)
    wanted = _notify(owner)
    unwanted = notify_svc.notify(user=owner, kind=Kind.CREDIT_POSTED, payload={"amount": "1"}, dedupe_key="c:1")
    from tests.factories import user_without_address

    no_address = _notify(user_without_address())
    statuses = dict(Notification.objects.values_list("pk", "email_status"))
    assert statuses == {wanted.pk: "pending", unwanted.pk: "none", no_address.pk: "none"}
    for notification in (wanted, unwanted, no_address):
        _minutes_later(notification, 10)
    assert email_svc.emails_resend() == 1 and queued == [(EMAIL_SEND, (wanted.pk, 0))]


@pytest.mark.parametrize("where, answer", [
    ("rcpt_answers", "550 5.1.1 <someone@example.com>: no such user here"),
    ("data_answers", "554 5.7.1 message refused"),
])
def test_a_permanent_refusal_is_recorded_and_not_retried(owner, smtp, queued, where, answer):
    """Before, a 5xx was retried five times like a server that is down."""
    getattr(smtp, where).extend([answer] * 10)
    notification = _notify(owner)
    _send_task(notification.pk)
    assert len(getattr(smtp, where)) == 9, "the refusal was tried again"
    notification.refresh_from_db()
    assert (notification.email_status, notification.email_attempts) == (EmailStatus.FAILED, 1)
    assert notification.email_error == f"The mail server refused it: {answer}"
    _minutes_later(notification, 60)
    assert email_svc.emails_resend() == 0 and queued == [] and smtp.messages == []


def test_a_temporary_refusal_is_retried_and_sent(owner, smtp):
    smtp.rcpt_answers.append("451 4.7.1 greylisted, try again later")
    notification = _notify(owner)
    _send_task(notification.pk)
    assert [to for to, _ in smtp.messages] == [[owner.email]]
    notification.refresh_from_db()
    assert (notification.email_status, notification.email_attempts) == (EmailStatus.SENT, 2)
    assert notification.emailed_at is not None and notification.email_error == ""


def test_an_smtp_outage_is_retried_a_bounded_number_of_times_then_given_up_and_recorded(owner, smtp, queued):
    smtp.stop()  # nothing listens on its port any more: the connection is refused
    notification = _notify(owner)
    _send_task(notification.pk)
    notification.refresh_from_db()
    assert notification.email_status == EmailStatus.FAILED
    assert notification.email_attempts == email_svc.MAX_ATTEMPTS
    assert notification.email_error.startswith(f"Given up after {email_svc.MAX_ATTEMPTS} attempts; the last: "
                                               "Could not connect: ConnectionRefusedError")
    _minutes_later(notification, 60)
    assert email_svc.emails_resend() == 0 and queued == []


def test_an_email_not_sent_within_its_age_is_given_up_unsent(owner, queued):
    """A retry lost over a long outage: the resender finds it, and it is given up rather than sent a day late."""
    notification = _notify(owner)
    _minutes_later(notification, 25 * 60)
    assert email_svc.emails_resend() == 1
    run_queued(queued)
    notification.refresh_from_db()
    assert mail.outbox == [] and notification.email_status == EmailStatus.FAILED
    assert notification.email_error == "Given up: not sent within 24 h."


class SentAgainWhileSending(locmem.EmailBackend):
    """While the message is handed to the server, the same task arrives again (redelivered after a lost
    acknowledgement, or queued by the resender)."""

    notification_id = 0

    def send_messages(self, messages):
        if SentAgainWhileSending.notification_id:
            again, SentAgainWhileSending.notification_id = SentAgainWhileSending.notification_id, 0
            _send_task(again)
        return super().send_messages(messages)


def test_the_email_is_claimed_before_it_is_sent_so_a_second_task_sends_nothing(owner, settings):
    """Before, the task sent and then set emailed_at: a second task meanwhile (or after a worker lost in between)
    sent it again."""
    settings.EMAIL_BACKEND = f"{__name__}.SentAgainWhileSending"
    notification = _notify(owner)
    SentAgainWhileSending.notification_id = notification.pk
    _send_task(notification.pk)
    assert SentAgainWhileSending.notification_id == 0  # the second task ran
    assert len(mail.outbox) == 1
    notification.refresh_from_db()
    assert (notification.email_status, notification.email_attempts) == (EmailStatus.SENT, 1)


def test_a_claim_lost_with_its_worker_is_sent_again_after_its_bound(owner, queued):
    notification = _notify(owner)
    claimed = email_svc._claim(notification.pk)  # a worker claims it and is lost before it sends
    assert claimed is not None
    _minutes_later(notification, 1)
    assert email_svc.emails_resend() == 0 and queued == []  # still being sent, as far as anyone knows
    _minutes_later(notification, email_svc.CLAIM_LOST_AFTER_S / 60)
    assert email_svc.emails_resend() == 1
    run_queued(queued)
    notification.refresh_from_db()
    assert len(mail.outbox) == 1
    assert (notification.email_status, notification.email_attempts) == (EmailStatus.SENT, 2)


class UserDeletedWhileSending(locmem.EmailBackend):
    def send_messages(self, messages):
        Notification.objects.get(pk=UserDeletedWhileSending.notification_id).user.delete()
        return super().send_messages(messages)


def test_a_user_deleted_while_their_email_is_sent_ends_the_task_quietly(owner, settings):
    settings.EMAIL_BACKEND = f"{__name__}.UserDeletedWhileSending"
    notification = _notify(owner)
    UserDeletedWhileSending.notification_id = notification.pk
    result = current_app.tasks[EMAIL_SEND].apply(args=(notification.pk,))
    assert result.successful(), result.traceback
    assert len(mail.outbox) == 1 and not Notification.objects.filter(pk=notification.pk).exists()


def test_a_duplicate_task_after_a_failed_attempt_sends_nothing_and_spends_no_attempt(owner, smtp):
    """A duplicate of the e-mail's task (the resender's during a queue backlog, a redelivered message) coming after a
    failed attempt sent again at once and started a second retry chain: the attempts were spent twice as fast and
    the mail server never got the backoff (found by review). Counted, not timed (webhooks._claim)."""
    smtp.rcpt_answers.append("451 4.7.1 greylisted, try again later")
    notification = _notify(owner)
    first = email_svc.notification_email_send(notification_id=notification.pk, after_attempts=0)
    assert (first.retry_in_s, first.attempts) == (email_svc.BACKOFF_S, 1)
    duplicate = email_svc.notification_email_send(notification_id=notification.pk, after_attempts=0)
    notification.refresh_from_db()
    assert duplicate == email_svc.Outcome(False) and notification.email_attempts == 1 and smtp.messages == []
    assert email_svc.notification_email_send(notification_id=notification.pk, after_attempts=1).sent  # the retry
    notification.refresh_from_db()
    assert (notification.email_status, notification.email_attempts) == (EmailStatus.SENT, 2)
    assert [to for to, _ in smtp.messages] == [[owner.email]]


def test_the_task_retries_with_the_attempts_made(owner, smtp, monkeypatch):
    """What the retry's task carries: the attempts made when it was queued (Celery's apply runs it at once)."""
    smtp.rcpt_answers.extend(["451 4.7.1 greylisted, try again later"] * 2)
    notification = _notify(owner)
    calls = []
    real = email_svc.notification_email_send
    monkeypatch.setattr(email_svc, "notification_email_send",
                        lambda **kw: calls.append(kw["after_attempts"]) or real(**kw))
    current_app.tasks[EMAIL_SEND].apply(args=(notification.pk, 0))
    assert calls == [0, 1, 2] and Notification.objects.get(pk=notification.pk).email_status == EmailStatus.SENT
