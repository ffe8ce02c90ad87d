"""A webhook page's Pause / Resume posts the state it asks for, and that state is set: never a flip of whatever is
stored, which Pause clicked twice, or on a page opened before a pause made elsewhere, turned into a resume (found by
review). A post without a valid state changes nothing."""
import re

import pytest
from django.test import Client

from notifications.models import WebhookEndpoint
from notifications.services import webhooks

pytestmark = pytest.mark.django_db


@pytest.fixture
def web(owner):
    client = Client()
    client.force_login(owner)
    return client


def _toggle_form(web, endpoint) -> tuple[str, dict[str, str], str]:
    """(action, the hidden fields, the button's label) of the page's Pause / Resume form, as a browser posts it."""
    html = web.get(f"/account/notifications/webhooks/{endpoint.pk}/").content.decode()
    action = f"/account/notifications/webhooks/{endpoint.pk}/toggle/"
    form = re.search(rf'<form method="post" action="{re.escape(action)}">(.*?)</form>', html, re.S).group(1)
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form))
    fields.pop("csrfmiddlewaretoken", None)
    return action, fields, re.search(r"<button[^>]*>([^<]+)</button>", form).group(1)


def test_pause_clicked_twice_leaves_the_endpoint_paused(web, owner, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    action, fields, label = _toggle_form(web, endpoint)
    assert label == "Pause"
    assert web.post(action, fields).status_code == 302
    r = web.post(action, fields, follow=True)  # the same page's form again: a double click
    endpoint.refresh_from_db()
    assert endpoint.active is False and b"already paused" in r.content
    action, fields, label = _toggle_form(web, endpoint)
    assert label == "Resume"
    web.post(action, fields)
    web.post(action, fields)
    endpoint.refresh_from_db()
    assert endpoint.active is True


def test_pause_on_a_page_opened_before_a_pause_made_elsewhere_keeps_it_paused(web, owner, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    action, fields, label = _toggle_form(web, endpoint)
    assert label == "Pause"
    webhooks.endpoint_update(endpoint=WebhookEndpoint.objects.get(pk=endpoint.pk), active=False)  # the API, a tab
    assert web.post(action, fields).status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.active is False


@pytest.mark.parametrize("fields", [{}, {"active": ""}, {"active": "on"}, {"active": "true"}, {"active": "2"}])
def test_a_post_without_the_state_asked_for_changes_nothing(web, owner, receiver, fields):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    r = web.post(f"/account/notifications/webhooks/{endpoint.pk}/toggle/", fields)
    assert r.status_code == 400 and b"Nothing changed" in r.content
    endpoint.refresh_from_db()
    assert endpoint.active is True
