"""Accounts are looked up, kept unique and counted by the mailbox their address reaches (core.email_address): the
domain IDNA-encoded as mail delivery encodes it, nothing folded that delivery keeps apart (review r51, findings
1-3). PostgreSQL's iexact took 'alice@gıthub.com' (a domain of its own, xn--gthub-n4a.com) for alice@github.com,
and counted 'alice@ſtripe.com', which is delivered to alice@stripe.com, as another address."""
import re

import pytest
from django.core.mail.message import sanitize_address
from django.db import IntegrityError, transaction
from django.test import Client
from rest_framework.test import APIClient

from core.email_address import email_canonical
from core.errors import ValidationFailed
from marketplace.admin.accounts import UserAddForm
from marketplace.models import User

pytestmark = pytest.mark.django_db
REGISTER = "/api/v1/auth/register/"
CONFIRM = "/api/v1/auth/confirm/"
LOGIN = "/api/v1/auth/login/"
RESET = "/accounts/password/reset/"
REAL = "alice@github.com"
LOOKALIKE = "alice@g\u0131thub.com"  # a mailbox on the attacker's own domain (xn--gthub-n4a.com)
UNENCODABLE = "alice@" + "\u00e4" * 60 + ".de"  # Django's validator takes it; IDNA cannot encode the label


def test_the_canonical_form_is_the_mailbox_delivery_reaches():
    assert email_canonical("Alice@GitHub.COM") == "alice@github.com"
    assert email_canonical(LOOKALIKE) == "alice@xn--gthub-n4a.com" != email_canonical(REAL)
    assert email_canonical("alice@\u017ftripe.com") == email_canonical("alice@\uff53tripe.com") == "alice@stripe.com"
    assert email_canonical("bob@b\u00fccher.de") == email_canonical("bob@xn--bcher-kva.de")
    for address in ["alice@stripe.com", "alice@\u017ftripe.com", "bob@b\u00fccher.de", LOOKALIKE]:
        assert email_canonical(address) == sanitize_address(address, "utf-8").lower()
    with pytest.raises(ValidationFailed) as refused:
        email_canonical(UNENCODABLE)
    assert refused.value.field == "email"


def test_a_lookalike_account_locks_the_real_owner_out_of_signing_up(mailoutbox):
    attacker = APIClient(REMOTE_ADDR="198.51.100.66")
    assert attacker.post(REGISTER, {"email": LOOKALIKE, "password": "attacker pass 9876"},
                         format="json").status_code == 202
    token = re.search(r"^The token: (\S+)$", mailoutbox[0].body, re.M).group(1)
    assert attacker.post(CONFIRM, {"token": token, "password": "attacker pass 9876"},
                         format="json").status_code == 201
    mailoutbox.clear()
    r = APIClient(REMOTE_ADDR="203.0.113.5").post(REGISTER, {"email": REAL, "password": "alice's pass 12345"},
                                                  format="json")
    assert r.status_code == 202
    [mail] = mailoutbox
    assert mail.to == [REAL]
    assert mail.subject.endswith("Confirm your sign-up"), mail.subject


def test_a_lookalike_account_does_not_get_the_real_addresss_reset_link(mailoutbox):
    User.objects.create_user(email=LOOKALIKE, password="attacker pass 9876")
    Client(REMOTE_ADDR="203.0.113.5").post(RESET, {"email": REAL})
    [mail] = mailoutbox
    assert mail.to == [REAL] and "no account that can log in uses it" in mail.body, (mail.to, mail.body)


def test_sign_up_with_a_lookalike_tells_its_mailbox_that_the_real_address_has_an_account(mailoutbox):
    User.objects.create_user(email="alice@github.com", password="alice's pass 12345")
    r = APIClient(REMOTE_ADDR="198.51.100.66").post(
        REGISTER, {"email": "alice@g\u0131thub.com", "password": "attacker pass 9876"}, format="json")
    assert r.status_code == 202, r.content
    [mail] = mailoutbox
    assert mail.to == ["alice@g\u0131thub.com"]  # the attacker's mailbox
    assert "already has one" not in mail.body, mail.subject


def test_the_already_has_one_note_goes_to_the_accounts_own_address(mailoutbox):
    User.objects.create_user(email="alice@stripe.com", password="alice's pass 12345")
    assert APIClient(REMOTE_ADDR="203.0.113.5").post(
        REGISTER, {"email": "alice@\u017ftripe.com", "password": "some fine pass 4321"},
        format="json").status_code == 202
    [mail] = mailoutbox
    assert mail.to == ["alice@stripe.com"] and "already has one" in mail.body


