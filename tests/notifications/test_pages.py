"""The pages: notifications list (mark read), settings (channels, endpoints, the secret once), an endpoint's
delivery log with the test button. Another user's endpoint is a 404; a bad URL is a 400 on the form."""
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from notifications.models import Kind, Preference, WebhookEndpoint
from notifications.services import webhooks
from notifications.services.notify import notify

PASSWORD = "correct horse battery staple"  # tests.factories.UserFactory's

pytestmark = pytest.mark.django_db


@pytest.fixture
def web(owner):
    client = Client()
    client.force_login(owner)
    return client


def test_list_shows_notifications_and_marks_them_read(web, owner):
    made = notify(user=owner, kind=Kind.LOW_BALANCE, payload={"message": "About 30 minutes left."}, dedupe_key="a")
    r = web.get("/account/notifications/")
    assert r.status_code == 200 and b"Your balance is running low" in r.content and b"1 unread" in r.content
    assert web.post(f"/account/notifications/{made.pk}/read/").status_code == 302
    made.refresh_from_db()
    assert made.read_at is not None
    assert b"0 unread" in web.get("/account/notifications/").content
    assert web.post("/account/notifications/read-all/").status_code == 302


def test_settings_save_channels_and_add_an_endpoint_showing_the_secret_once(web, owner, receiver):
    r = web.get("/account/notifications/settings/")
    assert r.status_code == 200 and b"Low balance" in r.content and b"Add an endpoint" in r.content
    checked = {f"{k}:{c}": "on" for k in Kind.values if k != "test" for c in ("in_app", "email", "webhook")}
    shown = {f"initial-{name}": "True" for name in checked}  # the values the page showed (test_channels_page.py)
    del checked["payout_sent:email"]
    assert web.post("/account/notifications/settings/", {"preferences": "1", **shown, **checked}).status_code == 302
    assert list(Preference.objects.filter(user=owner).values_list("kind", "email")) == [("payout_sent", False)]
    r = web.post("/account/notifications/settings/", {"url": receiver.url, "description": "mine"})
    assert r.status_code == 400 and not WebhookEndpoint.objects.exists()  # a session alone adds none
    assert 'id="id_password_errors"' in r.content.decode()
    r = web.post("/account/notifications/settings/", {"url": receiver.url, "description": "mine",
                                                      "password": "not it"})
    assert r.status_code == 400 and b"Your password was entered incorrectly" in r.content
    r = web.post("/account/notifications/settings/", {"url": receiver.url, "description": "mine",
                                                      "password": PASSWORD})
    endpoint = WebhookEndpoint.objects.get(user=owner)
    secret = webhooks.endpoint_secret(endpoint=endpoint)
    assert r.status_code == 200 and secret.encode() in r.content and r["Cache-Control"] == "no-store"
    assert secret.encode() not in web.get("/account/notifications/settings/").content


def test_a_bad_url_is_shown_on_the_field_with_what_was_typed(web):
    r = web.post("/account/notifications/settings/", {"url": "https://10.0.0.5/hook", "description": "lab",
                                                      "password": PASSWORD})
    assert r.status_code == 400 and b"private" in r.content and b"https://10.0.0.5/hook" in r.content
    assert not WebhookEndpoint.objects.exists()


def test_a_browser_session_alone_adds_no_endpoint_and_moves_none_through_the_api(
        owner, owner_api, receiver, mailoutbox, django_capture_on_commit_callbacks):
    """An endpoint receives the account's events until it is deleted (found by review: a copied cookie could add
    one, or point one elsewhere). Pausing it, or its description, stays open to the session."""
    from rest_framework.test import APIClient

    session = APIClient()
    session.force_login(owner)
    refused = session.post("/api/v1/webhook-endpoints/", {"url": receiver.url}, format="json")
    assert refused.status_code == 403 and "notification settings page" in refused.json()["detail"]
    assert not WebhookEndpoint.objects.exists()
    with django_capture_on_commit_callbacks(execute=True):
        made = owner_api.post("/api/v1/webhook-endpoints/", {"url": receiver.url}, format="json").json()
    (added,) = mailoutbox  # told to the address, as a saved SSH key is
    assert added.to == [owner.email] and added.subject.endswith("A webhook endpoint was added to your account")
    assert receiver.url in added.body and "reset your password" in added.body
    path = f"/api/v1/webhook-endpoints/{made['id']}/"
    assert session.patch(path, {"url": "https://example.com/elsewhere"}, format="json").status_code == 403
    with django_capture_on_commit_callbacks(execute=True):
        assert session.patch(path, {"url": receiver.url, "active": False, "description": "paused"},
                             format="json").status_code == 200
    assert WebhookEndpoint.objects.get().url == receiver.url and len(mailoutbox) == 1  # no new URL: no e-mail
    with django_capture_on_commit_callbacks(execute=True):
        moved = owner_api.patch(path, {"url": receiver.url + "elsewhere"}, format="json")
    assert moved.status_code == 200, moved.content
    assert mailoutbox[-1].subject.endswith("A webhook endpoint now sends elsewhere")
    assert receiver.url + "elsewhere" in mailoutbox[-1].body


