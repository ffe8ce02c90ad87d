"""The e-mail channel: one message per notification, sent by the worker (Django's mail backend).

A notification the user gets an e-mail for is written `pending` (notify()). Sending is claim, then send: the row is
locked and moved to `sending` (the attempt counted, `email_claimed_at` set) in a transaction of its own, the message
goes out, and it is `sent`. Another task for the same notification meanwhile (a redelivered task, the resender)
finds it `sending` and sends nothing. A claim older than CLAIM_LOST_AFTER_S was lost with its worker: the resender
puts it back to `pending` and it is sent again. So the e-mail is sent at least once, and twice only when a worker is
lost between the mail server's acceptance and the `sent` mark (a short window; an e-mail lost for good would be
worse, and one sent cannot be taken back whichever rule is chosen).

Failures: the recipient or the message refused for good (a 5xx answer to RCPT TO for every recipient, or to DATA
or the message's end) is `failed` at once, recorded, not retried. Anything that may go through later (a 4xx, no
connection, and the platform's own SMTP set-up refused, even with a 5xx: the relay's greeting, HELO/EHLO, STARTTLS,
the log-in, the sender address) is `pending` again, retried by the task after BACKOFF_S × 2^(attempt−1) and, when
that retry is lost (the broker refused it, the worker was lost), by the resender. It is given up, `failed` with the
reason, after MAX_ATTEMPTS attempts or MAX_AGE after the event (an e-mail a day late tells nothing useful).
"""
import logging
import smtplib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from core import dispatch
from notifications.models import EmailStatus, Notification
from notifications.services.notify import EMAIL_SEND, channels_for
from notifications.services.retry import backoff_s, recordable
from notifications.services.unsubscribe import kind_label, unsubscribe_headers

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # with the backoff: about two hours of a mail server that does not answer
BACKOFF_S = 60
MAX_AGE = timedelta(hours=24)
CLAIM_LOST_AFTER_S = 600  # far beyond one message's SMTP conversation (EMAIL_TIMEOUT per step)
RESEND_OVERDUE_S = 300
RESEND_BATCH = 500



@dataclass(frozen=True)
class Outcome:
    sent: bool
    retry_in_s: float | None = None  # the task retries after this long
    attempts: int = 0  # the attempts made so far (what the retry's task is queued after)


def _give_up_reason(notification: Notification, now: datetime) -> str:
    if now - notification.created_at >= MAX_AGE:
        return f"Given up: not sent within {int(MAX_AGE.total_seconds() // 3600)} h."
    if notification.email_attempts >= MAX_ATTEMPTS:
        return f"Given up after {notification.email_attempts} attempts; the last: {notification.email_error}"
    return ""


def _claim(notification_id: int, after_attempts: int | None = None) -> Notification | None:
    """Claim the e-mail for sending (row locked; the attempt counted), or None when there is none to send: the
    notification is gone, sent, given up, not e-mailed, or being sent by another worker; or it is given up here
    (too late, too many attempts, no address, or the user's preference for its kind turned e-mail off since)."""
    now = timezone.now()
    with transaction.atomic():
        notification = (Notification.objects.select_for_update(of=("self",)).select_related("user")
                        .filter(pk=notification_id).first())
        if notification is None or notification.email_status != EmailStatus.PENDING:
            return None
        if after_attempts is not None and notification.email_attempts != after_attempts:
            return None  # a task queued before an attempt made since: a duplicate (webhooks._claim)
        reason = _give_up_reason(notification, now)
        if not notification.user.email:
            reason = "Not sent: the account has no e-mail address."
        elif not channels_for(user_id=notification.user_id, kind=notification.kind)[1]:
            # Chosen since the notice was written (a retry an hour later, a backlog): the choice now decides.
            reason = "Not sent: e-mail was turned off for these events since."
        if reason:
            _finish(notification, EmailStatus.FAILED, email_error=reason[:500])
            log.warning("notification %s: e-mail %s", notification.pk, reason)
            return None
        notification.email_attempts += 1
        notification.email_status = EmailStatus.SENDING
        notification.email_claimed_at = now
        notification.save(update_fields=["email_attempts", "email_status", "email_claimed_at"])
        return notification


def _finish(notification: Notification, target: str, **values: Any) -> int:
    """Move this claim's row to `target` (nothing when another worker has claimed it since, or it is gone: a user
    deleted meanwhile takes their notifications along)."""
    if "email_error" in values:  # it quotes the mail server's answer: a NUL in it failed the recording
        values["email_error"] = recordable(values["email_error"])
    rows = Notification.objects.filter(pk=notification.pk, email_claimed_at=notification.email_claimed_at)
    return Notification.transition_rows(rows, target, **values)


def notification_email_send(*, notification_id: int, after_attempts: int | None = None) -> Outcome:
    """Send the notification's e-mail if it is due to be sent; what the task does next. `after_attempts`: the
    attempts made when the task was queued; another count means it is a duplicate (_claim)."""
    notification = _claim(notification_id, after_attempts)
    if notification is None:
        return Outcome(False)
    text = notification.body or notification.title
    footer = "\n\nChoose which events reach you, and how, on the notification settings page of your account."
    # A kind the user may turn off carries the one-click unsubscribe headers (services/unsubscribe.py), its URL also
    # in the footer; the always-on kinds (an account's deactivation, reactivation) carry none.
    headers = unsubscribe_headers(user=notification.user, kind=notification.kind)
    if headers:
        footer += (f"\nTo stop e-mails of this kind (\"{kind_label(notification.kind)}\"), open "
                   f"{headers['List-Unsubscribe'][1:-1]}")
    try:
        EmailMessage(f"[{settings.PLATFORM_NAME}] {notification.title}", text + footer, settings.DEFAULT_FROM_EMAIL,
                     [notification.user.email], headers=headers).send()
    except Exception as exc:  # noqa: BLE001 (recorded; whatever it is, the claim must not be left behind)
        return _failed(notification, exc)
    # Sent, even if the claim was taken over meanwhile (its worker thought lost): what was sent is sent.
    Notification.transition_rows(Notification.objects.filter(pk=notification.pk), EmailStatus.SENT,
                                 emailed_at=timezone.now(), email_claimed_at=None, email_next_at=None, email_error="")
    return Outcome(True)


