"""Optional two-factor log-in (TOTP, recovery codes): enrol (the password, then the secret shown once, then a code),
the log-in's code step on the pages, the API and the admin, code guessing behind the log-in lock-out, turning it
off with the password and a code."""
import base64
import re
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.test import Client
from django.utils import timezone
from django_otp.oath import totp

from core.errors import Conflict, ValidationFailed
from core.login_throttle import LoginLocked
from marketplace.models import AuthenticatorDevice
from marketplace.services import two_factor
from tests.factories import UserFactory
from tests.web.conftest import PASSWORD, logged_in

pytestmark = pytest.mark.django_db

ENABLE = "/account/two-factor/enable/"
CONFIRM = "/account/two-factor/confirm/"
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
    device = two_factor.totp_enrol_start(user=user, password=PASSWORD, client_address=None)
    return two_factor.totp_enrol_confirm(user=user, device_id=device.pk, code=code_now(user), client_address=None)


def password_step(client, user, **extra):
    return client.post(LOGIN, {"username": user.email, "password": PASSWORD, **extra})


def is_logged_in(client) -> bool:
    return client.get("/account/security/").status_code == 200


def secret_on(page) -> str:
    return re.search(r'id="totp-secret" class="mono">([A-Z2-7]+)<', page.content.decode()).group(1)


def shows_no_secret(page, *secrets: str) -> bool:
    html = page.content.decode()
    return ("totp-secret" not in html and "otpauth" not in html and "<svg" not in html
            and not any(secret in html for secret in secrets))


def code_for(secret: str) -> str:
    key = base64.b32decode(secret + "=" * (-len(secret) % 8))
    return f"{totp(key, step=30, t0=0, digits=6):06d}"


def start(client, password: str = PASSWORD):
    return client.post(ENABLE, {"password": password})


def confirm(client, code: str, page=None):
    """The code form's post; `page`: the page it is on (its hidden enrolment id), else none (as a script)."""
    data = {"code": code}
    if page is not None:
        data["enrolment"] = re.search(r'name="enrolment" value="(\d+)"', page.content.decode()).group(1)
    return client.post(CONFIRM, data)


def copy_of(client) -> Client:
    """Another browser holding a copy of `client`'s session cookie: the same session, as the server sees it."""
    copy = Client()
    copy.cookies[django_settings.SESSION_COOKIE_NAME] = client.cookies[django_settings.SESSION_COOKIE_NAME].value
    return copy


def test_enrol_asks_the_password_then_shows_the_secret_once_then_the_recovery_codes(web, renter):
    page = web.get(ENABLE)
    assert page.status_code == 200 and "no-store" in page["Cache-Control"] and shows_no_secret(page)
    assert 'name="password"' in page.content.decode() and not AuthenticatorDevice.objects.filter(user=renter).exists()
    no = start(web, "")
    assert no.status_code == 400 and shows_no_secret(no)
    no = start(web, "not it")
    assert no.status_code == 400 and "password was entered incorrectly" in no.content.decode() and shows_no_secret(no)
    assert not AuthenticatorDevice.objects.filter(user=renter).exists()

    shown = start(web)
    html = shown.content.decode()
    assert shown.status_code == 200 and "no-store" in shown["Cache-Control"]
    secret = secret_on(shown)
    uri = re.search(r'id="totp-uri" class="mono">([^<]+)<', html).group(1)
    assert uri.startswith("otpauth://totp/gpumarket%3Arenter%40example.com?") and f"secret={secret}" in uri
    assert "<svg" in html and "<path" in html
    assert two_factor.secret_base32(AuthenticatorDevice.objects.get(user=renter, confirmed=False)) == secret
    # Never again: not on the page opened again, nor after a wrong or empty code (a copy of the cookie could post
    # one to read it).
    again = web.get(ENABLE)
    assert again.status_code == 200 and shows_no_secret(again, secret)
    wrong = confirm(web, "000000", shown)
    assert wrong.status_code == 400 and "not right" in wrong.content.decode() and shows_no_secret(wrong, secret)
    assert 'name="code"' in wrong.content.decode() and "Start again" in wrong.content.decode()
    empty = confirm(web, "", shown)
    assert empty.status_code == 400 and shows_no_secret(empty, secret)
    assert not two_factor.two_factor_enabled(user=renter)

    done = confirm(web, code_for(secret), wrong)  # the code form shown again after a wrong code works
    codes = re.findall(r"<li>([a-z0-9]+)</li>", done.content.decode())
    assert done.status_code == 200 and len(codes) == two_factor.RECOVERY_CODES and "no-store" in done["Cache-Control"]
    assert two_factor.two_factor_enabled(user=renter) and shows_no_secret(done, secret)
    assert two_factor.secret_base32(two_factor.totp_confirmed(user=renter)) == secret
    security = web.get("/account/security/").content.decode()
    assert "10 recovery codes left" in security and codes[0] not in security
    assert web.get(ENABLE)["Location"] == "/account/security/"  # on already
    assert start(web)["Location"] == "/account/security/"
    assert confirm(web, code_now(renter))["Location"] == "/account/security/"


