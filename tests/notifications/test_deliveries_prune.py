"""The webhook delivery log is kept NOTIFICATIONS_WEBHOOK_LOG_DAYS after a delivery finished: the daily beat job
deletes older finished deliveries with their attempts, in batches, and never one still being tried. Before, nothing
deleted them but deleting the endpoint: every event to every endpoint stayed for good."""
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from notifications.models import DeliveryStatus, Kind, WebhookAttempt, WebhookDelivery
from notifications.services import retention, webhooks
from notifications.tasks import PRUNE

pytestmark = pytest.mark.django_db


def _delivery(endpoint, status: str, *, finished_days_ago: float | None, attempts: int = 1) -> WebhookDelivery:
    now = timezone.now()
    finished = None if finished_days_ago is None else now - timedelta(days=finished_days_ago)
    delivery = WebhookDelivery.objects.create(
        endpoint=endpoint, kind=Kind.TEST, body="{}", status=status, attempts=attempts,
        created_at=now - timedelta(days=(finished_days_ago or 0) + 1), finished_at=finished)
    for number in range(1, attempts + 1):
        WebhookAttempt.objects.create(delivery=delivery, number=number, status_code=500)
    return delivery


def test_finished_deliveries_past_the_log_days_go_with_their_attempts_and_the_rest_stay(owner, other_api, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    theirs, _ = webhooks.endpoint_create(user=other_api.user, url=receiver.url)
    days = settings.NOTIFICATIONS_WEBHOOK_LOG_DAYS
    old_ok = _delivery(endpoint, DeliveryStatus.SUCCEEDED, finished_days_ago=days + 1)
    old_failed = _delivery(theirs, DeliveryStatus.FAILED, finished_days_ago=days + 5, attempts=3)
    recent = _delivery(endpoint, DeliveryStatus.SUCCEEDED, finished_days_ago=days - 1)
    # Still being tried however old: created long ago, next attempt due (its retries were lost).
    trying = _delivery(endpoint, DeliveryStatus.RETRYING, finished_days_ago=None, attempts=2)
    WebhookDelivery.objects.filter(pk=trying.pk).update(created_at=timezone.now() - timedelta(days=days * 3))

    assert retention.deliveries_prune() == 2

    assert set(WebhookDelivery.objects.values_list("pk", flat=True)) == {recent.pk, trying.pk}
    assert not WebhookAttempt.objects.filter(delivery_id__in=[old_ok.pk, old_failed.pk]).exists()
    assert WebhookAttempt.objects.filter(delivery_id=trying.pk).count() == 2
    assert retention.deliveries_prune() == 0  # nothing left to do


def test_the_prune_goes_in_batches_until_nothing_old_is_left(owner, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    for _ in range(7):
        _delivery(endpoint, DeliveryStatus.SUCCEEDED, finished_days_ago=40)
    assert retention.deliveries_prune(batch=3) == 7
    assert not WebhookDelivery.objects.exists() and not WebhookAttempt.objects.exists()
    for _ in range(5):
        _delivery(endpoint, DeliveryStatus.FAILED, finished_days_ago=40)
    assert retention.deliveries_prune(batch=2, max_batches=2) == 4  # a run's bound: the next run takes the rest
    assert retention.deliveries_prune(batch=2) == 1


def test_the_beat_runs_the_prune_daily():
    entry = next(e for e in settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == PRUNE)
    assert entry["schedule"].is_due(timezone.now() - timedelta(days=1, minutes=1))[0]
