"""Round 53 review of notifications (hooks): a pause or a test event held up by a notice being written, the
resenders undoing a recorded backoff, and endpoint writes that resolve a name the user chose, unthrottled."""
import smtplib
import threading
from datetime import timedelta

import pytest
from django.core.mail import EmailMessage
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone
from rest_framework import throttling as drf_throttling

from core.addresses import LookupTooSlow
from notifications.models import (
    DeliveryStatus,
    EmailStatus,
    Kind,
    Notification,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
)
from notifications.services import email as email_svc
from notifications.services import urls as urls_svc
from notifications.services import webhooks
from notifications.services.notify import notify
from tests.factories import UserFactory

PASSWORD = "correct horse battery staple"  # tests.factories.UserFactory's

# What a user does to an endpoint while another app's transaction that told them something is still open.
ACTIONS = {
    "pause": lambda user, endpoint: webhooks.endpoint_update(endpoint=endpoint, active=False),
    "patch_description": lambda user, endpoint: webhooks.endpoint_update(endpoint=endpoint, description="x"),
    "test_button": lambda user, endpoint: webhooks.endpoint_test(endpoint=endpoint),
    "add_endpoint": lambda user, endpoint: webhooks.endpoint_create(user=user, url="http://127.0.0.1:10/hooks"),
}


@pytest.mark.parametrize("action", list(ACTIONS))
@pytest.mark.django_db(transaction=True)
def test_a_pause_or_test_event_is_not_held_up_by_a_notice_being_written(action):
    """notify() keeps the user's active endpoints FOR KEY SHARE until its caller commits; endpoint_update and
    endpoint_test locked the endpoint FOR UPDATE, which waits for that: Pause, PATCH and the test button hung until
    the other transaction committed (up to gunicorn's timeout, then a 502). Now FOR NO KEY UPDATE."""
    user = UserFactory()
    endpoint, _ = webhooks.endpoint_create(user=user, url="http://127.0.0.1:9/hooks")
    started, release = threading.Event(), threading.Event()

    def notifier():  # another app's transaction that told the user something, not committed yet
        try:
            with transaction.atomic():
                notify(user=user, kind=Kind.LOW_BALANCE, payload={"message": "low"}, dedupe_key="k-share")
                started.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=notifier)
    thread.start()
    assert started.wait(10)
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '1s'")
            ACTIONS[action](user, endpoint)
    finally:
        release.set()
        thread.join()


@pytest.mark.django_db(transaction=True)
def test_a_delete_still_waits_for_a_pause_in_progress():
    """NO KEY UPDATE still excludes endpoint_delete's FOR UPDATE: the endpoint stays until the pause commits."""
    user = UserFactory()
    endpoint, _ = webhooks.endpoint_create(user=user, url="http://127.0.0.1:9/hooks")
    locked, release = threading.Event(), threading.Event()

    def pauser():
        try:
            with transaction.atomic():
                webhooks.endpoint_update(endpoint=endpoint, active=False)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=pauser)
    thread.start()
    assert locked.wait(10)
    try:
        with pytest.raises(Exception, match="lock timeout"):
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL lock_timeout = '1s'")
                webhooks.endpoint_delete(endpoint=endpoint)
    finally:
        release.set()
        thread.join()


# ------------------------------------------------------------------ the resenders and a backoff recorded meanwhile


def _worker_takes_it_at_once(monkeypatch, run):
    """The queued task is run at once (a worker that takes it as soon as it is sent), before the resender goes on."""
    monkeypatch.setattr("core.dispatch.send", lambda name, *args, task_id=None: run(*args))


