"""The e-mail to an address that signs up again while it has an account is worded by the account's state, and the
reset e-mail of a deactivated account says so (review r51, finding 4): both told its owner to log in, or to open an
account, which the log-in and the sign-up then refused."""
import pytest
from django.test import Client
from rest_framework.test import APIClient

from marketplace.models import User
from marketplace.services.account_status import account_deactivate

pytestmark = pytest.mark.django_db
REGISTER = "/api/v1/auth/register/"


def test_sign_up_mail_of_a_deactivated_account_does_not_send_its_owner_to_a_log_in_that_fails(mailoutbox):
    user = User.objects.create_user(email="off@example.org", password="the owner's pass 12345")
    account_deactivate(user=user, reason="abuse report under review")
    mailoutbox.clear()
    assert APIClient(REMOTE_ADDR="203.0.113.8").post(
        REGISTER, {"email": "off@example.org", "password": "another fine pass 1"},
        format="json").status_code == 202
    r = APIClient(REMOTE_ADDR="203.0.113.9").post(
        "/api/v1/auth/login/", {"email": "off@example.org", "password": "the owner's pass 12345"}, format="json")
    assert r.status_code == 400  # the log-in refuses the account's own password
    Client(REMOTE_ADDR="203.0.113.10").post("/accounts/password/reset/", {"email": "off@example.org"})
    signup_mail, reset_mail = mailoutbox
    assert "log in at" not in signup_mail.body, signup_mail.body
    assert "deactivated" in signup_mail.body and "support" in signup_mail.body
    assert reset_mail.to == ["off@example.org"]
    assert "no account" not in reset_mail.body and "To open one" not in reset_mail.body, reset_mail.body
    assert "deactivated" in reset_mail.body and "support" in reset_mail.body


def test_sign_up_mail_of_an_operator_made_account_without_a_password_does_not_just_say_log_in(mailoutbox):
    user = User.objects.create_user(email="made@example.org", password=None)
    assert not user.has_usable_password()
    assert APIClient(REMOTE_ADDR="203.0.113.8").post(
        REGISTER, {"email": "made@example.org", "password": "another fine pass 1"},
        format="json").status_code == 202
    [mail] = mailoutbox
    assert "log in at" not in mail.body or "reset" in mail.body.lower(), mail.body
    assert "http://testserver/accounts/password/reset/" in mail.body and "no password yet" in mail.body


def test_sign_up_mail_of_an_active_account_says_log_in_or_reset(mailoutbox):
    User.objects.create_user(email="on@example.org", password="the owner's pass 12345")
    assert APIClient(REMOTE_ADDR="203.0.113.8").post(
        REGISTER, {"email": "On@Example.org", "password": "another fine pass 1"}, format="json").status_code == 202
    [mail] = mailoutbox
    assert mail.to == ["on@example.org"]
    assert "log in at http://testserver/accounts/login/" in mail.body
    assert "http://testserver/accounts/password/reset/" in mail.body