def test_endpoint_page_logs_deliveries_and_sends_a_test(web, owner, receiver, queued,
                                                        django_capture_on_commit_callbacks):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    with django_capture_on_commit_callbacks(execute=True):
        assert web.post(f"/account/notifications/webhooks/{endpoint.pk}/test/").status_code == 302
    from .conftest import run_queued
    run_queued(queued)
    r = web.get(f"/account/notifications/webhooks/{endpoint.pk}/")
    assert r.status_code == 200 and b"Test event" in r.content and b"HTTP 200" in r.content
    assert web.post(f"/account/notifications/webhooks/{endpoint.pk}/toggle/", {"active": "0"}).status_code == 302
    endpoint.refresh_from_db()
    assert not endpoint.active
    assert web.post(f"/account/notifications/webhooks/{endpoint.pk}/delete/").status_code == 302
    assert not WebhookEndpoint.objects.exists()


def test_another_users_endpoint_pages_are_404(web, other_api, receiver):
    theirs, _ = webhooks.endpoint_create(user=other_api.user, url=receiver.url)
    assert web.get(f"/account/notifications/webhooks/{theirs.pk}/").status_code == 404
    for verb in ("test", "toggle", "delete"):
        assert web.post(f"/account/notifications/webhooks/{theirs.pk}/{verb}/").status_code == 404
    assert WebhookEndpoint.objects.filter(pk=theirs.pk, active=True).exists()


def test_pages_need_a_log_in(client):
    for path in ("/account/notifications/", "/account/notifications/settings/"):
        r = client.get(path)
        assert r.status_code == 302 and "/accounts/login/" in r["Location"]


def test_the_unread_count_tag_for_the_navigation(rf, owner):
    from django.contrib.auth.models import AnonymousUser
    from django.template import Context, Template

    notify(user=owner, kind=Kind.LOW_BALANCE, payload={}, dedupe_key="nav")
    template = Template("{% load notifications_web %}{% unread_notifications as n %}[{{ n }}]")
    request = rf.get("/")
    request.user = owner
    assert template.render(Context({"request": request})) == "[1]"
    request.user = AnonymousUser()
    assert template.render(Context({"request": request})) == "[0]"


def test_a_test_event_past_the_hourly_limit_is_told_on_the_page(web, owner, receiver, settings):
    settings.NOTIFICATIONS_WEBHOOK_TESTS_PER_HOUR = 0
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    r = web.post(f"/account/notifications/webhooks/{endpoint.pk}/test/", follow=True)
    assert r.status_code == 200 and b"At most 0 test events an hour" in r.content
    assert not endpoint.deliveries.exists()


def _token(page: str) -> str:
    return re.search(r'name="request_token" value="([^"]+)"', page).group(1)


def test_the_endpoint_form_submitted_twice_adds_one_endpoint_and_shows_its_secret_again(
        web, owner, receiver, mailoutbox, django_capture_on_commit_callbacks):
    """A double click (found by review): the second answer replaced the one showing the secret, and a second
    endpoint, whose secret was never shown either, was sent the account's events."""
    token = _token(web.get("/account/notifications/settings/").content.decode())
    form = {"url": receiver.url, "description": "ci", "password": PASSWORD, "request_token": token}
    answers = []
    for _ in range(2):
        with django_capture_on_commit_callbacks(execute=True):
            answers.append(web.post("/account/notifications/settings/", form))
    endpoint = WebhookEndpoint.objects.get(user=owner)
    secret = webhooks.endpoint_secret(endpoint=endpoint).encode()
    assert [(r.status_code, secret in r.content) for r in answers] == [(200, True), (200, True)]
    assert len(mailoutbox) == 1  # told once
    assert _token(answers[1].content.decode()) != token  # the next form is a new one

    # The same form with other values (the back button): refused with a fresh token, the secret not shown.
    r = web.post("/account/notifications/settings/", {**form, "description": "other"})
    assert r.status_code == 400 and b"This form already added the endpoint" in r.content
    assert secret not in r.content and _token(r.content.decode()) != token
    assert WebhookEndpoint.objects.filter(user=owner).count() == 1
    r = web.post("/account/notifications/settings/", {**form, "description": "other",
                                                      "request_token": _token(r.content.decode())})
    assert r.status_code == 200 and WebhookEndpoint.objects.filter(user=owner).count() == 2


def test_the_same_form_much_later_shows_no_secret(web, owner, receiver):
    form = {"url": receiver.url, "description": "", "password": PASSWORD, "request_token": "t1"}
    assert web.post("/account/notifications/settings/", form).status_code == 200
    WebhookEndpoint.objects.update(created_at=timezone.now() - timedelta(seconds=webhooks.REQUEST_REPLAY_S + 1))
    r = web.post("/account/notifications/settings/", form)
    secret = webhooks.endpoint_secret(endpoint=WebhookEndpoint.objects.get(user=owner)).encode()
    assert r.status_code == 400 and b"its secret was shown then" in r.content and secret not in r.content