def test_turning_it_on_keeps_this_session_and_ends_the_others(renter):
    here, elsewhere, untouched = logged_in(renter), logged_in(renter), logged_in(UserFactory())
    assert is_logged_in(elsewhere)
    start(here)
    assert confirm(here, code_now(renter)).status_code == 200
    assert is_logged_in(here) and not is_logged_in(elsewhere) and is_logged_in(untouched)
    # The session that ended logs in again as any other: password, then code.
    assert password_step(elsewhere, renter)["Location"] == CODE
    assert elsewhere.post(CODE, {"code": code_now(renter)}).status_code == 302 and is_logged_in(elsewhere)


def test_after_it_a_password_change_still_keeps_this_session_and_ends_the_others(renter):
    here = logged_in(renter)
    start(here)
    confirm(here, code_now(renter))
    elsewhere = logged_in(renter)  # logged in after two-factor went on
    new = "a brand new passphrase 7"
    r = here.post("/account/password/", {"old_password": PASSWORD, "new_password1": new, "new_password2": new})
    assert r.status_code == 302 and is_logged_in(here) and not is_logged_in(elsewhere)


def test_a_wrong_code_ends_no_session(renter):
    here, elsewhere = logged_in(renter), logged_in(renter)
    start(here)
    assert confirm(here, "000000").status_code == 400
    assert is_logged_in(here) and is_logged_in(elsewhere)


def test_starting_again_replaces_the_unconfirmed_secret_and_an_older_tab_is_told_so(web, renter):
    """Two tabs of one browser: the second start replaces the first's secret; the first tab's code is refused as
    replaced (start again), not as a wrong code, and shows no secret."""
    tab1 = start(web)
    tab2 = start(web)
    first, second = secret_on(tab1), secret_on(tab2)
    assert second != first and AuthenticatorDevice.objects.filter(user=renter).count() == 1
    r = confirm(web, code_for(first), tab1)
    assert r.status_code == 400 and "newer one was made" in r.content.decode() and shows_no_secret(r, first, second)
    assert 'name="password"' in r.content.decode()  # start again: the password
    assert confirm(web, code_for(second), tab2).status_code == 200  # the newer one still works
    assert two_factor.secret_base32(two_factor.totp_confirmed(user=renter)) == second


# --- the secret is shown only to whoever proves the password, once (a copied cookie must not learn it) ------------

