"""POST /api/v1/webhook-endpoints/ honours Idempotency-Key (found by review, round 45).

A client that sent the create again after losing the answer (a timeout, a 502 after the commit) added a second
endpoint to the same URL, header or not: every event was then POSTed twice, the second copy signed with a secret the
client never saw. Now, as for instances, volumes, top-ups and refunds, the same key and body answer the endpoint it
added (200, adding and telling nothing); the secret comes again only within REQUEST_REPLAY_S, as for the page form
submitted twice (the lost answer was the only one with it); later, or with another body, the key is a 422."""
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.core import mail

from notifications.models import Kind, WebhookDelivery, WebhookEndpoint
from notifications.services import webhooks as webhook_svc
from notifications.services.notify import notify
from tests.factories import UserFactory, api_key_for

pytestmark = pytest.mark.django_db

URL = "/api/v1/webhook-endpoints/"


def _post(api, body, key=None):
    extra = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    return api.post(URL, body, format="json", **extra)


def test_a_retried_create_with_the_same_key_adds_one_endpoint_and_answers_it_again(
        owner, owner_api, receiver, django_capture_on_commit_callbacks):
    body = {"url": receiver.url, "description": "billing hooks"}
    with django_capture_on_commit_callbacks(execute=True):
        first = _post(owner_api, body, "hook-1")
        again = _post(owner_api, {"description": "billing hooks", "url": receiver.url}, "hook-1")  # key order
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json() and first.json()["secret"].startswith("whsec_")
    assert again["Cache-Control"] == "no-store"
    assert WebhookEndpoint.objects.filter(user=owner).count() == 1
    assert len(mail.outbox) == 1, "the address was told of one endpoint added, not two"

    notify(user=owner, kind=Kind.PAYOUT_SENT, dedupe_key="payout_sent:1",
           payload={"payout": 1, "amount": "5.00", "message": "Sent."})
    assert WebhookDelivery.objects.filter(endpoint__user=owner).count() == 1


@pytest.mark.parametrize("other", [
    {"url": "http://127.0.0.1:9/other", "description": "billing hooks"},
    {"description": "other hooks"},
    {"active": False},
])
def test_the_same_key_with_another_body_is_a_422_and_adds_nothing(owner, owner_api, receiver, other):
    body = {"url": receiver.url, "description": "billing hooks"}
    first = _post(owner_api, body, "hook-1")
    reused = _post(owner_api, {**body, **other}, "hook-1")
    assert first.status_code == 201
    assert reused.status_code == 422 and "another request" in reused.json()["detail"]
    assert "secret" not in reused.json() and first.json()["secret"] not in reused.content.decode()
    assert list(WebhookEndpoint.objects.filter(user=owner).values_list("pk", flat=True)) == [first.json()["id"]]


def test_after_the_replay_window_the_key_is_a_422_and_the_secret_is_not_shown_again(owner, owner_api, receiver):
    body = {"url": receiver.url}
    first = _post(owner_api, body, "hook-1")
    endpoint = WebhookEndpoint.objects.get(pk=first.json()["id"])
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        created_at=endpoint.created_at - timedelta(seconds=webhook_svc.REQUEST_REPLAY_S + 1))
    late = _post(owner_api, body, "hook-1")
    assert late.status_code == 422 and "not shown again" in late.json()["detail"]
    assert first.json()["secret"] not in late.content.decode() and str(first.json()["id"]) in late.json()["detail"]
    assert WebhookEndpoint.objects.filter(user=owner).count() == 1


def test_without_a_key_each_create_adds_one_and_keys_are_per_user(owner, owner_api, receiver):
    body = {"url": receiver.url}
    assert [_post(owner_api, body).status_code for _ in range(2)] == [201, 201]
    assert WebhookEndpoint.objects.filter(user=owner).count() == 2

    other = UserFactory()
    from rest_framework.test import APIClient

    other_api = APIClient()
    other_api.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(other)}")
    mine = _post(owner_api, body, "shared-key")
    theirs = _post(other_api, body, "shared-key")
    assert (mine.status_code, theirs.status_code) == (201, 201)
    assert mine.json()["id"] != theirs.json()["id"] and mine.json()["secret"] != theirs.json()["secret"]
    assert WebhookEndpoint.objects.filter(user=other).count() == 1


def test_a_paused_endpoint_is_added_paused_and_answered_so_again(owner, owner_api, receiver):
    body = {"url": receiver.url, "active": False}
    first = _post(owner_api, body, "hook-1")
    again = _post(owner_api, body, "hook-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["active"] is False and again.json() == first.json()
    assert WebhookEndpoint.objects.get(user=owner).active is False


def test_a_replay_needs_not_pass_the_url_check_again(owner, owner_api, receiver, settings):
    """The retry gets the answer it lost even if the URL's check would refuse it now (a name that resolves
    elsewhere now, or, here, loopback no longer allowed)."""
    body = {"url": receiver.url}
    first = _post(owner_api, body, "hook-1")
    settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = False
    assert _post(owner_api, body).status_code == 400
    again = _post(owner_api, body, "hook-1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


def test_a_malformed_key_is_a_400(owner, owner_api, receiver):
    r = _post(owner_api, {"url": receiver.url}, "not a key")
    assert r.status_code == 400 and "Idempotency-Key" in r.json()
    assert not WebhookEndpoint.objects.filter(user=owner).exists()


def test_the_page_forms_token_still_replays_by_its_values(owner, receiver):
    """The service's other caller, the settings page, keeps its rule (its values compared, no fingerprint)."""
    first, secret = webhook_svc.endpoint_create(user=owner, url=receiver.url, idempotency_key="web-token")
    again, secret_again = webhook_svc.endpoint_create(user=owner, url=receiver.url, idempotency_key="web-token")
    assert (again.pk, secret_again) == (first.pk, secret)
    with pytest.raises(webhook_svc.EndpointRequestReused):
        webhook_svc.endpoint_create(user=owner, url=receiver.url, description="x", idempotency_key="web-token")


def test_the_schema_documents_the_header_the_replay_and_the_422():
    schema = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml").read_text())
    create = schema["paths"]["/api/v1/webhook-endpoints/"]["post"]
    assert any(p["name"] == "Idempotency-Key" and p["in"] == "header" for p in create["parameters"])
    assert {"200", "201", "422"} <= set(create["responses"])
