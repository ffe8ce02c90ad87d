"""A change to a webhook endpoint deleted meanwhile (another request's DELETE, between this request's read of it and
its save) is a 404, not the 500 of saving a row that is gone (found by review): the service reads the row afresh
under its lock and applies the change to that."""
import pytest
from django.test import Client

from core.errors import NotFound
from notifications.models import WebhookEndpoint
from notifications.services import urls as urls_svc
from notifications.services import webhooks

pytestmark = pytest.mark.django_db


def _deleted_during_the_url_check(monkeypatch, endpoint):
    real = urls_svc.webhook_url_check

    def check(url, **kwargs):
        webhooks.endpoint_delete(endpoint=WebhookEndpoint.objects.get(pk=endpoint.pk))
        return real(url, **kwargs)

    monkeypatch.setattr(webhooks, "webhook_url_check", check)


def test_a_patch_of_an_endpoint_deleted_meanwhile_is_a_404(owner, owner_api, receiver, monkeypatch, mailoutbox,
                                                           django_capture_on_commit_callbacks):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    mailoutbox.clear()
    _deleted_during_the_url_check(monkeypatch, endpoint)
    owner_api.raise_request_exception = False
    with django_capture_on_commit_callbacks(execute=True):
        r = owner_api.patch(f"/api/v1/webhook-endpoints/{endpoint.pk}/", {"url": receiver.url + "/v2"},
                            format="json")
    assert r.status_code == 404 and "deleted" in r.json()["detail"]
    assert not WebhookEndpoint.objects.exists() and mailoutbox == []  # no "now sends elsewhere" for it


def test_a_change_of_a_copy_whose_row_is_gone_raises_not_found(owner, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).delete()
    for change in ({"active": False}, {"description": "d"}, {}):
        with pytest.raises(NotFound):
            webhooks.endpoint_update(endpoint=endpoint, **change)
    assert not WebhookEndpoint.objects.exists()


def test_the_change_applies_to_the_stored_row_and_the_callers_copy(owner, receiver, mailoutbox,
                                                                   django_capture_on_commit_callbacks):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    stale = WebhookEndpoint.objects.get(pk=endpoint.pk)
    with django_capture_on_commit_callbacks(execute=True):
        webhooks.endpoint_update(endpoint=endpoint, url=receiver.url + "/v2")
    mailoutbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        saved = webhooks.endpoint_update(endpoint=stale, url=receiver.url + "/v3", active=False)
    assert (saved.url, saved.active) == (stale.url, stale.active) == (receiver.url + "/v3", False)
    (told,) = mailoutbox
    assert f"(it sent them to {receiver.url}/v2)" in told.body.replace("\n", " ")  # what was stored, not the copy's


def test_a_pause_on_the_page_of_an_endpoint_deleted_meanwhile(owner, receiver, monkeypatch):
    from notifications.web import views

    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    real = views.get_object_or_404

    def read_then_deleted(*args, **kwargs):
        found = real(*args, **kwargs)
        WebhookEndpoint.objects.filter(pk=found.pk).delete()  # another tab's Delete, after this request read it
        return found

    monkeypatch.setattr(views, "get_object_or_404", read_then_deleted)
    web = Client()
    web.force_login(owner)
    r = web.post(f"/account/notifications/webhooks/{endpoint.pk}/toggle/", {"active": "0"}, follow=True)
    assert r.redirect_chain == [("/account/notifications/settings/", 302)]
    assert b"This webhook endpoint was deleted." in r.content


def test_an_endpoint_added_paused_is_answered_paused(owner_api, receiver):
    r = owner_api.post("/api/v1/webhook-endpoints/", {"url": receiver.url, "active": False}, format="json")
    assert r.status_code == 201 and r.json()["active"] is False
    assert WebhookEndpoint.objects.get().active is False
