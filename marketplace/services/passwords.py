"""Passwords: reset by e-mail (Django's token generator) and checks of a password a logged-in user types again.

Reset: the request answers the same whether the address has an account (the page never says), and takes as long:
either way it sends the address one e-mail (a link, or a note that no account uses the address), as sign-up does
(services/accounts.user_register), so that waiting on the mail server tells nothing. At most
PASSWORD_RESET_EMAILS_PER_ADDRESS e-mails to one address per window. The link carries a token of Django's
PasswordResetTokenGenerator (`reset_tokens`), which is bound to the password's hash, the last log-in and the
address, and here also to the address's last change (an address changed away and back does not revive a link) and
to the account's state: it works once, for PASSWORD_RESET_TIMEOUT seconds, and not once the
account is deactivated, nor after it is reactivated (links are sent to active accounts only). Setting a new
password (reset or change) ends every other session of the user
(Django checks each session's password hash) and tells the address by e-mail, as a change of another security
setting does (core.security_mail.security_change_notify). API keys are not touched: they are
listed, and revocable, on the API keys page.

An account that an operator made in the admin has no usable password; its owner sets one through a reset, which
proves they hold the address before the account can log in, rent or list (docs/ARCHITECTURE.md, "Accounts").
"""
import logging
from urllib.parse import urljoin

from django.conf import settings
from django.contrib.auth.tokens import PasswordResetTokenGenerator
from django.core.mail import send_mail
from django.db.models import Max, Model
from django.urls import reverse
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from core.email_address import email_canonical
from core.login_throttle import password_confirm, password_reset_mail_allowed
from marketplace.models import AccountStatusChange, User

log = logging.getLogger(__name__)


def _send(address: str, subject: str, message: str) -> None:
    try:
        send_mail(f"[{settings.PLATFORM_NAME}] {subject}", message, settings.DEFAULT_FROM_EMAIL, [address])
    except Exception:  # noqa: BLE001 (the answer must not depend on the mail server; asking again re-sends)
        log.exception("could not send an account e-mail")


class ResetTokenGenerator(PasswordResetTokenGenerator):
    """Django's reset token, also bound to the account's state: whether it is on, and its last status change (an
    operator's deactivation or reactivation, marketplace/services/account_status.py). A link sent before a
    deactivation set the password of the account that was off (and marked its address verified), a password live
    the moment it was turned on again; with is_active alone a reactivation would revive it (found by review)."""

    def _make_hash_value(self, user: Model, timestamp: int) -> str:
        assert isinstance(user, User)
        last_change = AccountStatusChange.objects.filter(user_id=user.pk).aggregate(last=Max("pk"))["last"]
        # And to the address's last change (User.email_changed_at): Django's hash has the address, which an
        # operator may change away and back, reviving a link sent before; only once set, so other links stay valid.
        changed = f"|{user.email_changed_at.isoformat()}" if user.email_changed_at else ""
        return f"{super()._make_hash_value(user, timestamp)}|{user.is_active}|{last_change or 0}{changed}"


# The one generator that makes and checks reset links (web/passwords.PasswordResetConfirmView).
reset_tokens = ResetTokenGenerator()


def password_reset_link(*, user: User, base_url: str) -> str:
    uid = urlsafe_base64_encode(force_bytes(user.pk))
    token = reset_tokens.make_token(user)
    return urljoin(base_url, reverse("password-reset-confirm", args=[uid, token]))


