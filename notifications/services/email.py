"""The e-mail channel: one message per notification, sent by the worker (Django's mail backend)."""
from django.conf import settings
from django.core.mail import send_mail
from django.utils import timezone

from notifications.models import Notification


def notification_email_send(*, notification_id: int) -> bool:
    """Send the notification's e-mail unless it was sent already; True when sent now. Raises what the mail
    backend raises (the task retries)."""
    notification = Notification.objects.select_related("user").filter(pk=notification_id).first()
    if notification is None or notification.emailed_at is not None or not notification.user.email:
        return False
    text = notification.body or notification.title
    footer = "\n\nChoose which events reach you, and how, on the notification settings page of your account."
    send_mail(f"[{settings.PLATFORM_NAME}] {notification.title}", text + footer, settings.DEFAULT_FROM_EMAIL,
              [notification.user.email])
    Notification.objects.filter(pk=notification.pk, emailed_at=None).update(emailed_at=timezone.now())
    return True