@pytest.mark.parametrize("has_account", [True, False])
def test_sign_up_e_mails_to_one_mailbox_are_limited_whatever_its_spelling(mailoutbox, settings, has_account):
    if has_account:
        User.objects.create_user(email="alice@stripe.com", password="alice's pass 12345")
    limit = settings.SIGNUP_EMAILS_PER_ADDRESS
    for n, spelling in enumerate(["alice@stripe.com"] * limit + ["alice@\u017ftripe.com"] * limit):
        r = APIClient(REMOTE_ADDR=f"203.0.113.{10 + n}").post(
            REGISTER, {"email": spelling, "password": "some fine pass 4321"}, format="json")
        assert r.status_code == 202, r.content
    mailboxes = [sanitize_address(m.to[0], "utf-8") for m in mailoutbox]
    assert mailboxes.count("alice@stripe.com") <= limit, mailboxes


def test_reset_e_mails_to_one_mailbox_without_an_account_are_limited_whatever_its_spelling(mailoutbox, settings):
    limit = settings.PASSWORD_RESET_EMAILS_PER_ADDRESS
    for n, spelling in enumerate(["alice@stripe.com"] * limit + ["alice@\u017ftripe.com"] * limit):
        Client(REMOTE_ADDR=f"203.0.113.{10 + n}").post(RESET, {"email": spelling})
    mailboxes = [sanitize_address(m.to[0], "utf-8") for m in mailoutbox]
    assert mailboxes.count("alice@stripe.com") <= limit, mailboxes


def test_the_log_in_lock_out_counts_every_spelling_of_one_account(settings):
    User.objects.create_user(email="alice@stripe.com", password="alice's pass 12345")
    limit = settings.LOGIN_FAILURES_PER_ACCOUNT
    for n in range(limit):
        spelling = "alice@\u017ftripe.com" if n % 2 else "alice@stripe.com"
        assert APIClient(REMOTE_ADDR=f"203.0.113.{10 + n}").post(
            LOGIN, {"email": spelling, "password": "a wrong guess 1"}, format="json").status_code == 400
    # Locked for the account, whichever spelling comes next, and the right password too.
    r = APIClient(REMOTE_ADDR="203.0.113.200").post(
        LOGIN, {"email": "alice@\u017ftripe.com", "password": "alice's pass 12345"}, format="json")
    assert r.status_code == 429, r.content


def test_log_in_finds_the_account_by_any_spelling_of_its_mailbox_and_none_other():
    User.objects.create_user(email="alice@stripe.com", password="alice's pass 12345")
    User.objects.create_user(email=REAL, password="alice's pass 12345")
    ok = APIClient(REMOTE_ADDR="203.0.113.5").post(
        LOGIN, {"email": "Alice@\u017ftripe.com", "password": "alice's pass 12345"}, format="json")
    assert ok.status_code == 200, ok.content
    wrong = APIClient(REMOTE_ADDR="203.0.113.6").post(
        LOGIN, {"email": LOOKALIKE, "password": "alice's pass 12345"}, format="json")
    assert wrong.status_code == 400, wrong.content


def test_the_database_refuses_a_second_account_for_one_mailbox():
    User.objects.create_user(email="alice@stripe.com", password=None)
    with pytest.raises(IntegrityError), transaction.atomic():
        User.objects.create_user(email="alice@\u017ftripe.com", password=None)
    assert User.objects.create_user(email=LOOKALIKE, password=None).email_canonical == "alice@xn--gthub-n4a.com"


def test_an_address_no_e_mail_can_reach_is_a_400_on_email(mailoutbox):
    for path, data in [(REGISTER, {"email": UNENCODABLE, "password": "some fine pass 4321"})]:
        r = APIClient(REMOTE_ADDR="203.0.113.5").post(path, data, format="json")
        assert r.status_code == 400 and "email" in r.json() and "encoded" in str(r.json()["email"]), r.content
    page = Client(REMOTE_ADDR="203.0.113.6").post(RESET, {"email": UNENCODABLE})
    assert page.status_code == 400 and "cannot receive e-mail" in page.content.decode()
    signup = Client(REMOTE_ADDR="203.0.113.7").post("/accounts/signup/", {"email": UNENCODABLE,
                                                                          "password": "some fine pass 4321"})
    assert signup.status_code in (200, 400) and "cannot receive e-mail" in signup.content.decode()
    assert not mailoutbox and not User.objects.exists()


def test_the_admin_adds_the_real_address_next_to_a_lookalike_and_refuses_another_spelling_of_one():
    User.objects.create_user(email=LOOKALIKE, password=None)
    assert UserAddForm(data={"email": REAL}).is_valid()
    User.objects.create_user(email="alice@stripe.com", password=None)
    form = UserAddForm(data={"email": "alice@\u017ftripe.com"})
    assert not form.is_valid() and "An account has this address already." in form.errors["email"]
