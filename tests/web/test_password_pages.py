"""Password reset by e-mail and password change on the pages: no account enumeration, the per-address limit on
reset e-mails, one-use links, other sessions ended, the old password behind the log-in lock-out; operator-made
accounts set their first password through a reset."""
import re
import time

import pytest
from django.core.mail.backends import locmem
from django.test import Client

from marketplace.models import User
from tests.web.conftest import PASSWORD, logged_in

pytestmark = pytest.mark.django_db

RESET = "/accounts/password/reset/"
CHANGE = "/account/password/"
NEW_PASSWORD = "a brand new passphrase 77"


def reset_link(message) -> str:
    match = re.search(r"https?://[^/\s]+(/accounts/password/reset/[^/\s]+/[^/\s]+/)", message.body)
    assert match, message.body
    return match.group(1)


def is_logged_in(client) -> bool:
    return client.get("/account/security/").status_code == 200


def test_the_login_page_links_to_the_reset(client):
    page = client.get("/accounts/login/").content.decode()
    assert 'href="/accounts/password/reset/">Forgot your password?</a>' in page


def test_reset_answers_alike_for_an_address_with_and_without_an_account(client, renter, mailoutbox):
    known = client.post(RESET, {"email": "Renter@Example.com"})
    unknown = client.post(RESET, {"email": "nobody@example.com"})
    assert known.status_code == unknown.status_code == 302
    assert known["Location"] == unknown["Location"] == "/accounts/password/reset/sent/"
    # One e-mail each, as sign-up sends: a link to the account, a note to the address with none.
    assert [m.to for m in mailoutbox] == [["renter@example.com"], ["nobody@example.com"]]
    assert "Reset your password" in mailoutbox[0].subject and "/accounts/password/reset/" in mailoutbox[0].body
    assert "no account that can log in uses it" in mailoutbox[1].body
    assert "/accounts/password/reset/" not in mailoutbox[1].body and "/accounts/signup/" in mailoutbox[1].body
    sent = client.get(known["Location"]).content.decode()
    assert "If the address has an account" in sent


class SlowEmailBackend(locmem.EmailBackend):
    """A mail server that takes 300 ms a message, as a remote SMTP server may."""

    def send_messages(self, messages):
        time.sleep(0.3)
        return super().send_messages(messages)


def test_reset_takes_as_long_for_an_address_with_and_without_an_account(client, renter, settings, mailoutbox):
    """Timing must not tell which addresses have accounts: both wait on the mail server once (the known one did,
    the unknown one answered at once: 0.30 s against 0.003 s). The margin is half the server's time."""
    settings.EMAIL_BACKEND = f"{__name__}.SlowEmailBackend"
    client.post(RESET, {"email": "warm.up@example.com"})

    def timed(email):
        start = time.perf_counter()
        assert client.post(RESET, {"email": email}).status_code == 302
        return time.perf_counter() - start

    unknown, known = timed("nobody@example.com"), timed(renter.email)
    assert abs(known - unknown) < 0.15, (known, unknown)
    assert len(mailoutbox) == 3


def test_reset_e_mails_to_one_address_are_limited(client, renter, mailoutbox, settings):
    for _ in range(settings.PASSWORD_RESET_EMAILS_PER_ADDRESS + 2):
        assert client.post(RESET, {"email": renter.email})["Location"] == "/accounts/password/reset/sent/"
    assert len(mailoutbox) == settings.PASSWORD_RESET_EMAILS_PER_ADDRESS


@pytest.mark.parametrize("address, lookalike", [("sam@stripe.com", "sam@\u017ftripe.com"),
                                                 ("kim@example.org", "kim@\uff45xample.org")])
def test_reset_e_mails_to_one_mailbox_are_limited_whatever_its_spelling(mailoutbox, settings, address, lookalike):
    """Delivery IDNA-encodes the domain: 'ſtripe.com' (U+017F) and a full-width 'ｅ' reach stripe.com and
    example.org. The limit counts that mailbox (core.email_address), not each spelling typed."""
    User.objects.create_user(email=address, password=PASSWORD)
    limit = settings.PASSWORD_RESET_EMAILS_PER_ADDRESS
    for i in range(limit):
        Client(REMOTE_ADDR=f"203.0.113.{10 + i}").post(RESET, {"email": address})
    response = Client(REMOTE_ADDR="198.51.100.7").post(RESET, {"email": lookalike})
    assert response.status_code == 302
    assert [m.to for m in mailoutbox] == [[address]] * limit


@pytest.mark.parametrize("address, lookalike", [("sam@example.org", "\u017fam@example.org"),
                                                 ("kim@example.org", "k\u0131m@example.org")])
