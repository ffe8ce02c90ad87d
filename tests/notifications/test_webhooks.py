"""Signed outgoing webhooks: a real local HTTP server receives them; the signature verifies with the secret shown
once; a 500 is retried with backoff; every attempt is logged; bad URLs are refused naming the field."""
import json
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from billing.services.ledger import credit_grant
from notifications.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint, WebhookTestEvent
from notifications.services import webhooks
from notifications.services.signing import SIGNATURE_HEADER, signature_header, signature_verify
from tests.live import wait_until

from .conftest import run_queued


def _endpoint(api, url):
    r = api.post("/api/v1/webhook-endpoints/", {"url": url, "description": "ci"}, format="json")
    assert r.status_code == 201, r.content
    return r.json()


def test_signature_verifies_only_the_same_body_secret_and_a_fresh_time():
    body = b'{"a":1}'
    header = signature_header(secret="whsec_x", body=body, timestamp=1_700_000_000)
    assert signature_verify(secret="whsec_x", header=header, body=body, now=1_700_000_010)
    assert not signature_verify(secret="whsec_y", header=header, body=body, now=1_700_000_010)
    assert not signature_verify(secret="whsec_x", header=header, body=b'{"a":2}', now=1_700_000_010)
    assert not signature_verify(secret="whsec_x", header=header, body=body, now=1_700_000_000 + 301)
    assert not signature_verify(secret="whsec_x", header="t=abc,v1=00", body=body)


@pytest.mark.django_db
def test_secret_is_shown_once_and_stored_encrypted(owner_api, receiver):
    created = _endpoint(owner_api, receiver.url)
    secret = created["secret"]
    assert secret.startswith("whsec_") and len(secret) > 30
    endpoint = WebhookEndpoint.objects.get(pk=created["id"])
    assert secret.encode() not in bytes(endpoint.secret_encrypted)
    with connection.cursor() as cursor:
        cursor.execute("SELECT secret_encrypted FROM notifications_webhookendpoint WHERE id = %s", [endpoint.pk])
        assert secret.encode() not in bytes(cursor.fetchone()[0])
    assert webhooks.endpoint_secret(endpoint=endpoint) == secret
    for r in (owner_api.get("/api/v1/webhook-endpoints/"), owner_api.get(f"/api/v1/webhook-endpoints/{endpoint.pk}/")):
        assert r.status_code == 200 and secret not in r.content.decode() and "secret_hint" in r.content.decode()


@pytest.mark.django_db
def test_a_test_event_arrives_signed_and_a_500_is_retried_as_the_worker_would(owner_api, receiver, queued,
                                                                               django_capture_on_commit_callbacks):
    created = _endpoint(owner_api, receiver.url)
    receiver.answers = [500]
    with django_capture_on_commit_callbacks(execute=True):
        r = owner_api.post(f"/api/v1/webhook-endpoints/{created['id']}/test/")
    assert r.status_code == 202 and r.json()["status"] == "pending" and r.json()["endpoint"] == created["id"]
    run_queued(queued)
    assert len(receiver.requests) == 2
    first, second = receiver.requests
    assert first["body"] == second["body"]  # the same event, re-signed
    for request in receiver.requests:
        assert signature_verify(secret=created["secret"], header=request["headers"][SIGNATURE_HEADER],
                                body=request["body"])
        assert request["headers"]["Content-Type"] == "application/json"
    event = json.loads(first["body"])
    assert event["type"] == "test" and event["data"] == {"endpoint": created["id"]}
    delivery = owner_api.get(f"/api/v1/webhook-deliveries/{r.json()['delivery']}/").json()
    assert delivery["status"] == "succeeded" and delivery["attempts"] == 2 and delivery["event_id"] == event["id"]
    assert [(a["number"], a["status_code"]) for a in delivery["attempt_log"]] == [(1, 500), (2, 200)]
    assert "500" in delivery["attempt_log"][0]["error"] and delivery["attempt_log"][1]["error"] == ""


