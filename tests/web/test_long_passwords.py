"""The longest password: every way of setting one refuses more than PASSWORD_MAX_LENGTH, and no place that checks
one refuses a longer one as too long (review r49: the change page and a reset link set 168 characters, then the
API's log-in and every page that asks for the password again refused it, locking the owner out of them).

core/password_validation.py says why and where; only an absurd length (over PASSWORD_CHECK_MAX_LENGTH) is
answered as a wrong password, unhashed."""

import pytest
from django.conf import settings
from django.contrib.auth import password_validation
from django.core.exceptions import ValidationError
from django.test import Client
from rest_framework.test import APIClient

from core.password_validation import PASSWORD_CHECK_MAX_LENGTH
from marketplace.models import User
from marketplace.validators import PASSWORD_MAX_LENGTH
from tests.factories import UserFactory
from tests.web.conftest import PASSWORD, logged_in
from tests.web.test_password_pages import reset_link

pytestmark = pytest.mark.django_db

LONG = ("a long generated passphrase " * 6)[: PASSWORD_MAX_LENGTH + 1]  # one over: as a password manager may make
LONGEST = LONG[:PASSWORD_MAX_LENGTH]
ABSURD = "x" * (PASSWORD_CHECK_MAX_LENGTH + 1)
TOO_LONG = f"at most {PASSWORD_MAX_LENGTH} characters"


def _holding(password: str) -> User:
    """An account whose password is `password` (one longer than the maximum: set before it held everywhere)."""
    user = UserFactory()
    user.set_password(password)
    user.save(update_fields=["password"])
    return user


def _api_login(user, password):
    return APIClient().post("/api/v1/auth/login/", {"email": user.email, "password": password}, format="json")


# --- setting ------------------------------------------------------------------------------------------------------


def test_the_validator_holds_sign_ups_maximum():
    (options,) = [
        v.get("OPTIONS", {})
        for v in settings.AUTH_PASSWORD_VALIDATORS
        if v["NAME"] == "core.password_validation.MaximumLengthValidator"
    ]
    assert options["max_length"] == PASSWORD_MAX_LENGTH
    password_validation.validate_password(LONGEST)  # what createsuperuser, the admin's and Django's forms run
    with pytest.raises(ValidationError, match=TOO_LONG):
        password_validation.validate_password(LONG)


def test_the_change_page_refuses_a_password_over_the_maximum(renter):
    web = logged_in(renter)
    r = web.post("/account/password/", {"old_password": PASSWORD, "new_password1": LONG, "new_password2": LONG})
    assert r.status_code == 400 and TOO_LONG in r.content.decode()
    renter.refresh_from_db()
    assert renter.check_password(PASSWORD)
    r = web.post("/account/password/", {"old_password": PASSWORD, "new_password1": LONGEST, "new_password2": LONGEST})
    assert r.status_code == 302


def test_a_reset_link_refuses_a_password_over_the_maximum(client, renter, mailoutbox):
    client.post("/accounts/password/reset/", {"email": renter.email})
    form_url = client.get(reset_link(mailoutbox[-1]))["Location"]  # Django moves the token into the session
    r = client.post(form_url, {"new_password1": LONG, "new_password2": LONG})
    assert r.status_code == 400 and TOO_LONG in r.content.decode()
    renter.refresh_from_db()
    assert renter.check_password(PASSWORD)


def test_an_operator_cannot_set_a_password_over_the_maximum(operator, renter):
    r = logged_in(operator).post(
        f"/admin/marketplace/user/{renter.pk}/password/",
        {"password1": LONG, "password2": LONG, "usable_password": "true"},
    )
    assert r.status_code == 200 and TOO_LONG in r.content.decode()
    renter.refresh_from_db()
    assert renter.check_password(PASSWORD)


def test_sign_up_refuses_a_password_over_the_maximum(client):
    r = APIClient().post("/api/v1/auth/register/", {"email": "new@example.com", "password": LONG}, format="json")
    assert r.status_code == 400 and "password" in r.json()
    r = client.post("/accounts/signup/", {"email": "new@example.com", "password": LONG})
    assert r.status_code in (200, 400) and "128 characters" in r.content.decode()


# --- checking -----------------------------------------------------------------------------------------------------


def test_an_account_holding_a_longer_password_logs_in_on_the_api():
    user = _holding(LONG + "and some more")
    r = _api_login(user, LONG + "and some more")
    assert r.status_code == 200, r.json()
    assert _api_login(user, LONG).status_code == 400  # and it is checked: a wrong one is wrong


def test_an_account_holding_a_longer_password_confirms_it_on_the_pages():
    user = _holding(LONG)
    web = logged_in(user)
    r = web.post("/account/api-keys/", {"name": "ci", "scopes": ["read"], "expires_in_days": "0", "password": LONG})
    assert r.status_code == 200 and b"gpm_" in r.content, r.content.decode()[-2000:]
    r = web.post("/account/password/", {"old_password": LONG, "new_password1": LONGEST, "new_password2": LONGEST})
    assert r.status_code == 302  # and can change it to one within the maximum
    user.refresh_from_db()
    assert user.check_password(LONGEST)


@pytest.fixture
def no_hashing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an absurdly long password was hashed")

    monkeypatch.setattr(User, "check_password", refuse)
    monkeypatch.setattr(User, "set_password", refuse)  # ModelBackend's dummy hash for an unknown address


def test_an_absurd_length_is_a_wrong_password_on_the_api_unhashed(renter, no_hashing):
    r = _api_login(renter, ABSURD)
    assert r.status_code == 400 and r.json() == {"detail": ["Invalid email or password."]}


def test_an_absurd_length_is_a_wrong_password_on_the_pages_unhashed(renter, no_hashing):
    r = Client().post("/accounts/login/", {"username": renter.email, "password": ABSURD})
    assert r.status_code in (200, 400) and "correct email" in r.content.decode().lower()
    r = logged_in(renter).post(
        "/account/api-keys/", {"name": "ci", "scopes": ["read"], "expires_in_days": "0", "password": ABSURD}
    )
    assert r.status_code == 400 and "entered incorrectly" in r.content.decode()
