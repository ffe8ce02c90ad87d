"""An API log-in refused at the API key cap (409) must not use up its two-factor code (review r46a, finding 1).

The code was checked, and used up (a recovery code deleted, the authenticator's time step moved on), in a
transaction of its own before api_key_rotate refused: a user at API_KEYS_PER_USER_MAX lost a recovery code per try.
Now the code is spent in the key's transaction (two_factor.code_spent): the refusal rolls it back. A code still works
once, also when two log-ins send it at the same time.
"""
import threading

import pytest
from django.db import connection
from django.test import Client
from django_otp.oath import totp

from marketplace.models import AuthenticatorDevice
from marketplace.services import two_factor
from marketplace.services.accounts import api_key_create
from tests.factories import UserFactory

PASSWORD = "correct horse battery staple"  # what UserFactory sets
LOGIN = "/api/v1/auth/login/"


@pytest.fixture(autouse=True)
def _no_device_delay(settings):
    settings.OTP_TOTP_THROTTLE_FACTOR = 0
    settings.OTP_STATIC_THROTTLE_FACTOR = 0


def _two_factor_user():
    user = UserFactory()
    device = two_factor.totp_enrol_start(user=user, password=PASSWORD, client_address=None)
    codes = two_factor.totp_enrol_confirm(user=user, device_id=device.pk, code=f"{totp(device.bin_key):06d}",
                                          client_address=None)
    # The enrolment used the current time step: let the log-ins below use it again.
    AuthenticatorDevice.objects.filter(pk=device.pk).update(last_t=-1)
    device.refresh_from_db()
    return user, device, codes


def _login(user, code, key_name="login"):
    return Client().post(LOGIN, {"email": user.email, "password": PASSWORD, "otp_code": code, "key_name": key_name},
                         content_type="application/json")


@pytest.mark.django_db
def test_api_login_refused_at_the_key_cap_does_not_use_up_the_recovery_code(settings):
    settings.API_KEYS_PER_USER_MAX = 2
    user, _device, codes = _two_factor_user()
    keys = [api_key_create(user=user, name=f"k{i}")[0] for i in range(2)]
    before = two_factor.recovery_codes_left(user=user)
    answer = _login(user, codes[0])
    assert answer.status_code == 409, answer.content
    assert two_factor.recovery_codes_left(user=user) == before
    # The same code works once room is made, and then never again.
    keys[0].revoked_at = keys[0].created_at
    keys[0].save(update_fields=["revoked_at"])
    assert _login(user, codes[0]).status_code == 200
    assert two_factor.recovery_codes_left(user=user) == before - 1
    assert _login(user, codes[0], key_name="other").status_code == 400


@pytest.mark.django_db
def test_api_login_refused_at_the_key_cap_does_not_burn_the_authenticator_code(settings):
    settings.API_KEYS_PER_USER_MAX = 1
    user, device, _codes = _two_factor_user()
    key, _raw = api_key_create(user=user, name="held")
    code = f"{totp(device.bin_key):06d}"
    assert _login(user, code).status_code == 409
    device.refresh_from_db()
    assert device.last_t == -1  # the time step is not used
    key.revoked_at = key.created_at
    key.save(update_fields=["revoked_at"])
    assert _login(user, code).status_code == 200
    # Replay protection is intact: the code's time step is used now.
    assert _login(user, code, key_name="other").status_code == 400


def _at_once(user, code) -> list:
    """Two API log-ins with `code`, started together: their status codes."""
    barrier = threading.Barrier(2)
    statuses: list = [None, None]

    def worker(i):
        try:
            barrier.wait(timeout=10)
            statuses[i] = _login(user, code, key_name=f"parallel {code} {i}").status_code
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return statuses


@pytest.mark.django_db(transaction=True)
def test_two_log_ins_at_once_with_the_same_code_make_one_key():
    """The device rows stay locked until the key's transaction ends: the second log-in waits and finds the code
    used (real threads, real PostgreSQL)."""
    user, device, codes = _two_factor_user()
    for code in (f"{totp(device.bin_key):06d}", codes[1]):
        statuses = _at_once(user, code)
        assert sorted(statuses) == [200, 400], (code, statuses)
