"""An absurdly long password (over PASSWORD_CHECK_MAX_LENGTH) is a wrong password, never hashed, on every log-in
path: the bound is in the authentication backend (marketplace/auth.py), which all of them go through. The admin's
log-in page had no such bound (review r49 added it to the API's log-in and the site's log-in page only)."""

import pytest
from django.contrib.auth import authenticate
from django.test import Client

from core.password_validation import PASSWORD_CHECK_MAX_LENGTH
from marketplace.models import User
from tests.factories import UserFactory
from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db

ABSURD = "x" * (PASSWORD_CHECK_MAX_LENGTH + 1)


@pytest.fixture
def no_hashing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an absurdly long password was hashed")

    monkeypatch.setattr(User, "check_password", refuse)
    monkeypatch.setattr(User, "set_password", refuse)  # ModelBackend's dummy hash for an unknown address


def test_an_absurd_length_is_a_wrong_password_on_the_admin_log_in_unhashed(operator, no_hashing):
    r = Client().post("/admin/login/", {"username": operator.email, "password": ABSURD})
    assert r.status_code in (200, 400) and "correct email" in r.content.decode().lower()
    r = Client().post("/admin/login/", {"username": "nobody@example.com", "password": ABSURD})
    assert r.status_code in (200, 400) and "correct email" in r.content.decode().lower()


def test_the_backend_refuses_an_absurd_length_unhashed(renter, no_hashing):
    assert authenticate(email=renter.email, password=ABSURD) is None


def test_the_backend_checks_the_longest_length_allowed():
    user = UserFactory()
    assert authenticate(email=user.email, password="y" * PASSWORD_CHECK_MAX_LENGTH) is None  # checked: wrong
    assert authenticate(email=user.email, password=PASSWORD) == user
