"""Use cases for accounts and API keys.

Nothing here tells anyone but the owner of an email address whether it has an account: sign-up answers the same
for a new and a taken address and finishes from the e-mail (the account is created only when the link or token
sent to the address comes back), and a failed log-in never says which part was wrong.
"""
import base64
import hashlib
import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urljoin

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.contrib.auth import authenticate
from django.contrib.auth.hashers import check_password, make_password
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.urls import reverse
from django.utils import timezone
from django.utils.crypto import salted_hmac

from core.api.scopes import ALL_SCOPES
from core.email_address import email_canonical
from core.errors import Conflict, PermissionDenied, ValidationFailed
from core.login_throttle import signup_mail_allowed
from core.security_mail import security_change_notify
from marketplace.models import ApiKey, User
from marketplace.services import two_factor
from marketplace.validators import EMAIL_MAX_LENGTH

log = logging.getLogger(__name__)

API_KEY_PREFIX = "gpm_"
# Writing last_used_at on every request would turn each read into a write.
LAST_USED_RESOLUTION = timedelta(minutes=1)
# The name of the key a log-in makes when the client names none; a new log-in replaces the key of its name.
LOGIN_KEY_NAME = "login"
SIGNUP_KEY_NAME = "created at sign-up"
_SIGNUP_PURPOSE = "signup"


class InvalidCredentials(Exception):
    pass


class TwoFactorRequired(ValidationFailed):
    def __init__(self) -> None:
        super().__init__("This account uses two-factor log-in: send `otp_code`, the code from your authenticator app "
                         "(or a recovery code).", field="otp_code")


class InvalidSignupToken(ValidationFailed):
    """The sign-up token is not one of ours, has expired, or was used already (400 on `token`); the sign-up
    page says it in its own words (a link, not a token)."""

    def __init__(self) -> None:
        super().__init__("This sign-up token is invalid, has expired, or was used already.", field="token")


class SignupPasswordMismatch(ValidationFailed):
    """The password given to confirm a sign-up is not the one chosen at that sign-up (400 on `password`): a token
    holds the password of whoever signed up, and an address can get several (someone else may sign up with it), so
    the owner must not create an account with a password they do not know. Nothing is created."""

    def __init__(self) -> None:
        super().__init__(
            "This link belongs to a sign-up made with another password: nothing was created. If you signed up more "
            "than once, type the password you chose that time, or use the link in the other e-mail. If you did not, "
            "someone else tried to sign up with your address: use the link in the other e-mail (your own "
            "sign-up's), or sign up again.", field="password")


def email_too_long_message(length: int) -> str:
    return (f"This address is {length} characters long once in lower case, as accounts keep it; at most "
            f"{EMAIL_MAX_LENGTH} fit.")


def email_normalize(value: str) -> str:
    """The address as accounts keep and look it up: Django's normalize_email, then all of it in lower case.
    ValidationFailed on `email` when that is longer than an account's address may be (EMAIL_MAX_LENGTH): lower-casing
    can lengthen an address ('\u0130' becomes 'i' + U+0307, two characters), so the limit that the forms and
    serializers check on what was typed is not enough; each caller that stores the address checks it on this. Also
    refused (core.email_address.UndeliverableAddress): an address whose domain cannot be encoded for delivery.
    Accounts are looked up and kept unique by core.email_address.email_canonical of this."""
    email = User.objects.normalize_email(value).lower()
    if len(email) > EMAIL_MAX_LENGTH:
        raise ValidationFailed(email_too_long_message(len(email)), field="email")
    email_canonical(email)  # UndeliverableAddress (400 on `email`): no e-mail could reach it, nor its account
    return email


def hash_api_key(raw_key: str) -> str:
    # Keys are 256 bits of randomness, so a fast unsalted hash is enough (no dictionary to attack).
    return hashlib.sha256(raw_key.encode()).hexdigest()


class ApiKeyExpired(Exception):
    """The key was valid but its expiry has passed (the API answers 401 saying so)."""

    def __init__(self, key: ApiKey):
        super().__init__(f"API key {key.prefix}… expired")
        self.key = key


