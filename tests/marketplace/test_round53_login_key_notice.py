"""The API log-in (review r53): a key it makes under a new name is e-mailed to the address, as a key made on the page
or with POST /api-keys/ is (it was made silently: all scopes, no expiry, and it outlives a password reset); a wrong
`otp_code` is answered on `otp_code`, the request's field (it was answered on `code`)."""
import pytest
from django.test import Client
from django_otp.oath import totp

from marketplace.models import AuthenticatorDevice
from marketplace.services import two_factor
from tests.factories import UserFactory, api_key_for

pytestmark = pytest.mark.django_db

LOGIN = "/api/v1/auth/login/"
PASSWORD = "correct horse battery staple"  # what UserFactory sets


@pytest.fixture(autouse=True)
def _no_device_delay(settings):
    settings.OTP_TOTP_THROTTLE_FACTOR = 0
    settings.OTP_STATIC_THROTTLE_FACTOR = 0


def login(user, **extra):
    return Client().post(LOGIN, {"email": user.email, "password": PASSWORD, **extra}, content_type="application/json",
                         REMOTE_ADDR="203.0.113.7")


def key_mails(outbox):
    return [m for m in outbox if "API key" in m.subject]


def enrol(user) -> None:
    device = two_factor.totp_enrol_start(user=user, password=PASSWORD, client_address=None)
    two_factor.totp_enrol_confirm(user=user, device_id=device.pk, code=f"{totp(device.bin_key):06d}",
                                  client_address=None)


def test_a_log_in_that_makes_a_key_under_a_new_name_tells_the_address(mailoutbox, django_capture_on_commit_callbacks):
    user = UserFactory()
    with django_capture_on_commit_callbacks(execute=True):
        api_key_for(user)  # the page's and POST /api-keys/'s path: told
    assert len(key_mails(mailoutbox)) == 1
    mailoutbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        r = login(user, key_name="attacker")
    assert r.status_code == 200
    key = r.json()["key"]
    assert key["scopes"] == ["read", "renter", "provider"] and key["expires_at"] is None
    (mail,) = key_mails(mailoutbox)
    assert mail.to == [user.email]
    assert "attacker" in mail.body and key["prefix"] in mail.body and "203.0.113.7" in mail.body
    assert "does not expire" in mail.body and "http://testserver/" in mail.body  # the reset link, absolute
    assert r.json()["api_key"] not in mail.body  # never the key itself


def test_the_default_name_is_a_new_name_the_first_time(mailoutbox, django_capture_on_commit_callbacks):
    user = UserFactory()
    with django_capture_on_commit_callbacks(execute=True):
        assert login(user).status_code == 200
    assert len(key_mails(mailoutbox)) == 1


def test_logging_in_again_under_the_same_name_replaces_quietly(mailoutbox, django_capture_on_commit_callbacks):
    user = UserFactory()
    with django_capture_on_commit_callbacks(execute=True):
        login(user, key_name="cli")
    mailoutbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        r = login(user, key_name="cli")
    assert r.status_code == 200 and len(r.json()["replaced_keys"]) == 1
    assert key_mails(mailoutbox) == []


def test_a_refused_log_in_sends_nothing(mailoutbox, django_capture_on_commit_callbacks):
    user = UserFactory()
    enrol(user)
    mailoutbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert login(user, key_name="x", otp_code="000000").status_code == 400
        assert Client().post(LOGIN, {"email": user.email, "password": "wrong"},
                             content_type="application/json").status_code == 400
    assert key_mails(mailoutbox) == []


def test_a_two_factor_log_in_under_a_new_name_tells_the_address(mailoutbox, django_capture_on_commit_callbacks):
    user = UserFactory()
    enrol(user)
    mailoutbox.clear()
    device = AuthenticatorDevice.objects.get(user=user)
    AuthenticatorDevice.objects.filter(pk=device.pk).update(last_t=-1)
    with django_capture_on_commit_callbacks(execute=True):
        assert login(user, key_name="ci", otp_code=f"{totp(device.bin_key):06d}").status_code == 200
    assert len(key_mails(mailoutbox)) == 1


@pytest.mark.parametrize("code", ["000000", "notarecoverycode"])
def test_a_wrong_otp_code_is_answered_on_otp_code(code):
    user = UserFactory()
    enrol(user)
    r = login(user, otp_code=code)
    assert r.status_code == 400
    body = r.json()
    assert list(body) == ["otp_code"] and "not right" in body["otp_code"][0]
