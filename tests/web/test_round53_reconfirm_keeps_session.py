"""A password typed again in a logged-in session (SSH keys, API keys, turning two-factor on, ...) is only compared,
never re-hashed: after a password-hasher upgrade, user.check_password saved a new hash, which changed the session
auth hash and logged out every session of the account, the one that typed the password too (review r53)."""
import pytest
from django.test import Client
from django_otp.oath import totp

from marketplace.models import AuthenticatorDevice, SshKey, User
from marketplace.services import passwords
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import ed25519_key
from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db

# The tests store hashes with MD5 (config/settings/test.py); PBKDF2 first makes every stored hash out of date, as a
# Django upgrade that raises PBKDF2's iterations does.
UPGRADED = ["django.contrib.auth.hashers.PBKDF2PasswordHasher", "django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def user_and_client(settings):
    settings.OTP_TOTP_THROTTLE_FACTOR = 0
    user = UserFactory()
    client = Client()
    client.force_login(user)
    settings.PASSWORD_HASHERS = UPGRADED
    return user, client


def test_saving_an_ssh_key_after_a_hasher_upgrade_keeps_the_session(user_and_client):
    user, client = user_and_client
    stored = user.password
    r = client.post("/account/ssh-keys/", {"name": "laptop", "public_key": ed25519_key(), "password": PASSWORD})
    assert r.status_code == 302 and SshKey.objects.filter(user=user).count() == 1
    assert client.get("/account/ssh-keys/").status_code == 200  # still logged in
    assert User.objects.get(pk=user.pk).password == stored  # compared, not re-hashed


def test_making_an_api_key_after_a_hasher_upgrade_keeps_the_session(user_and_client):
    _user, client = user_and_client
    r = client.post("/account/api-keys/", {"name": "ci", "scopes": ["read"], "expires_in_days": "30",
                                           "password": PASSWORD})
    assert r.status_code == 200 and "gpm_" in r.content.decode()
    assert client.get("/account/api-keys/").status_code == 200


def test_two_factor_enrolment_survives_a_hasher_upgrade(user_and_client):
    user, client = user_and_client
    r = client.post("/account/two-factor/enable/", {"password": PASSWORD})
    assert r.status_code == 200 and b"otpauth://" in r.content
    device = AuthenticatorDevice.objects.get(user=user, confirmed=False)
    r = client.post("/account/two-factor/confirm/", {"code": f"{totp(device.bin_key):06d}", "enrolment": device.pk})
    assert r.status_code == 200  # before: a 302 to the log-in page, then a 405 on the confirm view
    assert AuthenticatorDevice.objects.get(pk=device.pk).confirmed


def test_the_service_check_compares_without_saving(user_and_client):
    user, _client = user_and_client
    stored = user.password
    assert passwords.password_check(user=user, password=PASSWORD, client_address=None)
    assert not passwords.password_check(user=user, password="wrong", client_address=None)
    assert User.objects.get(pk=user.pk).password == stored and user.password == stored


def test_a_real_log_in_still_upgrades_the_hash(user_and_client):
    user, _client = user_and_client
    client = Client()
    assert client.post("/accounts/login/", {"username": user.email, "password": PASSWORD}).status_code == 302
    assert User.objects.get(pk=user.pk).password.startswith("pbkdf2_")
    assert client.get("/account/security/").status_code == 200