def _clean_scopes(scopes: list[str] | tuple[str, ...] | None) -> list[str]:
    if scopes is None:
        return list(ALL_SCOPES)
    unknown = sorted(set(scopes) - set(ALL_SCOPES))
    if unknown:
        raise ValidationFailed(f"Unknown scope {', '.join(unknown)}: the scopes are {', '.join(ALL_SCOPES)}.",
                               field="scopes")
    if not scopes:
        raise ValidationFailed(f"Choose at least one scope ({', '.join(ALL_SCOPES)}).", field="scopes")
    return [s for s in ALL_SCOPES if s in scopes]


def api_key_create(*, user: User, name: str = "", scopes: list[str] | tuple[str, ...] | None = None,
                   expires_at: datetime | None = None, made_with: ApiKey | None = None,
                   base_url: str = "") -> tuple[ApiKey, str]:
    """Create a key and return it with the raw value, which is never stored or shown again.

    `scopes` None means all of them. `made_with`: the key the request came with (None for a browser session or a
    log-in); a key cannot make a key that may do more than itself or outlive it. Conflict (409) when the user holds
    API_KEYS_PER_USER_MAX keys already. The address is told (core.security_mail), as for a new SSH key or webhook
    endpoint: a key outlives a password change. (A log-in's key under a new name is told too: api_key_rotate. The
    key sign-up makes comes with the account, from the link e-mailed to the address: no notice.)"""
    with transaction.atomic():
        key, raw = _api_key_make(user=user, name=name, scopes=scopes, expires_at=expires_at, made_with=made_with)
        expiry = f"expires {key.expires_at:%Y-%m-%d %H:%M} UTC" if key.expires_at else "does not expire"
        security_change_notify(
            user=user, subject="An API key was made for your account", base_url=base_url,
            change=(f"An API key was just made for your {settings.PLATFORM_NAME} account: "
                    f"{key.name or 'no name'} ({key.prefix}…, scopes {', '.join(key.scopes)}; it {expiry}). A key "
                    "works until it is revoked or expires, also after a password change: revoke it on the API keys "
                    "page if you do not know it."))
    return key, raw


def _api_key_make(*, user: User, name: str = "", scopes: list[str] | tuple[str, ...] | None = None,
                  expires_at: datetime | None = None, made_with: ApiKey | None = None) -> tuple[ApiKey, str]:
    clean = _clean_scopes(scopes)
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationFailed("The expiry must be in the future.", field="expires_at")
    if made_with is not None:
        beyond = sorted(set(clean) - set(made_with.scopes))
        if beyond:
            raise PermissionDenied(f"This API key cannot make a key with scopes it does not have itself "
                                   f"({', '.join(beyond)}).")
        if made_with.expires_at is not None and (expires_at is None or expires_at > made_with.expires_at):
            raise PermissionDenied("This API key expires: the keys it makes must expire no later than it does "
                                   f"({made_with.expires_at.isoformat()}).")
    raw = API_KEY_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        # The user's row lock: two requests at the cap cannot both pass the count (api_key_rotate holds it already).
        User.objects.select_for_update().filter(pk=user.pk).first()
        held = ApiKey.objects.active().filter(user=user).count()
        if held >= settings.API_KEYS_PER_USER_MAX:
            # Expired keys work no more: at the cap they are revoked to make room (found by review: fifty expired
            # keys refused every new one, and the API log-in, until their owner revoked them by hand on the page).
            now = timezone.now()
            held -= ApiKey.objects.active().filter(user=user, expires_at__lte=now).update(revoked_at=now)
        if held >= settings.API_KEYS_PER_USER_MAX:
            raise Conflict(f"You hold {held} API keys, the most one account may: revoke one you no longer use "
                           "(DELETE /api/v1/api-keys/{id}/, or the API keys page) before making another.")
        key = ApiKey.objects.create(user=user, name=name, prefix=raw[:12], key_hash=hash_api_key(raw), scopes=clean,
                                    expires_at=expires_at)
    return key, raw