def password_reset_request(*, email: str, base_url: str) -> None:
    """E-mail a reset link to the active account with this address, a note that its account is deactivated, or a
    note that no account uses it (UndeliverableAddress, a 400 on `email`, for an address no e-mail can reach): one
    e-mail either way, so that the answer takes as long (the time of the mail server must not tell which addresses have
    accounts). Nothing is returned or raised either way; over the per-address limit nothing is sent (and that is not
    said either)."""
    email = User.objects.normalize_email(email).lower()
    # By the mailbox the e-mail reaches (core.email_address): the account of any spelling that reaches it, and no
    # other (PostgreSQL's iexact matched 'gıthub.com', a domain of its own, to github.com's accounts). The limit
    # counts that mailbox too: each spelling ('ſtripe.com' is delivered to stripe.com) was a budget of its own.
    canonical = email_canonical(email)
    user = User.objects.filter(email_canonical=canonical).first()
    if not password_reset_mail_allowed(account=canonical):
        log.warning("password-reset e-mail to an address over its hourly limit: not sent")
        return
    if user is not None and not user.is_active:
        _send(user.email, "About resetting a password", (
            f"Someone (perhaps you) asked to reset the password of the {settings.PLATFORM_NAME} account with this "
            "email address. That account is deactivated: its password cannot be reset, it cannot log in, and a new "
            "account cannot be opened with this address. Nothing was changed.\n\n"
            f"If you want it back, or to know why, reply to this e-mail or contact {settings.PLATFORM_NAME}'s "
            "support.\n\n"
            "If it was not you, ignore this e-mail.\n"))
        return
    if user is None:
        _send(email, "About resetting a password", (
            f"Someone (perhaps you) asked to reset the password of a {settings.PLATFORM_NAME} account with this email "
            "address, but no account that can log in uses it. Nothing was changed.\n\n"
            "If you have an account, it is under another address. To open one with this address: "
            f"{urljoin(base_url, reverse('signup'))}\n\n"
            "If it was not you, ignore this e-mail.\n"))
        return
    minutes = settings.PASSWORD_RESET_TIMEOUT // 60
    _send(user.email, "Reset your password", (
        f"Someone (we hope you) asked to reset the password of your {settings.PLATFORM_NAME} account.\n\n"
        f"To choose a new one, open this link within {minutes} minutes (it works once):\n\n"
        f"  {password_reset_link(user=user, base_url=base_url)}\n\n"
        "Setting a new password logs out every browser logged in to your account. Your API keys keep working; "
        "revoke any you do not trust on the API keys page.\n\n"
        "If it was not you, ignore this e-mail: your password stays as it is.\n"))


def password_changed_notify(*, user: User, base_url: str) -> None:
    """Tell the address that its password was changed (by a change or a reset), with the way back if it was not
    its owner."""
    _send(user.email, "Your password was changed", (
        f"The password of your {settings.PLATFORM_NAME} account was just changed, and every other browser logged "
        "in to it was logged out.\n\n"
        "If it was not you, reset it now and revoke the API keys you do not recognise:\n\n"
        f"  {urljoin(base_url, reverse('password-reset'))}\n"))


def password_set_by_operator_notify(*, user: User, base_url: str) -> None:
    """Tell the address that an operator set the account's password (or turned password log-in off) in the admin:
    its owner did not type the old one, so they hear of it (marketplace/admin/accounts.py)."""
    _send(user.email, "An operator set your password", (
        f"An operator of {settings.PLATFORM_NAME} just set a new password for your account (or turned log-in with a "
        "password off), and every browser logged in to it was logged out. Your API keys keep working.\n\n"
        "If you did not ask for this, choose a new password yourself now and revoke the API keys you do not "
        f"recognise:\n\n  {urljoin(base_url, reverse('password-reset'))}\n"))


def address_changed_by_operator_notify(*, old_address: str, new_address: str) -> None:
    """Tell the address an account had that an operator changed it in the admin: from now on its e-mails and its
    password resets go to the new one, so its owner hears of it at the old one (marketplace/admin/accounts.py)."""
    _send(old_address, "An operator changed your account's address", (
        f"An operator of {settings.PLATFORM_NAME} just changed the e-mail address of your account from "
        f"{old_address} to {new_address}. From now on the account's e-mails and password resets go there, and "
        "the account may not rent or list until that address is verified.\n\n"
        f"If you did not ask for this, reply to this e-mail or contact {settings.PLATFORM_NAME}'s support now.\n"))


def password_check(*, user: User, password: str, client_address: str | None) -> bool:
    """Is this the user's password? Behind the log-in lock-out (core.login_throttle.password_confirm)."""
    return password_confirm(user=user, password=password, client_address=client_address)
