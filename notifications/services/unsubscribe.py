"""One-click unsubscribe from a kind of notification e-mail (RFC 2369 List-Unsubscribe, RFC 8058 one-click).

Each e-mail of a kind the user may turn off (PREFERENCE_KINDS: not the account's deactivation or reactivation, and
none of the mails that must always go, such as sign-up, password reset, e-mail verification or the security changes
of core.security_mail) carries `List-Unsubscribe: <SITE_URL/account/notifications/unsubscribe/<token>/>` and
`List-Unsubscribe-Post: List-Unsubscribe=One-Click`. The token is signed (django.core.signing, its own salt) and
names the user and the kind: a POST to the URL, with no log-in and no CSRF token (the mail client sends it), turns
the e-mail channel of that kind off in the user's preferences, the others left as they are; a GET shows a page with
the button that sends that POST, so a link scanner that opens it turns nothing off.

The token also holds the time the address last changed (User.email_changed_at): a link e-mailed to an address an
operator has changed since (even back) does nothing, so the old mailbox cannot turn off the new one's e-mails. It
lasts MAX_AGE_S. A bad, tampered, expired or outdated token is a ValidationFailed (INVALID_LINK), nothing
changed.

Without SITE_URL (the site's address, from the environment) there is no absolute URL to give, and no header.
"""

from urllib.parse import urljoin

from django.conf import settings
from django.core import signing
from django.urls import reverse

from core.errors import ValidationFailed
from marketplace.models import User
from notifications.models import PREFERENCE_KINDS, Kind
from notifications.services.notify import preference_change

SALT = "notifications.services.unsubscribe"
MAX_AGE_S = 180 * 24 * 3600  # an e-mail read months later still turns its kind off


INVALID_LINK = (
    "This unsubscribe link is invalid, has expired, or was sent to an address that changed since: "
    "nothing was changed. Log in and choose your e-mails on the notification settings page."
)


def _invalid() -> ValidationFailed:
    return ValidationFailed(INVALID_LINK, field="token")


def _address_version(user: User) -> str:
    return user.email_changed_at.isoformat() if user.email_changed_at else ""


def unsubscribe_token(*, user: User, kind: str) -> str:
    return signing.TimestampSigner(salt=SALT).sign_object({"u": user.pk, "k": kind, "a": _address_version(user)})


def unsubscribe_url(*, user: User, kind: str) -> str | None:
    """The absolute one-click URL for the user's e-mails of `kind`, or None: a kind that cannot be turned off, or
    no SITE_URL to make it absolute with."""
    site = getattr(settings, "SITE_URL", "")
    if kind not in PREFERENCE_KINDS or not site:
        return None
    return urljoin(site, reverse("notification-unsubscribe", args=[unsubscribe_token(user=user, kind=kind)]))


def unsubscribe_headers(*, user: User, kind: str) -> dict[str, str]:
    """The RFC 2369 and RFC 8058 headers for an e-mail of `kind` to `user` ({} when it has no unsubscribe URL)."""
    url = unsubscribe_url(user=user, kind=kind)
    if url is None:
        return {}
    return {"List-Unsubscribe": f"<{url}>", "List-Unsubscribe-Post": "List-Unsubscribe=One-Click"}


def unsubscribe_check(*, token: str) -> tuple[User, str]:
    """The user and kind the token is for; ValidationFailed (INVALID_LINK) when it is not a valid, current one."""
    try:
        data = signing.TimestampSigner(salt=SALT).unsign_object(token, max_age=MAX_AGE_S)
    except signing.BadSignature:  # tampered, made with another key, or expired (SignatureExpired)
        raise _invalid() from None
    if not isinstance(data, dict):
        raise _invalid()
    pk, kind, address = data.get("u"), data.get("k"), data.get("a")
    if not isinstance(pk, int) or kind not in PREFERENCE_KINDS:
        raise _invalid()
    user = User.objects.filter(pk=pk).first()
    if user is None or address != _address_version(user):
        raise _invalid()
    return user, kind


def unsubscribe(*, token: str) -> tuple[User, str]:
    """Turn off the e-mails of the token's kind for its user (the other channels as they are); the user and kind.
    Doing it again changes nothing more."""
    user, kind = unsubscribe_check(token=token)
    preference_change(user=user, kind=kind, channels={"email": False})
    return user, kind


def kind_label(kind: str) -> str:
    return str(Kind(kind).label)