def api_key_revoke(*, api_key: ApiKey, revoked_with: ApiKey | None = None) -> None:
    """Revoke `api_key`. `revoked_with`: the key the request came with (None for a browser session): as a key
    makes no key with scopes it lacks, it revokes none with scopes it lacks (itself always); a leaked `read` key
    revoked the account's renter and provider keys, stopping its automation."""
    if revoked_with is not None and revoked_with.pk != api_key.pk:
        beyond = sorted(set(api_key.scopes) - set(revoked_with.scopes))
        if beyond:
            raise PermissionDenied(f"This API key cannot revoke a key with scopes it does not have itself "
                                   f"({', '.join(beyond)}). Revoke it on the API keys page, or with a key that "
                                   "holds them.")
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])


def api_key_matches(*, raw_key: str, pk: object) -> bool:
    """Is `raw_key` the value of the key `pk` (a URL's, so maybe not a number)? Nothing else is checked: the
    request is still authenticated with the key as any other."""
    if not re.fullmatch(r"[0-9]{1,18}", str(pk)):  # ASCII digits within a bigint: else no key's
        return False
    return ApiKey.objects.filter(pk=int(str(pk)), key_hash=hash_api_key(raw_key)).exists()


def api_key_authenticate(*, raw_key: str) -> ApiKey | None:
    """The active key with this value (and its user), or None; ApiKeyExpired when its expiry has passed."""
    key: ApiKey | None = (
        ApiKey.objects.active()
        .select_related("user")
        .filter(key_hash=hash_api_key(raw_key), user__is_active=True)
        .first()
    )
    if key is None:
        return None
    now = timezone.now()
    if key.expires_at is not None and key.expires_at <= now:
        raise ApiKeyExpired(key)
    if key.last_used_at is None or now - key.last_used_at >= LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key


def api_key_rotate(*, user: User, name: str, client_address: str | None = None,
                   base_url: str = "") -> tuple[ApiKey, str, list[ApiKey]]:
    """Revoke the user's active keys called `name` and make a new one: (the key, its raw value, those revoked).

    A key under a name that had no active key (a new client, or someone else with the password) is e-mailed to the
    address, as one made on the page or with POST /api-keys/ is: it holds every scope, never expires and outlives a
    password reset, so it must not be made unseen (found by review: a phished password made one silently). A
    client logging in again under its name only replaces its own key, and stays quiet."""
    with transaction.atomic():
        User.objects.select_for_update().filter(pk=user.pk).first()  # one rotation of a user's keys at a time
        replaced = list(ApiKey.objects.active().filter(user=user, name=name))
        now = timezone.now()
        ApiKey.objects.filter(pk__in=[k.pk for k in replaced]).update(revoked_at=now)
        for key in replaced:
            key.revoked_at = now
        key, raw = _api_key_make(user=user, name=name)
        if not replaced:
            where = f" from {client_address}" if client_address else ""
            expiry = f"expires {key.expires_at:%Y-%m-%d %H:%M} UTC" if key.expires_at else "does not expire"
            security_change_notify(
                user=user, subject="A log-in made an API key for your account", base_url=base_url,
                change=(f"Someone logged in to your {settings.PLATFORM_NAME} account through the API{where} and got "
                        f"a new API key: {key.name or 'no name'} ({key.prefix}…, scopes {', '.join(key.scopes)}; it "
                        f"{expiry}). A key works until it is revoked or expires, also after a password change: "
                        "revoke it on the API keys page if you do not know it."))
    return key, raw, replaced


# --- sign-up ----------------------------------------------------------------------------------------------------

