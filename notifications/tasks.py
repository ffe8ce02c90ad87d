"""Celery entry points of notifications: they take ids, re-read the rows and call a service."""
from celery import shared_task
from django.conf import settings

from notifications.services import email, retention, webhooks
from notifications.services.notify import EMAIL_SEND, WEBHOOK_DELIVER

RESEND = "notifications.tasks.deliveries_resend"
EMAILS_RESEND = "notifications.tasks.emails_resend"
PRUNE = "notifications.tasks.deliveries_prune"


@shared_task(name=WEBHOOK_DELIVER, bind=True, max_retries=None, acks_late=True)
def webhook_deliver(self, delivery_id: int, after_attempts: int | None = None) -> str:
    """One attempt; a failed one is retried by Celery after the service's backoff (until it gives up).
    `after_attempts`: how many attempts were made when this task was queued (None: a message from before it was
    passed); a task for a point passed already is a duplicate and sends nothing (webhooks._claim)."""
    attempt = webhooks.webhook_attempt(delivery_id=delivery_id, after_attempts=after_attempts)
    if attempt is None:
        return "nothing to do"
    if attempt.retry_in_s is not None:
        raise self.retry(args=(delivery_id, attempt.number), countdown=attempt.retry_in_s,
                         max_retries=settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS)
    return f"attempt {attempt.number}: {attempt.status_code or attempt.error}"


@shared_task(name=EMAIL_SEND, bind=True, max_retries=None, acks_late=True)
def email_send(self, notification_id: int, after_attempts: int | None = None) -> bool:
    """One attempt; one that may go through later is retried after the service's backoff. The service counts
    the attempts and gives up (max_retries=None here: its count outlives a lost retry). `after_attempts` as for
    webhook_deliver."""
    outcome = email.notification_email_send(notification_id=notification_id, after_attempts=after_attempts)
    if outcome.retry_in_s is not None:
        raise self.retry(args=(notification_id, outcome.attempts), countdown=outcome.retry_in_s)
    return outcome.sent


@shared_task(name=RESEND)
def deliveries_resend() -> int:
    return webhooks.deliveries_resend()


@shared_task(name=EMAILS_RESEND)
def emails_resend() -> int:
    return email.emails_resend()


@shared_task(name=PRUNE)
def deliveries_prune() -> int:
    return retention.deliveries_prune()
