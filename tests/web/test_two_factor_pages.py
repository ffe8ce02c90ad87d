"""Optional two-factor log-in (TOTP, recovery codes): enrol with a code, the log-in's code step on the pages, the
API and the admin, code guessing behind the log-in lock-out, turning it off with the password and a code."""
import base64
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from django_otp.oath import totp

from core.errors import ValidationFailed
from marketplace.models import AuthenticatorDevice
from marketplace.services import two_factor
from tests.factories import UserFactory
from tests.web.conftest import PASSWORD, logged_in

pytestmark = pytest.mark.django_db

ENABLE = "/account/two-factor/enable/"
DISABLE = "/account/two-factor/disable/"
LOGIN = "/accounts/login/"
CODE = "/accounts/login/code/"


@pytest.fixture(autouse=True)
def _no_device_delay(settings):
    """django-otp's own delay after a wrong code (seconds, doubling) is turned off here, to show the lock-out."""
    settings.OTP_TOTP_THROTTLE_FACTOR = 0
    settings.OTP_STATIC_THROTTLE_FACTOR = 0


def code_now(user) -> str:
    """The app's current code. A TOTP code works once per 30-s step, so the step already used is forgotten."""
    device = AuthenticatorDevice.objects.get(user=user)
    AuthenticatorDevice.objects.filter(pk=device.pk).update(last_t=-1)
    return f"{totp(device.bin_key, step=device.step, t0=device.t0, digits=device.digits):06d}"


def enrol(user) -> list[str]:
    device = two_factor.totp_enrol_start(user=user)
    return two_factor.totp_enrol_confirm(user=user, device_id=device.pk, code=code_now(user), password=PASSWORD,
                                         client_address=None)


def password_step(client, user, **extra):
    return client.post(LOGIN, {"username": user.email, "password": PASSWORD, **extra})


def is_logged_in(client) -> bool:
    return client.get("/account/security/").status_code == 200


def test_enrol_shows_the_secret_uri_and_qr_then_the_recovery_codes_once(web, renter):
    page = web.get(ENABLE)
    html = page.content.decode()
    assert page.status_code == 200 and "no-store" in page["Cache-Control"]
    secret = re.search(r'id="totp-secret" class="mono">([A-Z2-7]+)<', html).group(1)
    uri = re.search(r'id="totp-uri" class="mono">([^<]+)<', html).group(1)
    assert uri.startswith("otpauth://totp/gpumarket%3Arenter%40example.com?") and f"secret={secret}" in uri
    assert "<svg" in html and "<path" in html
    assert f'id="totp-secret" class="mono">{secret}<' in web.get(ENABLE).content.decode()  # kept until confirmed

    wrong = web.post(ENABLE, {"password": PASSWORD, "code": "000000"})
    assert wrong.status_code == 400 and "not right" in wrong.content.decode()
    assert web.post(ENABLE, {"password": PASSWORD, "code": ""}).status_code == 400
    # The right code without the password (a session alone, e.g. a copied cookie, must not turn it on: that ends
    # every other session and would lock the owner out)
    assert web.post(ENABLE, {"code": code_now(renter)}).status_code == 400
    no = web.post(ENABLE, {"password": "not it", "code": code_now(renter)})
    assert no.status_code == 400 and "password was entered incorrectly" in no.content.decode()
    assert not two_factor.two_factor_enabled(user=renter)

    done = web.post(ENABLE, {"password": PASSWORD, "code": code_now(renter)})
    codes = re.findall(r"<li>([a-z0-9]+)</li>", done.content.decode())
    assert done.status_code == 200 and len(codes) == two_factor.RECOVERY_CODES and "no-store" in done["Cache-Control"]
    assert two_factor.two_factor_enabled(user=renter)
    security = web.get("/account/security/").content.decode()
    assert "10 recovery codes left" in security and codes[0] not in security
    assert web.get(ENABLE)["Location"] == "/account/security/"  # on already


def test_turning_it_on_keeps_this_session_and_ends_the_others(renter):
    here, elsewhere, untouched = logged_in(renter), logged_in(renter), logged_in(UserFactory())
    assert is_logged_in(elsewhere)
    here.get(ENABLE)
    assert here.post(ENABLE, {"password": PASSWORD, "code": code_now(renter)}).status_code == 200
    assert is_logged_in(here) and not is_logged_in(elsewhere) and is_logged_in(untouched)
    # The session that ended logs in again as any other: password, then code.
    assert password_step(elsewhere, renter)["Location"] == CODE
    assert elsewhere.post(CODE, {"code": code_now(renter)}).status_code == 302 and is_logged_in(elsewhere)