def test_webhook_resender_keeps_the_backoff_of_an_attempt_recorded_meanwhile(db, receiver, settings, monkeypatch):
    """deliveries_resend marked each row it queued "due now" after sending it, unconditionally: an attempt made and
    recorded in between (next_attempt_at = now + backoff) was overwritten, and the next run queued it again ~5 min
    later instead of after the backoff."""
    settings.NOTIFICATIONS_WEBHOOK_BACKOFF_S = 600
    receiver.answers = [500] * 10
    endpoint, _ = webhooks.endpoint_create(user=UserFactory(), url=receiver.url)
    delivery = webhooks.endpoint_test(endpoint=endpoint)  # its task is lost (on_commit does not run here)
    WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=timezone.now() - timedelta(minutes=10))
    _worker_takes_it_at_once(monkeypatch, lambda delivery_id, after: webhooks.webhook_attempt(
        delivery_id=delivery_id, after_attempts=after))
    assert webhooks.deliveries_resend() == 1
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.RETRYING and delivery.attempts == 1
    assert delivery.next_attempt_at > timezone.now() + timedelta(seconds=500)


@pytest.mark.parametrize("lost_claim", [False, True])
def test_webhook_resender_still_marks_what_it_queued_and_no_attempt_was_made_for(owner, monkeypatch, lost_claim):
    """The other side: a row left as it was listed (unclaimed, or its claim's worker lost) is marked queued, so the
    next run does not queue it again while it waits in a long queue."""
    endpoint, _ = webhooks.endpoint_create(user=owner, url="http://127.0.0.1:9/hooks")
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        next_attempt_at=timezone.now() - timedelta(minutes=10),
        claimed_at=timezone.now() - timedelta(minutes=10) if lost_claim else None)
    sent: list = []
    _worker_takes_it_at_once(monkeypatch, lambda *args: sent.append(args))
    assert webhooks.deliveries_resend() == 1 and sent == [(delivery.pk, 0)]
    assert webhooks.deliveries_resend() == 0


def test_webhook_resender_queues_the_longest_overdue_first(owner, monkeypatch):
    """It took [:500] in the model's order (newest first): after a broker outage the oldest waited longest."""
    endpoint, _ = webhooks.endpoint_create(user=owner, url="http://127.0.0.1:9/hooks")
    first, second, third = (webhooks.endpoint_test(endpoint=endpoint) for _ in range(3))
    now = timezone.now()
    for delivery, minutes in ((first, 20), (second, 60), (third, 40)):
        WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=now - timedelta(minutes=minutes))
    sent: list = []
    _worker_takes_it_at_once(monkeypatch, lambda *args: sent.append(args[0]))
    assert webhooks.deliveries_resend() == 3
    assert sent == [second.pk, third.pk, first.pk]


def test_email_resender_keeps_the_backoff_of_an_attempt_recorded_meanwhile(db, monkeypatch):
    n = notify(user=UserFactory(), kind=Kind.LOW_BALANCE, payload={"message": "low"}, dedupe_key="k1")
    Notification.objects.filter(pk=n.pk).update(email_next_at=timezone.now() - timedelta(minutes=10))

    def relay_went_away(*args, **kwargs):
        raise smtplib.SMTPServerDisconnected("relay went away")

    monkeypatch.setattr(EmailMessage, "send", relay_went_away)
    _worker_takes_it_at_once(monkeypatch, lambda notification_id, after: email_svc.notification_email_send(
        notification_id=notification_id, after_attempts=after))
    assert email_svc.emails_resend() == 1
    n.refresh_from_db()
    assert n.email_status == EmailStatus.PENDING and n.email_attempts == 1
    assert n.email_next_at > timezone.now() + timedelta(seconds=30)


# ------------------------------------------------------------------ endpoint writes: throttled, a shorter lookup

ENDPOINTS = "/api/v1/webhook-endpoints/"


@pytest.fixture
def endpoint_rate(monkeypatch):
    # DRF copies DEFAULT_THROTTLE_RATES into the class at import: override_settings cannot reach it.
    rates = {**drf_throttling.SimpleRateThrottle.THROTTLE_RATES, "webhook_endpoints": "3/min"}
    monkeypatch.setattr(drf_throttling.SimpleRateThrottle, "THROTTLE_RATES", rates)