@pytest.mark.parametrize("thief_first", [True, False])
def test_a_copied_cookie_never_sees_the_secret_the_owner_turns_on(renter, thief_first):
    """The reviewer's case: the thief holds a copy of the owner's session cookie (the same session, not one of its
    own), taken before the owner turns two-factor on or after the owner's password, and opens the enable page
    before the owner does, or after; nothing the copy does without the password shows a secret or replaces the
    owner's, and the secret the owner turns on is in no answer the copy gets."""
    owner = logged_in(renter)
    early = copy_of(owner)
    assert is_logged_in(early)
    seen_by_thief = []

    def thief_tries(thief):
        seen_by_thief.extend([thief.get(ENABLE), confirm(thief, "123456"), start(thief, "guess")])

    if thief_first:
        thief_tries(early)
    shown = start(owner)
    secret = secret_on(shown)
    late = copy_of(owner)  # a copy taken after the password: the same session as the owner's now
    assert is_logged_in(late) and not is_logged_in(early)  # the start moved the session to a new key
    thief_tries(late)
    if not thief_first:
        thief_tries(early)
    pending = AuthenticatorDevice.objects.get(user=renter)
    assert not pending.confirmed and two_factor.secret_base32(pending) == secret  # none of it replaced it
    done = confirm(owner, code_for(secret), shown)
    assert done.status_code == 200 and two_factor.two_factor_enabled(user=renter)
    assert two_factor.secret_base32(two_factor.totp_confirmed(user=renter)) == secret
    assert is_logged_in(owner) and not is_logged_in(late)  # turning it on moved the session to a new key again
    assert seen_by_thief and all(shows_no_secret(page, secret) for page in seen_by_thief)
    # With the password (phished, reused) the thief reaches the code step, and has no code.
    assert password_step(late, renter)["Location"] == CODE


def test_proving_the_password_logs_out_a_copy_of_the_cookie_made_before(renter):
    owner = logged_in(renter)
    thief = copy_of(owner)
    start(owner)
    assert is_logged_in(owner) and not is_logged_in(thief)


def test_another_session_cannot_disturb_the_owners_enrolment(renter):
    """Opening the page or posting codes in another session (without the password) replaces nothing."""
    owner, other = logged_in(renter), logged_in(renter)
    shown = start(owner)
    secret = secret_on(shown)
    assert other.get(ENABLE).status_code == 200
    r = confirm(other, code_for(secret), shown)  # even with the right code: it started nothing
    assert r.status_code == 400 and "can no longer be turned on" in r.content.decode() and shows_no_secret(r, secret)
    assert not two_factor.two_factor_enabled(user=renter)
    assert confirm(owner, code_for(secret), shown).status_code == 200
    assert two_factor.secret_base32(two_factor.totp_confirmed(user=renter)) == secret


def test_a_wrong_password_is_refused_and_counts_in_the_log_in_lock_out(web, renter, settings):
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        r = start(web, "not it")
        assert r.status_code == 400 and shows_no_secret(r)
    r = start(web)  # the right password too, while locked
    assert r.status_code == 429 and int(r["Retry-After"]) > 0 and "Too many failed" in r.content.decode()
    assert shows_no_secret(r) and not AuthenticatorDevice.objects.filter(user=renter).exists()
    # The same lock-out as the log-in's: the account's log-in is locked too.
    assert "Too many failed" in password_step(Client(), renter).content.decode()


def test_wrong_enrolment_codes_count_in_the_log_in_lock_out(web, renter, settings):
    """Guessing the code would turn two-factor on and show the recovery codes: bounded like the log-in's."""
    shown = start(web)
    for n in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        assert confirm(web, f"{n:06d}", shown).status_code == 400
    r = confirm(web, code_for(secret_on(shown)), shown)
    assert r.status_code == 429 and int(r["Retry-After"]) > 0 and shows_no_secret(r, secret_on(shown))
    assert not two_factor.two_factor_enabled(user=renter)


def test_a_session_that_never_started_cannot_confirm(renter):
    web = logged_in(renter)
    device = two_factor.totp_enrol_start(user=renter, password=PASSWORD, client_address=None)  # not this session's
    r = confirm(web, code_for(two_factor.secret_base32(device)))
    assert r.status_code == 400 and "can no longer be turned on" in r.content.decode()
    assert not two_factor.two_factor_enabled(user=renter)


