"""E-mail verification: renting and listing need an address the owner has proven to hold.

A sign-up proves it (the account is made from the link e-mailed to it), and so does a password reset (its link
went to the address). What is left is an address an operator typed: an account added in the admin (until its
owner's first reset) or one whose address an operator changed. Such a user may log in but not rent or list
(`email_verified_required`, EmailNotVerified: a 403 with code `email_not_verified`) until they follow the link
that `email_verification_resend` e-mails ("Send the link again" on the pages, `POST /api/v1/auth/verify-email/`).

The link's token is Django's PasswordResetTokenGenerator keyed on the address, the verified time and the time the
address was last changed (`User.email_changed_at`): it lasts PASSWORD_RESET_TIMEOUT, and stops working once the
address is verified or changed, for good: changed away and back again, the address does not revive a link sent
before (the address alone would).
"""
import logging
from urllib.parse import urljoin

from django.conf import settings
from django.contrib.auth.tokens import PasswordResetTokenGenerator
from django.core.mail import send_mail
from django.db.models import Model
from django.urls import reverse
from django.utils import timezone
from django.utils.encoding import force_bytes, force_str
from django.utils.http import urlsafe_base64_decode, urlsafe_base64_encode

from core.errors import Conflict, PermissionDenied, TooManyRequests, Unavailable, ValidationFailed
from core.login_throttle import password_reset_mail_allowed
from marketplace.models import User

log = logging.getLogger(__name__)

CODE = "email_not_verified"


class EmailNotVerified(PermissionDenied):
    code = CODE

    def __init__(self, user: User) -> None:
        super().__init__(
            f"Verify your e-mail address first: renting and listing need an address you have proven to hold. "
            f"Open the link we e-mailed to {user.email}, or have it sent again: POST /api/v1/auth/verify-email/, or "
            f"the button on your Security page (/account/security/).", extra={"code": CODE})


class InvalidVerificationLink(ValidationFailed):
    def __init__(self) -> None:
        super().__init__("This verification link is invalid, has expired, or is for an address that changed since. "
                         "Log in and send a new link from your Security page.", field="token")


class _TokenGenerator(PasswordResetTokenGenerator):
    key_salt = "marketplace.services.email_verification"

    def _make_hash_value(self, user: Model, timestamp: int) -> str:
        assert isinstance(user, User)
        # The change time only once there is one: the links of addresses never changed stay as they were made.
        changed = f"|{user.email_changed_at.isoformat()}" if user.email_changed_at else ""
        return f"{user.pk}|{user.email}|{user.email_verified_at}|{timestamp}{changed}"


_tokens = _TokenGenerator()


def email_verified_required(*, user: User) -> None:
    if user.email_verified_at is None:
        raise EmailNotVerified(user)


def email_mark_verified(*, user: User) -> bool:
    """The owner proved the address (a reset link, a verification link): the one `user` was read with. False, and
    nothing written, when the address changed since (an operator's change between the link's check and here): the
    update names the address and its change time, so a link for the old address cannot verify the new one (found
    by review: it named the row alone). True when that address is verified (now, or by a request before)."""
    if user.email_verified_at is not None:
        return True
    now = timezone.now()
    same_address = User.objects.filter(pk=user.pk, email=user.email, email_changed_at=user.email_changed_at)
    if same_address.filter(email_verified_at__isnull=True).update(email_verified_at=now):
        user.email_verified_at = now
        return True
    return same_address.filter(email_verified_at__isnull=False).exists()  # a second click, say


def email_verification_link(*, user: User, base_url: str) -> str:
    uid = urlsafe_base64_encode(force_bytes(user.pk))
    return urljoin(base_url, reverse("email-verify", args=[uid, _tokens.make_token(user)]))


def email_verification_resend(*, user: User, base_url: str) -> None:
    """E-mail the link to an unverified user's address. Conflict (409) when it is verified already,
    TooManyRequests (429) when the address had its e-mails for the hour (the reset e-mails' limit, counted apart),
    Unavailable (503) when the mail server refused it; nothing is sent then."""
    if user.email_verified_at is not None:
        raise Conflict(f"Your e-mail address {user.email} is verified already: there is nothing to send.")
    if not password_reset_mail_allowed(account=f"verify:{user.email}"):
        raise TooManyRequests(f"No e-mail was sent: {user.email} had as many verification e-mails as an hour allows. "
                              "Open the link of one sent before, or try again later.")
    minutes = settings.PASSWORD_RESET_TIMEOUT // 60
    try:
        send_mail(f"[{settings.PLATFORM_NAME}] Verify your e-mail address", (
            f"To rent GPUs and list servers on {settings.PLATFORM_NAME}, confirm that this address is yours: open "
            f"this link within {minutes} minutes:\n\n"
            f"  {email_verification_link(user=user, base_url=base_url)}\n\n"
            "If you have no account with us, ignore this e-mail.\n"), settings.DEFAULT_FROM_EMAIL, [user.email])
    except Exception:  # noqa: BLE001 (the mail server's failure is answered, not raised as a 500)
        log.exception("could not send the verification e-mail")
        raise Unavailable("No e-mail was sent: the mail server could not take it. "
                          "Try again in a few minutes.") from None


def email_verify(*, uidb64: str, token: str) -> User:
    """Mark the link's user verified; InvalidVerificationLink when the link is not a valid one."""
    try:
        pk = int(force_str(urlsafe_base64_decode(uidb64)))
    except (TypeError, ValueError, OverflowError):
        raise InvalidVerificationLink() from None
    user = User.objects.filter(pk=pk, is_active=True).first()
    if user is None or not _tokens.check_token(user, token):
        raise InvalidVerificationLink()
    if not email_mark_verified(user=user):
        raise InvalidVerificationLink()  # the address changed after the check: "for an address that changed since"
    return user