def test_endpoint_writes_through_the_api_are_throttled_per_user(owner_api, other_api, receiver, endpoint_rate):
    """Adding or changing an endpoint resolves a host name the user chose inside the web request (up to the lookup's
    limit, a web worker held each time), and nothing limited how often: a 429 past the rate now, nothing changed,
    with Retry-After and a message saying so. Reading, the test button and deleting are not counted."""
    created = owner_api.post(ENDPOINTS, {"url": receiver.url}, format="json")
    assert created.status_code == 201, created.content
    pk = created.json()["id"]
    assert owner_api.patch(f"{ENDPOINTS}{pk}/", {"description": "a"}, format="json").status_code == 200
    assert owner_api.patch(f"{ENDPOINTS}{pk}/", {"active": False}, format="json").status_code == 200
    for _ in range(3):
        assert owner_api.get(ENDPOINTS).status_code == 200
        assert owner_api.post(f"{ENDPOINTS}{pk}/test/").status_code == 202
    refused = owner_api.post(ENDPOINTS, {"url": receiver.url}, format="json")
    assert refused.status_code == 429, refused.content
    assert refused.json()["detail"].startswith("Too many webhook endpoints added or changed for now: nothing was "
                                               "changed. Try again in ")
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert owner_api.patch(f"{ENDPOINTS}{pk}/", {"active": True}, format="json").status_code == 429
    assert WebhookEndpoint.objects.filter(user__isnull=False).count() == 1
    assert WebhookEndpoint.objects.get(pk=pk).active is False
    assert other_api.post(ENDPOINTS, {"url": receiver.url}, format="json").status_code == 201  # per user
    assert owner_api.delete(f"{ENDPOINTS}{pk}/").status_code == 204


def test_the_settings_pages_form_shares_the_apis_budget(owner, owner_api, receiver, endpoint_rate):
    for _ in range(3):
        assert owner_api.post(ENDPOINTS, {"url": receiver.url}, format="json").status_code == 201
    web = Client()
    web.force_login(owner)
    r = web.post("/account/notifications/settings/", {"url": receiver.url, "description": "page",
                                                      "password": PASSWORD, "request_token": "t53"})
    assert r.status_code == 429 and 1 <= int(r["Retry-After"]) <= 60
    assert b"Too many webhook endpoints added or changed for now" in r.content
    assert not WebhookEndpoint.objects.filter(description="page").exists()


def test_a_host_name_is_given_a_shorter_lookup_when_an_endpoint_is_saved(owner_api, settings, monkeypatch):
    """Saving looked the name up for NOTIFICATIONS_WEBHOOK_TIMEOUT_S (5 s), a web worker held that long each time;
    now SAVE_LOOKUP_S (2 s). An attempt still has its whole time limit for it (test_webhook_attempts)."""
    settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S = 5
    waited: list[float] = []

    def too_slow(host, port, timeout_s):
        waited.append(timeout_s)
        raise LookupTooSlow(host)

    monkeypatch.setattr(urls_svc, "getaddrinfo_within", too_slow)
    r = owner_api.post(ENDPOINTS, {"url": "https://slow.example/hooks"}, format="json")
    assert r.status_code == 400 and r.json()["url"] == ["Could not resolve slow.example within 2 s."], r.content
    assert waited == [2]
    with pytest.raises(Exception, match="within 5 s"):
        urls_svc.webhook_target("https://slow.example/hooks")


# ------------------------------------------------------------------ an endpoint failing for days is paused, once


def _failing_since(endpoint, days: float) -> None:
    """Failing for `days`, with one event short of the failed events a pause needs (DISABLE_MIN_FAILED_EVENTS)."""
    at = timezone.now() - timedelta(days=days)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(failing_since=at)
    for _ in range(webhooks.DISABLE_MIN_FAILED_EVENTS - 1):
        delivery = webhooks.endpoint_test(endpoint=endpoint)
        WebhookDelivery.objects.filter(pk=delivery.pk).update(status=DeliveryStatus.FAILED, attempts=1,
                                                              last_error="Answered 500", finished_at=at)
        WebhookAttempt.objects.create(delivery=delivery, number=1, status_code=500, error="Answered 500", at=at)