def test_a_pending_secret_expires(web, renter):
    shown = start(web)
    first = secret_on(shown)
    waited = timezone.now() - two_factor.ENROL_TIMEOUT - timedelta(seconds=1)
    AuthenticatorDevice.objects.filter(user=renter).update(created_at=waited)
    r = confirm(web, code_for(first), shown)
    html = r.content.decode()
    assert r.status_code == 400 and "can no longer be turned on" in html and "15 minutes" in html
    assert shows_no_secret(r, first) and not two_factor.two_factor_enabled(user=renter)
    assert re.search(rf'<form method="post" action="{ENABLE}"[^>]*>.*name="password"', html, re.S)  # its form
    # Start again: a new secret in place of the expired one, which works until just before its end.
    shown = start(web)
    second = secret_on(shown)
    assert second != first and AuthenticatorDevice.objects.filter(user=renter).count() == 1
    almost = timezone.now() - two_factor.ENROL_TIMEOUT + timedelta(seconds=30)
    AuthenticatorDevice.objects.filter(user=renter).update(created_at=almost)
    assert confirm(web, code_for(second), shown).status_code == 200
    assert two_factor.two_factor_enabled(user=renter)


def test_the_service_shows_a_secret_only_for_the_password_and_confirms_only_the_newest_while_it_lasts(renter):
    with pytest.raises(two_factor.WrongPassword):
        two_factor.totp_enrol_start(user=renter, password="not it", client_address=None)
    assert not AuthenticatorDevice.objects.filter(user=renter).exists()
    first = two_factor.totp_enrol_start(user=renter, password=PASSWORD, client_address=None)
    second = two_factor.totp_enrol_start(user=renter, password=PASSWORD, client_address=None)
    assert second.pk != first.pk and not AuthenticatorDevice.objects.filter(pk=first.pk).exists()
    for device_id in (first.pk, None, "1", True):
        with pytest.raises(ValidationFailed) as gone:
            two_factor.totp_enrol_confirm(user=renter, device_id=device_id, code=code_now(renter), client_address=None)
        assert gone.value.field == "code" and gone.value.message == two_factor.ENROL_GONE
    other = UserFactory()
    with pytest.raises(ValidationFailed):  # another user's pending secret
        two_factor.totp_enrol_confirm(user=other, device_id=second.pk, code=code_now(renter), client_address=None)
    with pytest.raises(two_factor.WrongCode):  # a wrong code leaves it pending
        two_factor.totp_enrol_confirm(user=renter, device_id=second.pk, code="000000", client_address=None)
    assert two_factor.totp_pending(user=renter, device_id=second.pk) == second
    AuthenticatorDevice.objects.filter(pk=second.pk).update(
        created_at=timezone.now() - two_factor.ENROL_TIMEOUT - timedelta(seconds=1))
    with pytest.raises(ValidationFailed):
        two_factor.totp_enrol_confirm(user=renter, device_id=second.pk, code=code_now(renter), client_address=None)
    assert not two_factor.two_factor_enabled(user=renter)

    third = two_factor.totp_enrol_start(user=renter, password=PASSWORD, client_address=None)
    two_factor.totp_enrol_confirm(user=renter, device_id=third.pk, code=code_now(renter), client_address=None)
    assert two_factor.totp_confirmed(user=renter) == third
    with pytest.raises(Conflict):  # on already: no new secret, even with the password
        two_factor.totp_enrol_start(user=renter, password=PASSWORD, client_address=None)


def test_the_service_start_is_behind_the_lock_out(renter, settings):
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        with pytest.raises(two_factor.WrongPassword):
            two_factor.totp_enrol_start(user=renter, password="not it", client_address=None)
    with pytest.raises(LoginLocked):
        two_factor.totp_enrol_start(user=renter, password=PASSWORD, client_address=None)
    assert not AuthenticatorDevice.objects.filter(user=renter).exists()


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


@pytest.mark.parametrize("two_factor_on", [True, False])
def test_a_next_that_is_the_code_step_lands_on_the_home_page_logged_in(client, renter, two_factor_on):
    """After the code the user, logged in, was sent back to the code step, which has nothing pending any more and
    said "Log in again: the code step lasts a few minutes." (found by review, r49)."""
    if two_factor_on:
        enrol(renter)
    r = password_step(client, renter, next=CODE)
    if two_factor_on:
        r = client.post(CODE, {"code": code_now(renter)})
    assert r.status_code == 302 and r["Location"] == "/" and is_logged_in(client)


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
    assert r.status_code == 400 and "not right" in r.json()["otp_code"][0] and "code" not in r.json()
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