def _signup_cipher() -> MultiFernet:
    """A Fernet key of its own for sign-up tokens, derived from SECRET_KEY (and its fallbacks, so that rotating
    SECRET_KEY does not void the links already sent)."""
    secrets_ = [settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", [])]
    return MultiFernet([
        Fernet(base64.urlsafe_b64encode(
            salted_hmac("marketplace.services.accounts.signup", "fernet", secret=secret, algorithm="sha256").digest()))
        for secret in secrets_
    ])


def _signup_token(*, email: str, password_hash: str) -> str:
    # Encrypted, not just signed: the token carries the password's hash, and e-mails get forwarded and stored.
    # As UTF-8, not \u escapes: an address of non-ASCII characters took 6 bytes a character, and with a production
    # password hash a long (valid) one made a token over SIGNUP_TOKEN_MAX_LENGTH that no form could confirm.
    payload = json.dumps({"purpose": _SIGNUP_PURPOSE, "email": email, "password": password_hash}, ensure_ascii=False)
    return _signup_cipher().encrypt(payload.encode()).decode("ascii")


def _signup_payload(token: str) -> dict[str, Any]:
    try:
        data = json.loads(_signup_cipher().decrypt(token.encode("ascii"), ttl=settings.SIGNUP_CONFIRM_TTL_S))
    except (InvalidToken, UnicodeEncodeError, ValueError):
        raise InvalidSignupToken() from None
    if not isinstance(data, dict) or data.get("purpose") != _SIGNUP_PURPOSE:
        raise InvalidSignupToken()
    return data


def _send(address: str, subject: str, message: str) -> None:
    try:
        send_mail(f"[{settings.PLATFORM_NAME}] {subject}", message, settings.DEFAULT_FROM_EMAIL, [address])
    except Exception:  # noqa: BLE001 (the answer must not depend on the mail server; registering again re-sends)
        log.exception("could not send the sign-up e-mail")


def _taken_message(*, user: User, base_url: str) -> str:
    """The note to an address that has an account already, in the words of the account's state: only the owner of
    the address reads it, so saying the state reveals nothing to anyone else."""
    intro = (f"Someone (perhaps you) asked to open a {settings.PLATFORM_NAME} account with this email address, "
             "which already has one. Nothing was changed.\n\n")
    reset = urljoin(base_url, reverse("password-reset"))
    if not user.is_active:
        what = ("That account is deactivated: it cannot log in, and a new one cannot be opened with this address. "
                f"If you want it back, or to know why, reply to this e-mail or contact {settings.PLATFORM_NAME}'s "
                "support.\n")
    elif not user.has_usable_password():
        what = ("That account has no password yet (an operator made it for you). If it was you, set your password "
                f"with a password reset, whose e-mail comes to this address: {reset}\n")
    else:
        what = (f"If it was you, log in at {urljoin(base_url, reverse('login'))} "
                "(or with POST /api/v1/auth/login/ for an API key).\n"
                f"If you forgot your password, reset it: {reset}\n")
    return f"{intro}{what}If it was not you, you can ignore this e-mail.\n"


def user_register(*, email: str, password: str, base_url: str) -> None:
    """Start a sign-up: e-mail the address a token that creates the account (a new address) or a note that it
    has one already (a taken address). Same work, same answer either way. The password is already validated;
    `base_url` is the site's root, for the links. An address longer than EMAIL_MAX_LENGTH once normalised is a
    ValidationFailed on `email` here, at the first step: its token could never make an account."""
    email = email_normalize(email)
    canonical = email_canonical(email)  # 400 on `email` for an address no e-mail can reach
    password_hash = make_password(password)  # hashed on both paths, so that both take as long
    user = User.objects.filter(email_canonical=canonical).first()
    # Counted by the mailbox the e-mail reaches: each spelling of one address (alice@ſtripe.com is delivered to
    # alice@stripe.com) was a budget of its own (found by review).
    if not signup_mail_allowed(account=canonical):
        log.warning("sign-up e-mail to an address over its hourly limit: not sent")
        return
    if user is not None:
        # To the account's own address, not the spelling typed (the same mailbox, by the canonical form).
        _send(user.email, "Someone tried to sign up with your address", _taken_message(user=user, base_url=base_url))
        return
    token = _signup_token(email=email, password_hash=password_hash)
    hours = settings.SIGNUP_CONFIRM_TTL_S // 3600
    _send(email, "Confirm your sign-up", (
        f"Someone (we hope you) asked to open a {settings.PLATFORM_NAME} account with this email address.\n\n"
        f"To create it, open this link within {hours} hours and type the password you chose when you signed up:\n\n"
        f"  {urljoin(base_url, reverse('signup-confirm', args=[token]))}\n\n"
        "or confirm through the API, which answers with your first API key (put that password in):\n\n"
        f"  curl -X POST {urljoin(base_url, reverse('auth-confirm'))} -H 'Content-Type: application/json' "
        f"-d '{{\"token\": \"{token}\", \"password\": \"YOUR PASSWORD\"}}'\n\n"
        f"The token: {token}\n\n"
        "If you got more than one of these e-mails but signed up once, someone else tried to sign up with your "
        "address: the links of the others ask for their password, not yours.\n"
        "If it was not you, ignore this e-mail: no account is made without it and the password.\n"))


def user_register_confirm(*, token: str, password: str) -> tuple[User, ApiKey, str]:
    """Create the account a sign-up token stands for, and its first API key (its raw value returned: shown once).
    A token works once: afterwards its address has an account.

    `password` must be the one chosen at that sign-up (SignupPasswordMismatch otherwise, nothing created): anyone
    can sign up with an address, and the token in each e-mail carries the password of whoever did; without the
    check, an owner who followed the link of someone else's sign-up with their address (an e-mail that came after
    their own) got the account with that person's password, who could then log in to it. The callers count each
    try in the client's `auth` rate (marketplace/auth_rate.py), so a token is no way to guess its password."""
    data = _signup_payload(token)
    email = data["email"]
    if not check_password(password, data["password"]):
        raise SignupPasswordMismatch()
    email_canonical(email, field="token")  # a token issued before addresses were checked for delivery
    if len(email) > EMAIL_MAX_LENGTH:
        # A token issued before sign-up checked the limit on the normalised address: its account cannot be stored
        # (the insert was a DataError, a 500 on every try).
        raise ValidationFailed(email_too_long_message(len(email)) + " No account can be made with it: sign up "
                               "with another address.", field="token")
    try:
        with transaction.atomic():
            # The database's unique email_canonical refuses a second account for one mailbox (IntegrityError below).
            # The token came back from the address: it is verified (marketplace/services/email_verification.py).
            user = User(email=email, password=data["password"], email_verified_at=timezone.now())
            user.save()
            key, raw = _api_key_make(user=user, name=SIGNUP_KEY_NAME)
    except IntegrityError:  # the token used already, or another spelling of the address has an account by now
        raise InvalidSignupToken() from None
    return user, key, raw


# --- log-in -----------------------------------------------------------------------------------------------------

@dataclass
class LoginResult:
    user: User
    key: ApiKey
    raw_key: str
    replaced_keys: list[ApiKey] = field(default_factory=list)


def user_login(*, email: str, password: str, client_address: str | None = None,
               key_name: str = LOGIN_KEY_NAME, otp_code: str = "", base_url: str = "") -> LoginResult:
    """Check the password (behind the log-in lock-out: LoginLocked), and for an account with two-factor log-in the
    code (TwoFactorRequired without one, WrongCode on `otp_code`), and issue the key named `key_name`, replacing
    the previous key of that name: logging in again from the same client does not pile up keys. A key under a new
    name is e-mailed to the address (api_key_rotate); `base_url` is the site's root, for the e-mail's link."""
    # An absurdly long password is refused by the backend (marketplace.auth, core/password_validation): None here.
    user = authenticate(email=email, password=password, client_address=client_address)
    if user is None:
        raise InvalidCredentials()
    name = key_name or LOGIN_KEY_NAME
    if two_factor.two_factor_enabled(user=user):
        if not otp_code:
            raise TwoFactorRequired()
        # The code is used up in the key's transaction: a refusal (Conflict at API_KEYS_PER_USER_MAX) rolls its use
        # back. It was used up first, on its own, and a 409 cost a recovery code (or the authenticator's time step)
        # for no key; retries at the cap could use up every recovery code (found by review).
        try:
            with two_factor.code_spent(user=user, code=otp_code, client_address=client_address):
                key, raw, replaced = api_key_rotate(user=user, name=name, client_address=client_address,
                                                    base_url=base_url)
        except two_factor.WrongCode:
            # On the field the request has (TwoFactorRequired's too): it was answered on `code`, which it has not.
            raise two_factor.WrongCode(field="otp_code") from None
    else:
        key, raw, replaced = api_key_rotate(user=user, name=name, client_address=client_address, base_url=base_url)
    return LoginResult(user=user, key=key, raw_key=raw, replaced_keys=replaced)