def test_a_lookalike_local_part_is_another_mailbox_and_gets_no_link(mailoutbox, address, lookalike):
    """PostgreSQL's iexact matched 'ſam' (U+017F) to sam@ and 'kım' (U+0131) to kim@; delivery keeps them apart (the
    local part is not encoded), so they are other mailboxes: no link to sam@'s account, only the "no account" note."""
    User.objects.create_user(email=address, password=PASSWORD)
    assert Client(REMOTE_ADDR="198.51.100.7").post(RESET, {"email": lookalike}).status_code == 302
    [mail] = mailoutbox
    assert mail.to == [lookalike] and "no account that can log in uses it" in mail.body


def test_reset_form_errors_are_a_400_on_the_field(client):
    r = client.post(RESET, {"email": "not an address"})
    assert r.status_code == 400 and 'aria-invalid="true"' in r.content.decode()
    assert "Enter a valid email address." in r.content.decode()


def test_reset_end_to_end_ends_every_session_and_works_once(client, renter, mailoutbox):
    elsewhere = logged_in(renter)
    assert is_logged_in(elsewhere)
    client.post(RESET, {"email": renter.email})
    link = reset_link(mailoutbox[0])
    form_url = client.get(link)["Location"]  # Django moves the token into the session
    page = client.get(form_url)
    assert page.status_code == 200 and "Choose a new password" in page.content.decode()

    mismatch = client.post(form_url, {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD + "x"})
    assert mismatch.status_code == 400 and "didn’t match" in mismatch.content.decode()
    weak = client.post(form_url, {"new_password1": "12345", "new_password2": "12345"})
    assert weak.status_code == 400 and "too short" in weak.content.decode()

    done = client.post(form_url, {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD})
    assert done.status_code == 302 and done["Location"] == "/accounts/password/reset/done/"
    assert "Password saved" in client.get(done["Location"]).content.decode()
    assert not is_logged_in(elsewhere)
    assert mailoutbox[-1].subject.endswith("Your password was changed")

    again = Client().get(link, follow=True)
    assert "This link does not work" in again.content.decode()
    fresh = Client()
    assert fresh.post("/accounts/login/", {"username": renter.email, "password": PASSWORD}).status_code == 200
    assert fresh.post("/accounts/login/", {"username": renter.email, "password": NEW_PASSWORD}).status_code == 302


def test_a_forged_link_is_refused(client, renter):
    r = client.get("/accounts/password/reset/MQ/abc-0123456789abcdef/", follow=True)
    assert "This link does not work" in r.content.decode()


def test_an_inactive_account_gets_no_link(client, renter, mailoutbox):
    User.objects.filter(pk=renter.pk).update(is_active=False)
    assert client.post(RESET, {"email": renter.email}).status_code == 302
    assert len(mailoutbox) == 1 and "/accounts/password/reset/" not in mailoutbox[0].body


def test_an_operator_made_account_has_no_password_until_its_owner_resets_it(client, operator, mailoutbox):
    admin = logged_in(operator)
    r = admin.post("/admin/marketplace/user/add/", {"email": "New.Person@Example.com", "_save": "Save"})
    assert r.status_code == 302, r.content.decode()[:2000]
    user = User.objects.get(email="new.person@example.com")
    assert not user.has_usable_password()
    assert client.post("/accounts/login/", {"username": user.email, "password": ""}).status_code == 200
    client.post(RESET, {"email": user.email})
    form_url = client.get(reset_link(mailoutbox[0]))["Location"]
    assert client.post(form_url, {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD}).status_code == 302
    assert Client().post("/accounts/login/", {"username": user.email, "password": NEW_PASSWORD}).status_code == 302


# --- change ------------------------------------------------------------------------------------------------------

def test_change_needs_a_log_in(client):
    r = client.get(CHANGE)
    assert r.status_code == 302 and r["Location"].startswith("/accounts/login/")