def _failed(notification: Notification, exc: Exception) -> Outcome:
    error = _describe(exc)[:500]
    if not isinstance(exc, OSError):  # smtplib's errors and the network's are OSErrors; anything else is a bug
        log.error("notification %s: the e-mail failed unexpectedly", notification.pk, exc_info=exc)
    if _for_good(exc):
        _finish(notification, EmailStatus.FAILED, email_error=error, email_claimed_at=None, email_next_at=None)
        log.warning("notification %s: e-mail refused for good: %s", notification.pk, error)
        return Outcome(False)
    notification.email_error = error
    reason = _give_up_reason(notification, timezone.now())
    if reason:
        _finish(notification, EmailStatus.FAILED, email_error=reason[:500], email_claimed_at=None,
                email_next_at=None)
        log.warning("notification %s: e-mail %s", notification.pk, reason)
        return Outcome(False)
    retry_in = backoff_s(notification.email_attempts, base_s=BACKOFF_S)
    _finish(notification, EmailStatus.PENDING, email_error=error, email_claimed_at=None,
            email_next_at=timezone.now() + timedelta(seconds=retry_in))
    return Outcome(False, retry_in, notification.email_attempts)


def _for_good(exc: Exception) -> bool:
    """The message or its recipient refused with a 5xx answer (or an error that retrying cannot change).

    Only the answers about this message are: RCPT TO (every recipient refused, SMTPRecipientsRefused) and DATA or
    the message's end (SMTPDataError). Every other SMTP answer, 5xx or not, is about the platform's own set-up and
    retried (an operator fixes it): the relay's greeting (SMTPConnectError: the platform's address blocklisted, not
    on the relay's access list), HELO/EHLO (SMTPHeloError), STARTTLS (a bare SMTPResponseException: the relay's
    certificate missing), the log-in (SMTPAuthenticationError), MAIL FROM (SMTPSenderRefused). Before, all but the
    last three were judged by their code, and a 5xx greeting or STARTTLS answer failed every e-mail for good."""
    if not isinstance(exc, OSError):
        return True  # e.g. a header Django refuses: the same message fails the same way again
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        codes = [code for code, _ in exc.recipients.values()]
        return bool(codes) and all(500 <= code < 600 for code in codes)
    if isinstance(exc, smtplib.SMTPDataError):
        return 500 <= exc.smtp_code < 600
    return False


def _answer(code: int, message: bytes | str) -> str:
    text = message.decode(errors="replace") if isinstance(message, bytes) else message
    return f"{code} {text}".strip()


def _describe(exc: Exception) -> str:
    if isinstance(exc, smtplib.SMTPRecipientsRefused) and exc.recipients:
        code, message = next(iter(exc.recipients.values()))
        return f"The mail server refused it: {_answer(code, message)}"
    if isinstance(exc, smtplib.SMTPResponseException):
        return f"The mail server refused it: {_answer(exc.smtp_code, exc.smtp_error)}"
    if isinstance(exc, smtplib.SMTPException):
        return f"The mail server failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):
        return f"Could not connect: {type(exc).__name__}: {exc}"
    return f"Not sent: {type(exc).__name__}: {exc}"


def emails_resend(*, overdue_s: int = RESEND_OVERDUE_S) -> int:
    """Queue again the e-mails still to send whose time is `overdue_s` past (the broker refused their task, or
    their retry was lost), first putting back to `pending` those whose claim is older than CLAIM_LOST_AFTER_S
    (their worker was lost before it sent or recorded it): the number queued. Their task gives up the ones past
    MAX_AGE or MAX_ATTEMPTS, recorded, without sending."""
    now = timezone.now()
    lost = Notification.objects.filter(email_status=EmailStatus.SENDING,
                                       email_claimed_at__lt=now - timedelta(seconds=CLAIM_LOST_AFTER_S))
    # Due since the claim (long overdue), so queued below; the lost attempt stays counted.
    Notification.transition_rows(lost, EmailStatus.PENDING, email_next_at=F("email_claimed_at"),
                                 email_claimed_at=None, email_error="The worker sending it was lost.")
    due = now - timedelta(seconds=overdue_s)
    rows = list(Notification.objects.filter(email_status=EmailStatus.PENDING, email_next_at__lt=due)
                .order_by("email_next_at").values_list("pk", "email_attempts")[:RESEND_BATCH])
    for notification_id, attempts in rows:
        try:
            dispatch.send(EMAIL_SEND, notification_id, attempts)
        except Exception as exc:  # noqa: BLE001 (kombu's many errors: the beat tries again)
            log.warning("the e-mail of notification %s could not be queued (%s)", notification_id, exc)
            break
        # Not queued again for another `overdue_s`: a long queue only waits. Only a row as it was when listed (the
        # same attempts): an attempt recorded meanwhile set its backoff, which this undid (found by review).
        Notification.objects.filter(pk=notification_id, email_status=EmailStatus.PENDING,
                                    email_attempts=attempts).update(email_next_at=timezone.now())
    return len(rows)