def test_an_endpoint_that_failed_every_attempt_for_days_is_paused_and_its_owner_told_once(owner, receiver,
                                                                                           settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    receiver.answers = [500] * 10
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    _failing_since(endpoint, 3.1)
    webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    endpoint.refresh_from_db()
    assert endpoint.active is False and endpoint.disabled_at is not None
    assert endpoint.disabled_reason.startswith("Paused by the platform: no attempt to deliver an event to it "
                                               "succeeded since ")
    told = Notification.objects.get(user=owner, kind=Kind.WEBHOOK_ENDPOINT_DISABLED)
    assert told.email_status == EmailStatus.PENDING and receiver.url in told.body
    assert told.title == f"Webhook endpoint {endpoint.pk} was paused: it failed for days"
    # Still failing (a test event goes to a paused endpoint): told once, not again.
    webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    assert Notification.objects.filter(user=owner, kind=Kind.WEBHOOK_ENDPOINT_DISABLED).count() == 1


def test_failing_for_less_than_the_days_keeps_it_active_and_a_delivered_attempt_starts_afresh(owner, receiver,
                                                                                              settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    receiver.answers = [500]
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    endpoint.refresh_from_db()
    assert endpoint.active and endpoint.failing_since is not None and endpoint.disabled_reason == ""
    first_failure = endpoint.failing_since
    _failing_since(endpoint, 2.9)
    receiver.answers = [500]
    webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    endpoint.refresh_from_db()
    assert endpoint.active and endpoint.failing_since < first_failure  # kept: the first failure counts
    webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)  # delivered (200)
    endpoint.refresh_from_db()
    assert endpoint.active and endpoint.failing_since is None
    assert not Notification.objects.filter(kind=Kind.WEBHOOK_ENDPOINT_DISABLED).exists()


def test_the_reason_is_shown_and_a_resume_clears_it(owner, owner_api, receiver, settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    receiver.answers = [500]
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    _failing_since(endpoint, 4)
    webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    shown = owner_api.get(f"{ENDPOINTS}{endpoint.pk}/").json()
    assert shown["active"] is False and shown["disabled_reason"].startswith("Paused by the platform")
    assert shown["disabled_at"] is not None
    web = Client()
    web.force_login(owner)
    page = web.get(f"/account/notifications/webhooks/{endpoint.pk}/")
    assert page.status_code == 200 and shown["disabled_reason"].encode() in page.content
    assert b"paused by the platform" in web.get("/account/notifications/settings/").content
    # Pausing again keeps the reason; resuming clears it, and its failing days start afresh.
    assert owner_api.patch(f"{ENDPOINTS}{endpoint.pk}/", {"active": False}, format="json").json()["disabled_reason"]
    resumed = owner_api.patch(f"{ENDPOINTS}{endpoint.pk}/", {"active": True}, format="json").json()
    assert resumed["active"] is True and resumed["disabled_reason"] == "" and resumed["disabled_at"] is None
    endpoint.refresh_from_db()
    assert endpoint.failing_since is None


def test_a_real_event_is_not_sent_to_an_endpoint_the_platform_paused(owner, receiver, settings, queued):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    receiver.answers = [500]
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    _failing_since(endpoint, 4)
    webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    posts = len(receiver.requests)
    notify(user=owner, kind=Kind.LOW_BALANCE, payload={"message": "low"}, dedupe_key="after-pause")
    assert not WebhookDelivery.objects.filter(endpoint=endpoint, kind=Kind.LOW_BALANCE).exists()
    assert len(receiver.requests) == posts


def test_operators_see_in_the_admin_that_and_why_the_platform_paused_an_endpoint(db):
    endpoint, _ = webhooks.endpoint_create(user=UserFactory(), url="http://127.0.0.1:9/hooks")
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        active=False, disabled_at=timezone.now(), failing_since=timezone.now() - timedelta(days=3),
        disabled_reason="Paused by the platform: no attempt succeeded for 3 days")
    operator = Client()
    operator.force_login(UserFactory(is_staff=True, is_superuser=True))
    page = operator.get(f"/admin/notifications/webhookendpoint/{endpoint.pk}/change/").content.decode()
    assert "no attempt succeeded for 3 days" in page and "Failing since" in page
