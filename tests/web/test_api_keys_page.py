"""The API keys page: scopes and expiry when making a key, both shown in the list, errors on the fields."""
import re
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from marketplace.models import ApiKey
from marketplace.services.accounts import api_key_create
from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db

PAGE = "/account/api-keys/"


def test_the_form_offers_the_scopes_all_ticked_and_expiry_never(web):
    html = web.get(PAGE).content.decode()
    for scope in ("read", "renter", "provider"):
        assert re.search(rf'<input type="checkbox" name="scopes" value="{scope}"[^>]*checked', html), scope
    assert re.search(r'<option value="0" selected>never</option>', html)


def test_a_read_only_key_that_expires_is_made_and_works_as_such(web, renter):
    r = web.post(PAGE, {"name": "dashboards", "scopes": ["read"], "expires_in_days": "30",
                         "password": PASSWORD})
    assert r.status_code == 200
    raw = re.search(r'id="new-key">([^<]+)<', r.content.decode()).group(1)
    key = ApiKey.objects.get(user=renter, name="dashboards")
    assert key.scopes == ["read"]
    assert abs(key.expires_at - (timezone.now() + timedelta(days=30))) < timedelta(minutes=1)
    listed = web.get(PAGE).content.decode()
    row = re.search(r"<th scope=\"row\">dashboards</th>(.*?)</tr>", listed, re.S).group(1)
    assert "<td>read</td>" in row and key.expires_at.strftime("%Y-%m-%d") in row
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get("/api/v1/instances/").status_code == 200
    assert client.post("/api/v1/ssh-keys/", {}, format="json").status_code == 403


def test_expired_keys_are_marked(web, renter):
    key, _ = api_key_create(user=renter, name="old", expires_at=timezone.now() + timedelta(hours=1))
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(hours=1))
    html = web.get(PAGE).content.decode()
    row = re.search(r"<th scope=\"row\">old</th>(.*?)</tr>", html, re.S).group(1)
    assert '<span class="badge bad">expired</span>' in row


@pytest.mark.parametrize(("data", "field", "text"), [
    ({"name": "x", "expires_in_days": "0", "password": PASSWORD}, "scopes", "Choose at least one scope."),
    ({"name": "x", "scopes": ["admin"], "expires_in_days": "0", "password": PASSWORD}, "scopes",
     "Select a valid choice."),
    ({"name": "x", "scopes": ["read"], "expires_in_days": "12", "password": PASSWORD}, "expires_in_days",
     "Select a valid choice."),
    # A session alone (a copied cookie) makes no key: the password is asked, behind the log-in lock-out
    ({"name": "x", "scopes": ["read"], "expires_in_days": "0"}, "password", "This field is required."),
    ({"name": "x", "scopes": ["read"], "expires_in_days": "0", "password": "not it"}, "password",
     "Your password was entered incorrectly."),
])
def test_form_errors_are_a_400_on_the_field_and_make_no_key(web, renter, data, field, text):
    r = web.post(PAGE, data)
    html = r.content.decode()
    assert r.status_code == 400 and text in html and f'id="id_{field}_errors"' in html
    assert not ApiKey.objects.filter(user=renter).exists()
