"""Two-factor secrets at rest: the TOTP secret and the recovery codes are Fernet tokens in the database, never the
secret or a code as typed; the migration moved django-otp's readable rows into them and the codes kept working."""
import base64
import importlib

import pytest
from django.apps import apps
from django.db import connection
from django.test import Client
from django_otp.oath import totp
from django_otp.plugins.otp_static.models import StaticDevice, StaticToken
from django_otp.plugins.otp_totp.models import TOTPDevice

from marketplace.models import AuthenticatorDevice, RecoveryCodeDevice
from marketplace.services import two_factor
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple"


@pytest.fixture(autouse=True)
def _no_device_delay(settings):
    settings.OTP_TOTP_THROTTLE_FACTOR = 0
    settings.OTP_STATIC_THROTTLE_FACTOR = 0


def _code(key: bytes) -> str:
    return f"{totp(key):06d}"


def _raw_column(table: str, column: str) -> list[bytes]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {column} FROM {table}")  # noqa: S608 (names written here, no input)
        return [bytes(row[0]) for row in cursor.fetchall()]


def _forms_of(secret: bytes) -> list[bytes]:
    """Every way the secret could be written down: raw, hex (django-otp's), base32 (the apps')."""
    b32 = base64.b32encode(secret)
    return [secret, secret.hex().encode(), secret.hex().upper().encode(), b32, b32.rstrip(b"="), b32.lower()]


def _api_login(email: str, otp_code: str):
    return Client().post("/api/v1/auth/login/", {"email": email, "password": PASSWORD, "otp_code": otp_code},
                         content_type="application/json")


def test_the_totp_secret_and_recovery_codes_are_not_in_the_database_as_they_are():
    user = UserFactory()
    device = two_factor.totp_enrol_start(user=user, password=PASSWORD, client_address=None)
    secret = device.bin_key
    codes = two_factor.totp_enrol_confirm(user=user, device_id=device.pk, code=_code(secret), client_address=None)

    (stored_key,) = _raw_column("marketplace_authenticatordevice", "key_encrypted")
    assert len(secret) == 20 and not any(form in stored_key for form in _forms_of(secret))
    stored_codes = _raw_column("marketplace_recoverycode", "code_encrypted")
    assert len(stored_codes) == two_factor.RECOVERY_CODES
    assert not any(code.encode() in stored or code.upper().encode() in stored
                   for code in codes for stored in stored_codes)
    # django-otp's readable tables are not used at all.
    assert not TOTPDevice.objects.exists() and not StaticToken.objects.exists()

    AuthenticatorDevice.objects.filter(user=user).update(last_t=-1)  # the code above was this step's
    assert _api_login(user.email, _code(secret)).status_code == 200
    assert _api_login(user.email, codes[3]).status_code == 200
    assert _api_login(user.email, codes[3]).status_code == 400  # a recovery code works once
    assert _api_login(user.email, "abcdefgh").status_code == 400


def test_the_migration_encrypts_django_otps_rows_and_they_keep_working():
    user, other = UserFactory(), UserFactory()
    old = TOTPDevice.objects.create(user=user, name="authenticator app", confirmed=True)
    secret = old.bin_key
    static = StaticDevice.objects.create(user=user, name="recovery codes", confirmed=True)
    StaticToken.objects.bulk_create([StaticToken(device=static, token=t) for t in ("aaaa2222", "bbbb3333")])
    TOTPDevice.objects.create(user=other, name="authenticator app", confirmed=False)

    migration = importlib.import_module("marketplace.migrations.0017_two_factor_secrets_encrypted")
    migration.forwards(apps, None)

    assert not TOTPDevice.objects.exists() and not StaticDevice.objects.exists() and not StaticToken.objects.exists()
    moved = AuthenticatorDevice.objects.get(user=user)
    assert moved.confirmed and moved.bin_key == secret
    assert not any(form in bytes(moved.key_encrypted) for form in _forms_of(secret))
    assert AuthenticatorDevice.objects.get(user=other).confirmed is False
    assert not two_factor.two_factor_enabled(user=other)
    assert RecoveryCodeDevice.objects.get(user=user).codes.count() == 2
    assert all(b"aaaa2222" not in raw for raw in _raw_column("marketplace_recoverycode", "code_encrypted"))

    assert two_factor.two_factor_enabled(user=user) and two_factor.recovery_codes_left(user=user) == 2
    assert _api_login(user.email, "").status_code == 400  # still asks for the code
    assert _api_login(user.email, _code(secret)).status_code == 200
    assert _api_login(user.email, "AAAA-2222").status_code == 200
    assert two_factor.recovery_codes_left(user=user) == 1