def test_change_keeps_this_session_and_ends_the_others(renter, mailoutbox):
    here, elsewhere = logged_in(renter), logged_in(renter)
    page = here.get(CHANGE)
    assert page.status_code == 200 and "Change your password" in page.content.decode()
    r = here.post(CHANGE, {"old_password": PASSWORD, "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD})
    assert r.status_code == 302 and r["Location"] == "/account/security/"
    assert "Password changed" in here.get("/account/security/").content.decode()
    assert is_logged_in(here) and not is_logged_in(elsewhere)
    renter.refresh_from_db()
    assert renter.check_password(NEW_PASSWORD)
    assert [m.subject.endswith("Your password was changed") for m in mailoutbox] == [True]


@pytest.mark.parametrize(("data", "field", "text"), [
    ({"old_password": "wrong one", "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD}, "old_password",
     "Your password was entered incorrectly."),
    ({"old_password": PASSWORD, "new_password1": NEW_PASSWORD, "new_password2": "other"}, "new_password2",
     "didn’t match"),
    ({"old_password": PASSWORD, "new_password1": "renter@example.com", "new_password2": "renter@example.com"},
     "new_password2", "too similar"),
    ({"old_password": PASSWORD, "new_password1": "", "new_password2": ""}, "new_password1", "required"),
])
def test_change_form_errors_are_a_400_on_the_field(web, renter, data, field, text):
    r = web.post(CHANGE, data)
    page = r.content.decode()
    assert r.status_code == 400 and text in page
    assert f'id="id_{field}_errors"' in page
    renter.refresh_from_db()
    assert renter.check_password(PASSWORD)


def test_guessing_the_old_password_locks_like_a_log_in(web, renter, settings):
    wrong = {"old_password": "not it", "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD}
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        assert web.post(CHANGE, wrong).status_code == 400
    right = {**wrong, "old_password": PASSWORD}
    r = web.post(CHANGE, right)
    assert r.status_code == 429 and "Too many failed log-ins" in r.content.decode() and int(r["Retry-After"]) > 0
    renter.refresh_from_db()
    assert renter.check_password(PASSWORD)
    # and the log-in page is locked for the account too: one lock-out
    assert Client().post("/accounts/login/", {"username": renter.email, "password": PASSWORD}).status_code == 429


def test_the_security_page(web, client):
    page = web.get("/account/security/").content.decode()
    for link in ('href="/account/password/"', 'href="/account/two-factor/enable/"', 'href="/account/api-keys/"'):
        assert link in page
    assert client.get("/account/security/").status_code == 302


# --- the admin's password pages: the same rules as the site's --------------------------------------------------

ADMIN_CHANGE = "/admin/password_change/"


def test_the_admins_password_change_page_checks_the_old_password_behind_the_log_in_lockout(operator, settings):
    """A copied operator cookie must not be a way to guess the password without limit (it was Django's own form)."""
    admin = logged_in(operator)
    wrong = {"old_password": "not it", "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD}
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        assert admin.post(ADMIN_CHANGE, wrong).status_code == 400
    r = admin.post(ADMIN_CHANGE, {**wrong, "old_password": PASSWORD})
    assert r.status_code == 429 and "Too many failed log-ins" in r.content.decode() and int(r["Retry-After"]) > 0
    operator.refresh_from_db()
    assert operator.check_password(PASSWORD)
    assert Client().post("/accounts/login/", {"username": operator.email, "password": PASSWORD}).status_code == 429


def test_the_admins_password_change_page_tells_the_address_and_ends_the_other_sessions(operator, mailoutbox):
    here, elsewhere = logged_in(operator), logged_in(operator)
    r = here.post(ADMIN_CHANGE, {"old_password": PASSWORD, "new_password1": NEW_PASSWORD,
                                 "new_password2": NEW_PASSWORD})
    assert r.status_code == 302 and r["Location"] == "/admin/password_change/done/"
    operator.refresh_from_db()
    assert operator.check_password(NEW_PASSWORD)
    assert here.get("/admin/").status_code == 200 and elsewhere.get("/admin/").status_code == 302
    assert [(m.to, m.subject.endswith("Your password was changed")) for m in mailoutbox] == [([operator.email], True)]


@pytest.mark.parametrize("pk_text", ["{pk}", "0{pk}"])
def test_the_admins_set_password_page_refuses_the_operators_own_account(operator, mailoutbox, pk_text):
    """Django's "set password" page asks no old password: on one's own account a copied session would keep the
    account for good. The operator is sent to the site's page, which asks the old one behind the lock-out."""
    admin = logged_in(operator)
    url = f"/admin/marketplace/user/{pk_text.format(pk=operator.pk)}/password/"
    assert admin.get(url)["Location"] == CHANGE
    r = admin.post(url, {"password1": NEW_PASSWORD, "password2": NEW_PASSWORD, "usable_password": "true"})
    assert r.status_code == 302 and r["Location"] == CHANGE
    operator.refresh_from_db()
    assert operator.check_password(PASSWORD) and mailoutbox == []


def test_an_operator_setting_someones_password_tells_them_and_ends_their_sessions_but_not_their_keys(
        operator, renter, mailoutbox):
    from tests.factories import api_key_for

    theirs = logged_in(renter)
    key = api_key_for(renter)
    r = logged_in(operator).post(f"/admin/marketplace/user/{renter.pk}/password/",
                                 {"password1": NEW_PASSWORD, "password2": NEW_PASSWORD, "usable_password": "true"})
    assert r.status_code == 302
    renter.refresh_from_db()
    assert renter.check_password(NEW_PASSWORD)
    assert not is_logged_in(theirs)  # as after a change on the site
    assert Client().get("/api/v1/auth/me/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200
    assert [(m.to, m.subject.endswith("An operator set your password")) for m in mailoutbox] == [
        ([renter.email], True)]
