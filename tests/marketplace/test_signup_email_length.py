"""An address within EMAIL_MAX_LENGTH as typed but longer once lower-cased, as accounts keep it (review r48, #1).

"\u0130".lower() is "i" + U+0307, two characters. Sign-up checked the limit on what was typed, put the lower-cased
address in the token, and confirming it inserted 256 characters into the 254-character column: a DataError, a 500
on every try (API and page). Now sign-up (API, page), the admin's add and change forms and the manager refuse it
on `email` at the first step, and a token issued before the fix is a 400 on confirmation, not a 500.
"""
import re

import pytest
from django.contrib.auth.hashers import make_password
from django.test import Client
from rest_framework.test import APIClient

from marketplace.admin.accounts import UserAddForm, UserChangeForm
from marketplace.models import ApiKey, User
from marketplace.services import accounts
from marketplace.validators import EMAIL_MAX_LENGTH
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

# A valid, deliverable address (local part 64 characters, labels <= 63 and the domain 219 characters in punycode):
# 164 characters as typed, 256 once lower-cased ("\u0130".lower() is "i" + U+0307, two characters).
IDN = "a" * 64 + "@" + ".".join(["\u0130" * 28] * 3 + ["\u0130" * 8]) + ".com"
# 127 "\u0130" in the domain make 254 once lower-cased: the longest that fits, still accepted.
IDN_FITS = "a" * 64 + "@" + ".".join(["\u0130" * 28] * 3 + ["\u0130" * 7]) + ".com"
PASSWORD = "a long enough passphrase 42"


def test_the_addresses_are_what_they_say():
    assert len(IDN) == 164 and len(IDN.lower()) == 256 > EMAIL_MAX_LENGTH
    assert len(IDN_FITS.lower()) == EMAIL_MAX_LENGTH


def _token(mailoutbox):
    return re.search(r"^The token: (\S+)$", mailoutbox[-1].body, re.M).group(1)


def _old_token(email: str = IDN) -> str:
    """A token as sign-up issued before the fix: the lower-cased address, whatever its length."""
    return accounts._signup_token(email=email.lower(), password_hash=make_password(PASSWORD))


def test_api_signup_refuses_on_email_the_address_too_long_once_lower_cased(mailoutbox):
    r = APIClient().post("/api/v1/auth/register/", {"email": IDN, "password": PASSWORD}, format="json")
    assert r.status_code == 400, r.content
    assert "email" in r.json() and "254" in str(r.json()["email"])
    assert mailoutbox == []


def test_page_signup_refuses_on_email_the_address_too_long_once_lower_cased(mailoutbox):
    r = Client().post("/accounts/signup/", {"email": IDN, "password": PASSWORD})
    assert r.status_code == 400, r.status_code
    assert "email" in r.context["form"].errors
    assert mailoutbox == []


def test_the_longest_address_that_fits_signs_up_and_confirms(mailoutbox):
    r = APIClient().post("/api/v1/auth/register/", {"email": IDN_FITS, "password": PASSWORD}, format="json")
    assert r.status_code == 202, r.content
    r = APIClient().post("/api/v1/auth/confirm/", {"token": _token(mailoutbox), "password": PASSWORD},
                         format="json")
    assert r.status_code == 201, r.content
    assert User.objects.get().email == IDN_FITS.lower()


def test_api_confirm_of_an_old_token_with_an_address_too_long_is_a_400_not_a_500():
    client = APIClient(raise_request_exception=False)
    r = client.post("/api/v1/auth/confirm/", {"token": _old_token(), "password": PASSWORD}, format="json")
    assert r.status_code == 400, (r.status_code, r.content[:300])
    assert "token" in r.json() and "254" in str(r.json()["token"])
    assert not User.objects.exists() and not ApiKey.objects.exists()


def test_page_confirm_of_an_old_token_with_an_address_too_long_is_a_400_not_a_500():
    token = _old_token()
    client = Client(raise_request_exception=False)
    r = client.post(f"/accounts/confirm/{token}/", {"token": token, "password": PASSWORD})
    assert r.status_code == 400, r.status_code
    assert "254" in str(r.context["form"].non_field_errors())
    assert not User.objects.exists()


def test_old_token_with_the_wrong_password_is_still_the_password_error():
    r = APIClient().post("/api/v1/auth/confirm/", {"token": _old_token(), "password": "another passphrase 42"},
                         format="json")
    assert r.status_code == 400 and "password" in r.json()


def test_admin_add_and_change_forms_refuse_the_address_too_long_once_lower_cased():
    form = UserAddForm(data={"email": IDN})
    assert not form.is_valid()
    assert "254" in str(form.errors["email"])
    user = UserFactory()
    assert accounts.email_normalize(user.email) == user.email
    change = UserChangeForm(instance=user)
    data = {**change.initial, "email": IDN}
    data = {k: v for k, v in data.items() if v is not None and k not in ("groups", "user_permissions")}
    change = UserChangeForm(data=data, instance=user)
    assert not change.is_valid()
    assert "254" in str(change.errors["email"])
    user.refresh_from_db()
    assert user.email != IDN.lower()


def test_manager_refuses_the_address_too_long_once_lower_cased():
    with pytest.raises(ValueError, match="too long"):
        User.objects.create_user(IDN, PASSWORD)
    assert not User.objects.exists()


def test_login_and_password_reset_with_the_address_are_no_500(mailoutbox):
    client = APIClient(raise_request_exception=False)
    r = client.post("/api/v1/auth/login/", {"email": IDN, "password": PASSWORD}, format="json")
    assert r.status_code == 400, (r.status_code, r.content[:300])
    r = Client(raise_request_exception=False).post("/accounts/login/", {"username": IDN, "password": PASSWORD})
    assert r.status_code in (200, 400), r.status_code
    r = Client(raise_request_exception=False).post("/accounts/password/reset/", {"email": IDN})
    assert r.status_code in (200, 302), r.status_code