def test_after_it_a_password_change_still_keeps_this_session_and_ends_the_others(renter):
    here = logged_in(renter)
    here.get(ENABLE)
    here.post(ENABLE, {"password": PASSWORD, "code": code_now(renter)})
    elsewhere = logged_in(renter)  # logged in after two-factor went on
    new = "a brand new passphrase 7"
    r = here.post("/account/password/", {"old_password": PASSWORD, "new_password1": new, "new_password2": new})
    assert r.status_code == 302 and is_logged_in(here) and not is_logged_in(elsewhere)


def test_a_wrong_code_ends_no_session(renter):
    here, elsewhere = logged_in(renter), logged_in(renter)
    here.get(ENABLE)
    assert here.post(ENABLE, {"password": PASSWORD, "code": "000000"}).status_code == 400
    assert is_logged_in(here) and is_logged_in(elsewhere)


def test_a_new_secret_replaces_the_unconfirmed_one(web, renter):
    first = secret_on(web.get(ENABLE))
    assert web.post("/account/two-factor/restart/").status_code == 302
    second = secret_on(web.get(ENABLE))
    assert second != first and AuthenticatorDevice.objects.filter(user=renter).count() == 1
    assert web.post(ENABLE, {"password": PASSWORD, "code": code_now(renter)}).status_code == 200  # the new one
    assert two_factor.two_factor_enabled(user=renter)


# --- the secret is the session's that was shown it, for ENROL_TIMEOUT (a copied cookie must not learn it) ---------

def secret_on(page) -> str:
    return re.search(r'id="totp-secret" class="mono">([A-Z2-7]+)<', page.content.decode()).group(1)


def code_for(secret: str) -> str:
    key = base64.b32decode(secret + "=" * (-len(secret) % 8))
    return f"{totp(key, step=30, t0=0, digits=6):06d}"


def test_a_secret_another_session_saw_is_never_the_one_turned_on(renter):
    """The reviewer's case: a thief with a copied cookie opens the page first; the owner, later, in their own
    browser, is shown a secret of their own, and the thief's copy never gives a code that logs in."""
    thief = logged_in(renter)
    seen_by_thief = secret_on(thief.get(ENABLE))
    owner = logged_in(renter)
    shown_to_owner = secret_on(owner.get(ENABLE))
    assert shown_to_owner != seen_by_thief
    assert secret_on(owner.get(ENABLE)) == shown_to_owner  # kept for this session while it waits

    done = owner.post(ENABLE, {"password": PASSWORD, "code": code_for(shown_to_owner)})
    assert done.status_code == 200 and two_factor.two_factor_enabled(user=renter)
    assert two_factor.secret_base32(AuthenticatorDevice.objects.get(user=renter, confirmed=True)) == shown_to_owner
    assert not is_logged_in(thief)
    # The thief's secret is gone: its codes are not the account's.
    assert password_step(thief, renter)["Location"] == CODE
    assert thief.post(CODE, {"code": code_for(seen_by_thief)}).status_code == 400 and not is_logged_in(thief)


def test_a_session_cannot_confirm_a_secret_another_session_was_shown(renter):
    """Even with the password and a right code for it (the owner typed the code, the thief read it): another
    session's secret is refused with a clear error and a new secret of this session's own."""
    owner, other = logged_in(renter), logged_in(renter)
    owners = secret_on(owner.get(ENABLE))
    r = other.post(ENABLE, {"password": PASSWORD, "code": code_for(owners)})
    page = r.content.decode()
    assert r.status_code == 400 and "expired or was replaced" in page
    fresh = secret_on(r)
    assert fresh != owners and not two_factor.two_factor_enabled(user=renter)
    # The owner's secret was replaced meanwhile: the owner is told so, and shown a new one, which works.
    r = owner.post(ENABLE, {"password": PASSWORD, "code": code_for(owners)})
    assert r.status_code == 400 and "expired or was replaced" in r.content.decode()
    newest = secret_on(r)
    assert newest not in (owners, fresh) and AuthenticatorDevice.objects.filter(user=renter).count() == 1
    assert owner.post(ENABLE, {"password": PASSWORD, "code": code_for(newest)}).status_code == 200
    assert two_factor.two_factor_enabled(user=renter)


def test_a_session_that_never_opened_the_page_cannot_confirm(renter):
    web = logged_in(renter)
    device = two_factor.totp_enrol_start(user=renter)  # a secret no session of this test was shown
    r = web.post(ENABLE, {"password": PASSWORD, "code": code_for(two_factor.secret_base32(device))})
    assert r.status_code == 400 and "expired or was replaced" in r.content.decode()
    assert not two_factor.two_factor_enabled(user=renter)


