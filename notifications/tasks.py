"""Celery entry points of notifications: they take ids, re-read the rows and call a service."""
from celery import shared_task
from django.conf import settings

from notifications.services import email, webhooks
from notifications.services.notify import EMAIL_SEND, WEBHOOK_DELIVER

RESEND = "notifications.tasks.deliveries_resend"
EMAILS_RESEND = "notifications.tasks.emails_resend"


@shared_task(name=WEBHOOK_DELIVER, bind=True, max_retries=None, acks_late=True)
def webhook_deliver(self, delivery_id: int) -> str:
    """One attempt; a failed one is retried by Celery after the service's backoff (until it gives up)."""
    attempt = webhooks.webhook_attempt(delivery_id=delivery_id)
    if attempt is None:
        return "nothing to do"
    if attempt.retry_in_s is not None:
        raise self.retry(countdown=attempt.retry_in_s, max_retries=settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS)
    return f"attempt {attempt.number}: {attempt.status_code or attempt.error}"


@shared_task(name=EMAIL_SEND, bind=True, max_retries=None, acks_late=True)
def email_send(self, notification_id: int) -> bool:
    """One attempt; one that may go through later is retried after the service's backoff. The service counts
    the attempts and gives up (max_retries=None here: its count outlives a lost retry)."""
    outcome = email.notification_email_send(notification_id=notification_id)
    if outcome.retry_in_s is not None:
        raise self.retry(countdown=outcome.retry_in_s)
    return outcome.sent


@shared_task(name=RESEND)
def deliveries_resend() -> int:
    return webhooks.deliveries_resend()


@shared_task(name=EMAILS_RESEND)
def emails_resend() -> int:
    return email.emails_resend()
