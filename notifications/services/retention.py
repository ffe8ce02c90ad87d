"""How long a webhook endpoint's delivery log is kept.

Every event to every endpoint is a `WebhookDelivery` with a `WebhookAttempt` per POST: an account with a few
endpoints and a busy fleet writes thousands a day, and nothing else ever deletes them (only deleting the endpoint
does). A finished delivery (delivered or given up) is kept for NOTIFICATIONS_WEBHOOK_LOG_DAYS after it finished,
long enough for a user to read why an event did not arrive (Stripe keeps its own webhook log 30 days); one still
being tried is never deleted.

Deleted in batches by a daily beat job: a batch's deliveries are picked under FOR UPDATE SKIP LOCKED (an endpoint's
DELETE holding them takes them itself), their attempts deleted and then them, one transaction per batch, so no
statement holds many rows' locks for long and a list of ids never grows past the batch.
"""
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from notifications.models import DeliveryStatus, WebhookAttempt, WebhookDelivery

PRUNE_BATCH = 5000


def deliveries_prune(*, keep_days: int | None = None, batch: int = PRUNE_BATCH, max_batches: int = 200) -> int:
    """Delete the deliveries finished more than `keep_days` ago (NOTIFICATIONS_WEBHOOK_LOG_DAYS by default) with
    their attempts: the number of deliveries deleted. At most `max_batches` batches a run (a million rows by
    default); the next day's run goes on with what is left."""
    days = settings.NOTIFICATIONS_WEBHOOK_LOG_DAYS if keep_days is None else keep_days
    before = timezone.now() - timedelta(days=days)
    old = WebhookDelivery.objects.filter(status__in=[DeliveryStatus.SUCCEEDED, DeliveryStatus.FAILED],
                                         finished_at__lt=before)
    deleted = 0
    for _ in range(max_batches):
        with transaction.atomic():
            ids = list(old.order_by().select_for_update(skip_locked=True).values_list("pk", flat=True)[:batch])
            if not ids:
                break
            attempts = WebhookAttempt.objects.filter(delivery_id__in=ids)
            attempts._raw_delete(attempts.db)  # no collector: nothing listens to their deletion
            rows = WebhookDelivery.objects.filter(pk__in=ids)
            deleted += rows._raw_delete(rows.db)
        if len(ids) < batch:
            break
    return deleted