def test_a_pending_secret_expires(web, renter):
    first = secret_on(web.get(ENABLE))
    waited = timezone.now() - two_factor.ENROL_TIMEOUT - timedelta(seconds=1)
    AuthenticatorDevice.objects.filter(user=renter).update(created_at=waited)
    r = web.post(ENABLE, {"password": PASSWORD, "code": code_for(first)})
    assert r.status_code == 400 and "expired or was replaced" in r.content.decode()
    second = secret_on(r)
    assert second != first and not two_factor.two_factor_enabled(user=renter)
    assert AuthenticatorDevice.objects.filter(user=renter).count() == 1  # the expired one is gone
    # Just before the end it still works.
    almost = timezone.now() - two_factor.ENROL_TIMEOUT + timedelta(seconds=30)
    AuthenticatorDevice.objects.filter(user=renter).update(created_at=almost)
    assert secret_on(web.get(ENABLE)) == second
    assert web.post(ENABLE, {"password": PASSWORD, "code": code_for(second)}).status_code == 200
    assert two_factor.two_factor_enabled(user=renter)


def test_an_expired_secret_is_replaced_when_the_page_is_opened_again(web, renter):
    first = secret_on(web.get(ENABLE))
    AuthenticatorDevice.objects.filter(user=renter).update(
        created_at=timezone.now() - two_factor.ENROL_TIMEOUT - timedelta(seconds=1))
    assert secret_on(web.get(ENABLE)) != first


def test_the_service_confirms_only_the_secret_named_while_it_lasts(renter):
    first = two_factor.totp_enrol_start(user=renter)
    second = two_factor.totp_enrol_start(user=renter)  # another session: a new secret in place of the first
    assert second.pk != first.pk and not AuthenticatorDevice.objects.filter(pk=first.pk).exists()
    assert two_factor.totp_enrol_start(user=renter, device_id=second.pk).pk == second.pk
    for device_id in (first.pk, None, "1", True):
        with pytest.raises(ValidationFailed) as gone:
            two_factor.totp_enrol_confirm(user=renter, device_id=device_id, code=code_now(renter),
                                          password=PASSWORD, client_address=None)
        assert gone.value.field == "code" and gone.value.message == two_factor.ENROL_GONE
    other = UserFactory()
    with pytest.raises(ValidationFailed):  # another user's pending secret
        two_factor.totp_enrol_confirm(user=other, device_id=second.pk, code=code_now(renter), password=PASSWORD,
                                      client_address=None)
    AuthenticatorDevice.objects.filter(pk=second.pk).update(
        created_at=timezone.now() - two_factor.ENROL_TIMEOUT - timedelta(seconds=1))
    with pytest.raises(ValidationFailed):
        two_factor.totp_enrol_confirm(user=renter, device_id=second.pk, code=code_now(renter), password=PASSWORD,
                                      client_address=None)
    assert not two_factor.two_factor_enabled(user=renter)


def test_log_in_asks_for_the_code_after_the_password(client, renter):
    enrol(renter)
    r = password_step(client, renter, next="/instances/")
    assert r.status_code == 302 and r["Location"] == CODE
    assert not is_logged_in(client)
    assert "Enter your code" in client.get(CODE).content.decode()
    wrong = client.post(CODE, {"code": "123456"})
    assert wrong.status_code == 400 and "not right" in wrong.content.decode() and not is_logged_in(client)
    ok = client.post(CODE, {"code": code_now(renter)})
    assert ok.status_code == 302 and ok["Location"] == "/instances/"
    assert is_logged_in(client)


def test_a_wrong_password_never_reaches_the_code_step(client, renter):
    enrol(renter)
    r = client.post(LOGIN, {"username": renter.email, "password": "wrong"})
    assert r.status_code == 200 and client.get(CODE)["Location"] == LOGIN


def test_a_recovery_code_works_once(client, renter):
    codes = enrol(renter)
    password_step(client, renter)
    assert client.post(CODE, {"code": codes[0].upper()}).status_code == 302
    other = Client()
    password_step(other, renter)
    assert other.post(CODE, {"code": codes[0]}).status_code == 400
    assert two_factor.recovery_codes_left(user=renter) == two_factor.RECOVERY_CODES - 1


def test_guessing_codes_locks_the_code_step_and_a_new_password_step_does_not_reset_it(client, renter, settings):
    enrol(renter)
    password_step(client, renter)
    for n in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        if n == 2:
            assert password_step(client, renter)["Location"] == CODE  # a right password again: no fresh budget
        assert client.post(CODE, {"code": f"{n:06d}"}).status_code == 400
    r = client.post(CODE, {"code": code_now(renter)})
    assert r.status_code == 429 and "Too many failed" in r.content.decode() and int(r["Retry-After"]) > 0
    assert not is_logged_in(client)


def test_the_code_step_expires(client, renter, settings):
    enrol(renter)
    password_step(client, renter)
    settings.TWO_FACTOR_LOGIN_TIMEOUT_S = -1
    r = client.post(CODE, {"code": code_now(renter)})
    assert r.status_code == 302 and r["Location"] == LOGIN and not is_logged_in(client)