@pytest.mark.django_db
def test_a_delivery_gives_up_after_the_last_attempt_with_backoff_between(owner, receiver, settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 3
    settings.NOTIFICATIONS_WEBHOOK_BACKOFF_S = 30
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    receiver.answers = [503, 503, 503]
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    first = webhooks.webhook_attempt(delivery_id=delivery.pk)
    second = webhooks.webhook_attempt(delivery_id=delivery.pk)
    third = webhooks.webhook_attempt(delivery_id=delivery.pk)
    assert (first.retry_in_s, second.retry_in_s, third.retry_in_s) == (30, 60, None)
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.FAILED and delivery.attempts == 3 and delivery.last_status_code == 503
    assert webhooks.webhook_attempt(delivery_id=delivery.pk) is None  # over: not tried again
    assert len(receiver.requests) == 3


@pytest.mark.django_db
def test_an_unreachable_endpoint_is_logged_with_the_error(owner, settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    endpoint, _ = webhooks.endpoint_create(user=owner, url="http://127.0.0.1:9/closed")
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    webhooks.webhook_attempt(delivery_id=delivery.pk)
    delivery.refresh_from_db()
    attempt = delivery.attempt_log.get()
    assert delivery.status == "failed" and attempt.status_code is None and "Could not connect" in attempt.error


def test_a_real_event_reaches_the_endpoint_through_the_worker_and_a_500_is_retried(worker, receiver):
    from tests.factories import UserFactory

    user = UserFactory()
    endpoint, secret = webhooks.endpoint_create(user=user, url=receiver.url)
    receiver.answers = [500]
    credit_grant(user=user, amount_micros=7_000_000, reason="internal: goodwill after ticket 123",
                 customer_note="Sorry for the trouble.")
    wait_until(lambda: len(receiver.requests) >= 2, 30, what="the retried webhook")
    delivery = wait_until(lambda: WebhookDelivery.objects.filter(endpoint=endpoint, status="succeeded").first(), 10,
                          what="the delivery to succeed")
    assert delivery.attempts == 2
    assert list(delivery.attempt_log.values_list("status_code", flat=True)) == [500, 200]
    for request in receiver.requests:
        assert signature_verify(secret=secret, header=request["headers"][SIGNATURE_HEADER], body=request["body"])
    event = json.loads(receiver.requests[-1]["body"])
    assert event["type"] == "credit_posted" and event["data"]["amount"] == "7.000000"
    assert "Sorry for the trouble." in event["message"] and "ticket 123" not in receiver.requests[-1]["body"].decode()
    assert receiver.requests[0]["body"] == receiver.requests[1]["body"]


@pytest.mark.django_db
@pytest.mark.parametrize("url, says", [
    ("ftp://example.com/x", "https"),
    ("http://8.8.8.8/hook", "https"),
    ("https://10.1.2.3/hook", "Not a public address"),
    ("https://192.168.0.10/hook", "private"),
    ("https://169.254.169.254/latest/meta-data", "private"),
    ("https://[fd00::1]/hook", "private"),
    # IPv6 forms carrying a private IPv4, which a NAT64 gateway or a 6to4 relay delivers to it (core/addresses.py)
    ("https://[64:ff9b::a9fe:a9fe]/latest/meta-data/", "private"),
    ("https://[64:ff9b::a00:1]:8080/hook", "private"),
    ("https://[2002:a00:1::1]/hook", "private"),
    ("https://[::a00:1]/hook", "private"),
    ("https://[::ffff:0:7f00:1]/hook", "private"),
    ("https://[64:ff9b:1::a00:1]/hook", "private"),
    ("https://user:pw@8.8.8.8/hook", "password"),
    ("https://8.8.8.8:99999/hook", "port"),
    ("https://no-such-host.invalid/hook", "does not resolve"),
    ("not a url", "https"),
    ("", "blank"),
])
def test_bad_urls_are_a_400_naming_the_field(owner_api, url, says):
    r = owner_api.post("/api/v1/webhook-endpoints/", {"url": url}, format="json")
    assert r.status_code == 400 and list(r.json()) == ["url"] and says in r.json()["url"][0], r.json()
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.django_db
def test_loopback_is_refused_unless_the_setting_allows_it(owner_api, settings):
    settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = False
    for url in ("http://127.0.0.1:8000/hook", "https://127.0.0.1/hook", "https://localhost/hook"):
        r = owner_api.post("/api/v1/webhook-endpoints/", {"url": url}, format="json")
        assert r.status_code == 400 and "url" in r.json(), url
    settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = True
    assert owner_api.post("/api/v1/webhook-endpoints/", {"url": "http://127.0.0.1:8000/hook"},
                          format="json").status_code == 201


@pytest.mark.django_db
def test_a_private_address_is_not_posted_to_even_if_stored(owner, receiver, settings):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = False  # e.g. a name that now resolves to 127.0.0.1
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    webhooks.webhook_attempt(delivery_id=delivery.pk)
    delivery.refresh_from_db()
    assert delivery.status == "failed" and "Not sent" in delivery.last_error and receiver.requests == []


@pytest.mark.django_db
def test_unknown_and_read_only_fields_are_a_400_and_patch_checks_the_url(owner_api, receiver):
    r = owner_api.post("/api/v1/webhook-endpoints/", {"url": receiver.url, "secret": "mine"}, format="json")
    assert r.status_code == 400 and "secret" in r.json()
    created = _endpoint(owner_api, receiver.url)
    r = owner_api.patch(f"/api/v1/webhook-endpoints/{created['id']}/", {"url": "https://10.0.0.1/"}, format="json")
    assert r.status_code == 400 and "url" in r.json()
    r = owner_api.patch(f"/api/v1/webhook-endpoints/{created['id']}/", {"active": False}, format="json")
    assert r.status_code == 200 and r.json()["active"] is False and r.json()["url"] == receiver.url


@pytest.mark.django_db
def test_another_users_endpoints_and_deliveries_are_404(owner_api, other_api, receiver):
    created = _endpoint(owner_api, receiver.url)
    delivery = owner_api.post(f"/api/v1/webhook-endpoints/{created['id']}/test/").json()
    for method, path in [
        ("get", f"/api/v1/webhook-endpoints/{created['id']}/"),
        ("patch", f"/api/v1/webhook-endpoints/{created['id']}/"),
        ("delete", f"/api/v1/webhook-endpoints/{created['id']}/"),
        ("post", f"/api/v1/webhook-endpoints/{created['id']}/test/"),
        ("get", f"/api/v1/webhook-deliveries/{delivery['delivery']}/"),
        ("get", f"/api/v1/webhook-deliveries/?endpoint={created['id']}"),
    ]:
        r = getattr(other_api, method)(path, {}, format="json") if method != "get" else other_api.get(path)
        assert r.status_code == 404, (method, path, r.status_code)
    assert other_api.get("/api/v1/webhook-endpoints/").json()["results"] == []
    assert other_api.get("/api/v1/webhook-deliveries/").json()["results"] == []
    assert WebhookEndpoint.objects.filter(pk=created["id"]).exists()
    assert owner_api.delete(f"/api/v1/webhook-endpoints/{created['id']}/").status_code == 204


@pytest.mark.django_db
@pytest.mark.parametrize("raw, status", [("-3", 400), ("x", 400), ("0", 404), ("9" * 30, 404),
                                         ("%C2%B2", 400), ("%D9%A3", 400)])  # "²" and "٣": isdigit, not int()
def test_the_deliveries_endpoint_filter_refuses_what_is_no_id(owner_api, raw, status):
    """The schema says a positive integer; anything else is a 400 naming `endpoint`, an id of nobody's a 404 (a
    number past bigint included: not a database error)."""
    r = owner_api.get(f"/api/v1/webhook-deliveries/?endpoint={raw}")
    assert r.status_code == status, r.content
    if status == 400:
        assert r.json() == {"endpoint": ["Must be an endpoint's id."]}


@pytest.mark.parametrize("address, public", [
    ("64:ff9b::808:808", True), ("2002:808:808::1", True), ("2606:4700::1111", True), ("8.8.8.8", True),
    ("64:ff9b::a9fe:a9fe", False), ("2002:c0a8:1::1", False), ("::ffff:10.0.0.1", False), ("::127.0.0.1", False),
    ("64:ff9b:1::808:808", False), ("ff02::1", False), ("100.64.0.1", False),
])
def test_an_ipv6_address_is_public_only_if_the_ipv4_it_carries_is(address, public):
    import ipaddress

    from core.addresses import is_public

    assert is_public(ipaddress.ip_address(address)) is public


@pytest.mark.django_db
def test_test_events_are_limited_per_user_and_hour_real_events_are_not(owner_api, receiver, settings, owner):
    """Each test event is up to NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS signed requests to a URL the user chose: a
    limit keeps the platform from being a way to flood someone else's server (two endpoints share it)."""
    settings.NOTIFICATIONS_WEBHOOK_TESTS_PER_HOUR = 3
    first, second = _endpoint(owner_api, receiver.url), _endpoint(owner_api, receiver.url + "?second")
    for endpoint in (first, first, second):
        assert owner_api.post(f"/api/v1/webhook-endpoints/{endpoint['id']}/test/").status_code == 202
    refused = owner_api.post(f"/api/v1/webhook-endpoints/{second['id']}/test/")
    assert refused.status_code == 429 and "At most 3 test events an hour" in refused.json()["detail"]
    assert WebhookDelivery.objects.filter(kind="test").count() == 3
    WebhookTestEvent.objects.filter(user=owner).update(at=timezone.now() - timedelta(minutes=61))
    assert owner_api.post(f"/api/v1/webhook-endpoints/{second['id']}/test/").status_code == 202
    assert WebhookTestEvent.objects.filter(user=owner).count() == 1  # the hour-old ones are gone
    credit_grant(user=owner, amount_micros=1_000_000, reason="goodwill")  # a real event: not counted, not refused


@pytest.mark.django_db
def test_deleting_the_endpoint_does_not_start_the_hourly_test_limit_again(owner_api, receiver, settings, owner):
    """The test deliveries go with their endpoint (found by review: the limit counted them, so deleting the
    endpoint and adding it again started the hour afresh)."""
    settings.NOTIFICATIONS_WEBHOOK_TESTS_PER_HOUR = 2
    first = _endpoint(owner_api, receiver.url)
    for _ in range(2):
        assert owner_api.post(f"/api/v1/webhook-endpoints/{first['id']}/test/").status_code == 202
    assert owner_api.delete(f"/api/v1/webhook-endpoints/{first['id']}/").status_code == 204
    assert not WebhookDelivery.objects.exists()
    again = _endpoint(owner_api, receiver.url)
    refused = owner_api.post(f"/api/v1/webhook-endpoints/{again['id']}/test/")
    assert refused.status_code == 429 and "At most 2 test events an hour" in refused.json()["detail"]


def test_a_change_refused_halfway_sends_no_e_mail_about_a_new_url(owner_api, receiver, mailoutbox,
                                                                  django_capture_on_commit_callbacks):
    """The "now sends elsewhere" e-mail was queued before the rest of the change was checked: a new URL with a
    description too long was refused (nothing saved) and the address was told the endpoint had moved."""
    from core.errors import ValidationFailed

    endpoint = WebhookEndpoint.objects.get(pk=_endpoint(owner_api, receiver.url)["id"])
    mailoutbox.clear()
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(ValidationFailed):
        webhooks.endpoint_update(endpoint=endpoint, url=receiver.url + "elsewhere",
                                 description="d" * (webhooks.DESCRIPTION_MAX_LENGTH + 1))
    assert WebhookEndpoint.objects.get(pk=endpoint.pk).url == receiver.url and mailoutbox == []


@pytest.mark.django_db
def test_a_duplicate_task_after_a_failed_attempt_sends_nothing_and_spends_no_attempt(owner, receiver, settings,
                                                                                      queued):
    """A duplicate of the delivery's task (the resender's during a queue backlog of more than 5 minutes, a
    redelivered message) coming after a failed attempt POSTed again at once and started a second retry chain: the
    endpoint got no backoff and the attempts were given up twice as fast (found by review). A task carries the
    attempts made when it was queued; one queued before an attempt made since sends nothing. Counted, not timed:
    the workers' clocks need not agree."""
    settings.NOTIFICATIONS_WEBHOOK_BACKOFF_S = 30
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    receiver.answers = [500, 500, 200]
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    assert webhooks.webhook_attempt(delivery_id=delivery.pk, after_attempts=0).retry_in_s == 30
    assert webhooks.webhook_attempt(delivery_id=delivery.pk, after_attempts=0) is None  # the first task again
    # Its retry stuck in a backlog: 6 minutes overdue, the resender queues another; the retry comes first.
    WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=timezone.now() - timedelta(minutes=6))
    assert webhooks.deliveries_resend() == 1 and queued[-1] == ("notifications.tasks.webhook_deliver", (delivery.pk, 1))
    assert webhooks.webhook_attempt(delivery_id=delivery.pk, after_attempts=1).number == 2  # the retry
    assert webhooks.webhook_attempt(delivery_id=delivery.pk, after_attempts=1) is None  # the resender's
    delivery.refresh_from_db()
    assert delivery.attempts == 2 and delivery.status == DeliveryStatus.RETRYING and len(receiver.requests) == 2
    assert webhooks.webhook_attempt(delivery_id=delivery.pk, after_attempts=2).number == 3  # its chain goes on
    assert WebhookDelivery.objects.get(pk=delivery.pk).status == DeliveryStatus.SUCCEEDED


@pytest.mark.django_db
def test_the_task_retries_with_the_attempts_made(owner, receiver, settings, monkeypatch):
    """What the retry's task carries: the attempts made when it was queued (Celery's apply runs it at once)."""
    from celery import current_app

    settings.NOTIFICATIONS_WEBHOOK_BACKOFF_S = 30
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    receiver.answers = [500, 500, 200]
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    calls = []
    real = webhooks.webhook_attempt
    monkeypatch.setattr(webhooks, "webhook_attempt", lambda **kw: calls.append(kw["after_attempts"]) or real(**kw))
    current_app.tasks["notifications.tasks.webhook_deliver"].apply(args=(delivery.pk, 0))
    assert calls == [0, 1, 2] and WebhookDelivery.objects.get(pk=delivery.pk).status == DeliveryStatus.SUCCEEDED
