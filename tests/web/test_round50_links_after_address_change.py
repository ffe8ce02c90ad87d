"""A link e-mailed for an address dies with that address: an operator changing it away and back again does not
revive it. Before, the verification and reset tokens were keyed on the address itself, so after A -> B -> A a link
sent to A before the changes worked again (User.email_changed_at now goes into both tokens)."""

import re

import pytest
from django.test import Client

from marketplace.models import User
from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

RESEND = "/account/email/verify/"


def _admin_change_email(admin, user, email):
    return admin.post(
        f"/admin/marketplace/user/{user.pk}/change/",
        {"email": email, "is_active": "on", "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00"},
    )


def _away_and_back(operator, user):
    admin = logged_in(operator)
    original = user.email
    assert _admin_change_email(admin, user, "somewhere.else@example.com").status_code == 302
    assert _admin_change_email(admin, user, original).status_code == 302
    user.refresh_from_db()
    assert user.email == original and user.email_changed_at is not None


def test_a_verification_link_is_dead_after_the_address_changed_away_and_back(operator, mailoutbox):
    user = UserFactory(email="typed.by.ops@example.com", email_verified_at=None)
    logged_in(user).post(RESEND)
    old_link = re.search(r"http://testserver(/accounts/verify/\S+/)", mailoutbox[-1].body).group(1)
    _away_and_back(operator, user)
    assert Client().get(old_link).status_code == 400
    user.refresh_from_db()
    assert user.email_verified_at is None
    # A link sent after the changes works.
    logged_in(user).post(RESEND)
    new_link = re.search(r"http://testserver(/accounts/verify/\S+/)", mailoutbox[-1].body).group(1)
    assert Client().get(new_link).status_code == 200
    user.refresh_from_db()
    assert user.email_verified_at is not None


def test_a_password_reset_link_is_dead_after_the_address_changed_away_and_back(operator, mailoutbox):
    user = UserFactory(email="resets@example.com")
    Client().post("/accounts/password/reset/", {"email": user.email})
    link = re.search(r"http://testserver(/accounts/password/reset/\S+/)", mailoutbox[-1].body).group(1)
    _away_and_back(operator, user)
    before = User.objects.get(pk=user.pk).password
    client = Client()
    r = client.get(link, follow=True)
    assert "new_password1" not in r.content.decode()  # Django's "invalid link" page, no form
    new = "a brand new passphrase 7"
    if r.redirect_chain:
        client.post(r.redirect_chain[-1][0], {"new_password1": new, "new_password2": new})
    assert User.objects.get(pk=user.pk).password == before


def test_an_unchanged_address_keeps_its_links(renter, mailoutbox):
    """The change time is in the token only once there is one: the reset link of an account never changed works."""
    client = Client()
    client.post("/accounts/password/reset/", {"email": renter.email})
    link = re.search(r"http://testserver(/accounts/password/reset/\S+/)", mailoutbox[-1].body).group(1)
    form_url = client.get(link)["Location"]
    new = "a brand new passphrase 7"
    assert client.post(form_url, {"new_password1": new, "new_password2": new}).status_code == 302