def test_the_code_step_refuses_an_outside_next(client, renter):
    enrol(renter)
    password_step(client, renter, next="https://evil.example/")
    assert client.post(CODE, {"code": code_now(renter)})["Location"] == "/"


@pytest.mark.parametrize("next_url", ["ssh-key-delete", "home", "account-security"])
def test_a_next_that_is_a_bare_word_is_a_path_never_a_url_name(client, renter, next_url):
    """redirect() reversed it as a URL name: NoReverseMatch, a 500 after the code was used up."""
    enrol(renter)
    password_step(client, renter, next=next_url)
    r = client.post(CODE, {"code": code_now(renter)})
    assert r.status_code == 302 and r["Location"] == next_url and is_logged_in(client)


def test_turning_it_off_needs_the_password_and_a_code(renter):
    enrol(renter)
    web = logged_in(renter)
    assert web.get(DISABLE).status_code == 200
    no_code = web.post(DISABLE, {"password": PASSWORD, "code": ""})
    assert no_code.status_code == 400 and 'id="id_code_errors"' in no_code.content.decode()
    bad_password = web.post(DISABLE, {"password": "nope", "code": code_now(renter)})
    assert bad_password.status_code == 400 and "incorrectly" in bad_password.content.decode()
    bad_code = web.post(DISABLE, {"password": PASSWORD, "code": "999999"})
    assert bad_code.status_code == 400 and "not right" in bad_code.content.decode()
    assert two_factor.two_factor_enabled(user=renter)
    assert web.post(DISABLE, {"password": PASSWORD, "code": code_now(renter)})["Location"] == "/account/security/"
    assert not two_factor.two_factor_enabled(user=renter)
    assert password_step(Client(), renter)["Location"] == "/"


def test_new_recovery_codes_replace_the_old(renter, mailoutbox, django_capture_on_commit_callbacks):
    old = enrol(renter)
    web = logged_in(renter)
    # A session alone (a copied cookie) makes no codes: they log in as the account
    refused = web.post("/account/two-factor/recovery-codes/")
    assert refused.status_code == 400 and 'id="id_password_errors"' in refused.content.decode()
    wrong = web.post("/account/two-factor/recovery-codes/", {"password": "not it"})
    assert wrong.status_code == 400 and "password was entered incorrectly" in wrong.content.decode()
    assert two_factor.recovery_codes_left(user=renter) == two_factor.RECOVERY_CODES and not mailoutbox
    with django_capture_on_commit_callbacks(execute=True):
        r = web.post("/account/two-factor/recovery-codes/", {"password": PASSWORD})
    new = re.findall(r"<li>([a-z0-9]+)</li>", r.content.decode())
    assert len(new) == two_factor.RECOVERY_CODES and not set(new) & set(old)
    assert mailoutbox[-1].subject.endswith("New two-factor recovery codes were made")
    client = Client()
    password_step(client, renter)
    assert client.post(CODE, {"code": old[1]}).status_code == 400
    assert client.post(CODE, {"code": new[1]}).status_code == 302


def test_the_api_log_in_needs_the_code_too(client, renter):
    enrol(renter)
    url = "/api/v1/auth/login/"
    body = {"email": renter.email, "password": PASSWORD}
    r = client.post(url, body, content_type="application/json")
    assert r.status_code == 400 and "otp_code" in r.json()
    r = client.post(url, {**body, "otp_code": "000000"}, content_type="application/json")
    assert r.status_code == 400 and "otp_code" not in r.json() and "code" in r.json()
    r = client.post(url, {**body, "otp_code": code_now(renter)}, content_type="application/json")
    assert r.status_code == 200 and r.json()["api_key"].startswith("gpm_")


def test_the_admin_log_in_sends_two_factor_accounts_to_the_sites(client, operator):
    enrol(operator)
    r = client.post("/admin/login/", {"username": operator.email, "password": PASSWORD, "next": "/admin/"})
    assert r.status_code == 200 and "two-factor" in r.content.decode()
    assert client.get("/admin/").status_code == 302
    password_step(client, operator, next="/admin/")
    assert client.post(CODE, {"code": code_now(operator)})["Location"] == "/admin/"
    assert client.get("/admin/").status_code == 200


def test_operators_never_see_the_secrets_and_can_turn_two_factor_off(renter, operator):
    enrol(renter)
    admin = logged_in(operator)
    assert admin.get("/admin/otp_totp/totpdevice/").status_code == 404
    assert admin.get("/admin/otp_static/staticdevice/").status_code == 404
    r = admin.post("/admin/marketplace/user/", {"action": "turn_off_two_factor", "_selected_action": [renter.pk]})
    assert r.status_code == 302 and not two_factor.two_factor_enabled(user=renter)
