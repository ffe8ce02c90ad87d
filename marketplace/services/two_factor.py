"""Optional two-factor log-in: a TOTP authenticator app and one-time recovery codes (django-otp devices).

Enrolling starts with the account's password (behind the log-in lock-out) and makes an unconfirmed TOTP device
whose secret is shown once, in the answer to that password (as text, an otpauth:// URI and a QR code); a right code
from the app for it then confirms it and makes RECOVERY_CODES recovery codes, also shown once. From then on a log-in
(web, API, admin) needs a code after the password. Disabling needs the password and a code.

The secret is revealed only to whoever proves the password, and never again: a copied session cookie is the same
session as the owner's, so nothing tied to the session alone can tell the owner from its copy. A new start (the
password again) replaces the user's unconfirmed secret; nothing else does, so whoever lacks the password can
neither learn the secret the owner turns on nor disturb the owner's enrolment. An unconfirmed secret can be
confirmed for ENROL_TIMEOUT, by the code of the secret the caller names (the page keeps its id in the session);
wrong enrolment codes count in the lock-out like the log-in's.

Code guessing is behind the log-in lock-out (core/login_throttle.py) with a counter of its own per account
(`two-factor:<email>`), which a right password does not reset, and the address's counter, shared with passwords;
django-otp's own per-device throttling (a growing delay after each failure) comes on top.

The secret and the recovery codes are stored encrypted (marketplace/models/two_factor.py: django-otp devices of
the project's own, since django-otp's TOTPDevice and StaticToken keep them readable). Turning two-factor on
ends every other session of the user (the page that did it keeps its own), which is why it needs the password as
turning it off does; either way the address is told by e-mail.
"""
import base64
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from io import BytesIO

import qrcode
import qrcode.image.svg
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_otp.models import Device

from core.errors import Conflict, ValidationFailed
from core.login_throttle import login_attempt
from core.security_mail import security_change_notify
from marketplace.models import AuthenticatorDevice, RecoveryCode, RecoveryCodeDevice, User
from marketplace.services import passwords

RECOVERY_CODES = 10
CODE_MAX_LENGTH = 32
TOTP_NAME = "authenticator app"
RECOVERY_NAME = "recovery codes"
_TOTP_CODE = re.compile(r"[0-9]{6}")
ALREADY_ON = "Two-factor log-in is on already: turn it off first to move it to another app."
ENROL_TIMEOUT = timedelta(minutes=15)  # how long an unconfirmed secret can be confirmed
ENROL_GONE = ("That secret can no longer be turned on: it expired (a secret works for 15 minutes) or a newer one "
              "was made in its place (starting again, in any tab or browser, makes a new one). Start again: your "
              "password, then a new secret for your app (delete the old one there).")


class WrongCode(ValidationFailed):
    """`field`: the name of the code's field where the caller asked for it (the API log-in's is `otp_code`)."""

    def __init__(self, field: str = "code") -> None:
        super().__init__("That code is not right (or was used already). Codes change every 30 seconds; a recovery "
                         "code works once.", field=field)


def _throttle_account(user: User) -> str:
    return f"two-factor:{user.email}"


def two_factor_enabled(*, user: User) -> bool:
    return bool(AuthenticatorDevice.objects.filter(user=user, confirmed=True).exists())


def totp_confirmed(*, user: User) -> AuthenticatorDevice | None:
    """The user's authenticator, when two-factor is on."""
    device: AuthenticatorDevice | None = AuthenticatorDevice.objects.filter(user=user, confirmed=True).first()
    return device


def totp_pending(*, user: User, device_id: object) -> AuthenticatorDevice | None:
    """The unconfirmed authenticator `device_id` (the one a start made), while it is the user's and younger than
    ENROL_TIMEOUT; else None."""
    if not isinstance(device_id, int) or isinstance(device_id, bool):
        return None
    device: AuthenticatorDevice | None = AuthenticatorDevice.objects.filter(
        user=user, pk=device_id, confirmed=False, created_at__gt=timezone.now() - ENROL_TIMEOUT).first()
    return device


class WrongPassword(ValidationFailed):
    def __init__(self) -> None:
        super().__init__("Your password was entered incorrectly.", field="password")


def totp_enrol_start(*, user: User, password: str, client_address: str | None) -> AuthenticatorDevice:
    """A new secret to add to an app, for whoever proves the account's password (behind the log-in lock-out:
    LoginLocked, WrongPassword), in place of every unconfirmed one of the user. The caller shows it once, to that
    caller only: it is the only way to learn it. Conflict when two-factor is on."""
    if two_factor_enabled(user=user):
        raise Conflict(ALREADY_ON)
    if not passwords.password_check(user=user, password=password, client_address=client_address):
        raise WrongPassword()
    with transaction.atomic():
        User.objects.select_for_update().filter(pk=user.pk).first()
        if two_factor_enabled(user=user):
            raise Conflict(ALREADY_ON)
        AuthenticatorDevice.objects.filter(user=user, confirmed=False).delete()
        return AuthenticatorDevice.new(user=user, name=TOTP_NAME)


def totp_enrol_confirm(*, user: User, device_id: object, code: str, client_address: str | None,
                       base_url: str = "") -> list[str]:
    """Confirm the unconfirmed authenticator `device_id` (made by totp_enrol_start, whose caller proved the
    password) with a code it shows; two-factor is on from now. Returns the new recovery codes (shown once).
    ValidationFailed on `code` (ENROL_GONE) when that secret expired or a newer start replaced it; WrongCode for a
    wrong code, which leaves the secret pending (the owner may mistype) and counts in the log-in lock-out like the
    log-in's code step (LoginLocked): guessing it would turn two-factor on and show the recovery codes.

    The code is the proof that the caller holds the secret, which only the password's answer showed: a session
    alone (a copied cookie) cannot confirm, nor learn what was confirmed. Turning it on ends every other session
    and is told to the address by e-mail."""
    if two_factor_enabled(user=user):
        raise Conflict(ALREADY_ON)
    if totp_pending(user=user, device_id=device_id) is None:
        raise ValidationFailed(ENROL_GONE, field="code")
    code = _normalise(code)
    # The place in the lock-out's counters is taken before the code is looked at (exact under parallel guesses).
    with login_attempt(account=_throttle_account(user), address=client_address) as attempt:
        with transaction.atomic():
            # The user's row first: two confirmations at once end with one authenticator, not two.
            User.objects.select_for_update().filter(pk=user.pk).first()
            if two_factor_enabled(user=user):
                raise Conflict(ALREADY_ON)
            device = totp_pending(user=user, device_id=device_id)
            if device is None:  # expired, or replaced, meanwhile
                raise ValidationFailed(ENROL_GONE, field="code")
            confirmed = device.verify_token(code)
            if confirmed:
                device.confirmed = True
                device.save(update_fields=["confirmed"])
                AuthenticatorDevice.objects.filter(user=user, confirmed=False).delete()
                codes = _recovery_codes_make(user)
                # A session someone else holds (a shared computer, a stolen cookie) must not outlive the upgrade.
                user.end_other_sessions()
                security_change_notify(
                    user=user, subject="Two-factor log-in was turned on", base_url=base_url,
                    change=(f"Two-factor log-in was just turned on for your {settings.PLATFORM_NAME} account: "
                            "logging in now needs a code from an authenticator app after the password. Every other "
                            "browser logged in to it was logged out."))
        # Outside the transaction: a wrong code's throttling (django-otp's delay) is written, not rolled back.
        if not confirmed:
            attempt.failed()
            raise WrongCode()
        attempt.succeeded()
        return codes


def _recovery_code() -> str:
    # 40 random bits in base32, as django-otp's StaticToken.random_token; typed lower-case (see _normalise).
    return base64.b32encode(os.urandom(5)).decode("ascii").lower()


def _recovery_codes_make(user: User) -> list[str]:
    device, _ = RecoveryCodeDevice.objects.get_or_create(user=user, name=RECOVERY_NAME,
                                                         defaults={"confirmed": True})
    device.codes.all().delete()
    codes = [_recovery_code() for _ in range(RECOVERY_CODES)]
    RecoveryCode.objects.bulk_create([RecoveryCode.make(device=device, code=code) for code in codes])
    return codes


def recovery_codes_regenerate(*, user: User, base_url: str = "") -> list[str]:
    """New recovery codes in place of the old ones (which stop working), told to the address by e-mail: whoever
    made them can log in with them. The caller checked the password (web/two_factor.py)."""
    if not two_factor_enabled(user=user):
        raise Conflict("Two-factor log-in is off: there are no recovery codes to replace.")
    with transaction.atomic():
        codes = _recovery_codes_make(user)
        security_change_notify(
            user=user, subject="New two-factor recovery codes were made", base_url=base_url,
            change=(f"New two-factor recovery codes were just made for your {settings.PLATFORM_NAME} account; "
                    "the ones you had stopped working."))
        return codes


def recovery_codes_left(*, user: User) -> int:
    return int(RecoveryCode.objects.filter(device__user=user, device__confirmed=True).count())


def _normalise(code: str) -> str:
    return re.sub(r"[\s-]", "", code or "").lower()


def code_check(*, user: User, code: str, client_address: str | None) -> Device:
    """The device (authenticator or recovery codes) that accepts `code`, behind the lock-out; WrongCode if none.
    A recovery code is used up (an authenticator's code too: its time step cannot be used again). For a step that
    the code allows and that may still be refused, code_spent: the code is used up only with that step."""
    with code_spent(user=user, code=code, client_address=client_address) as device:
        return device


@contextmanager
def code_spent(*, user: User, code: str, client_address: str | None) -> Iterator[Device]:
    """code_check for a step that the code allows: the body runs inside the transaction that uses the code up (a
    recovery code deleted, the authenticator's last time step moved on), so a refusal raised in it (a Conflict at the
    API key cap, say) rolls that back and the code works again; the code is spent only with what it bought. The
    device rows stay locked (FOR UPDATE) until then: a second log-in with the same code waits, and then finds it
    used (or, after a refusal, unused). A wrong code's throttling is committed (no body runs), and the lock-out's
    counters, in the cache, are outside the transaction: a right code gives its place back even when the body is
    refused, which is no wrong guess."""
    code = _normalise(code)
    device_class = AuthenticatorDevice if _TOTP_CODE.fullmatch(code) else RecoveryCodeDevice
    # The place in the lock-out's counters is taken before the code is looked at (exact under parallel guesses).
    with login_attempt(account=_throttle_account(user), address=client_address) as attempt:
        with transaction.atomic():
            accepted = None
            for device in device_class.objects.filter(user=user, confirmed=True).select_for_update():
                if device.verify_token(code):
                    accepted = device
                    break
            if accepted is not None:
                attempt.succeeded()
                yield accepted  # an error here rolls the code's use back with the body's writes
                return
        attempt.failed()
    raise WrongCode()


def two_factor_disable(*, user: User, base_url: str = "") -> None:
    """Turn two-factor off: forget the authenticator and the recovery codes, and tell the address by e-mail. The
    caller checked the password and a code (or is an operator, in the admin)."""
    with transaction.atomic():
        was_on = two_factor_enabled(user=user)
        AuthenticatorDevice.objects.filter(user=user).delete()
        RecoveryCodeDevice.objects.filter(user=user).delete()
        if not was_on:  # nothing changed (an operator's action over many users, an unconfirmed enrolment)
            return
        security_change_notify(
            user=user, subject="Two-factor log-in was turned off", base_url=base_url,
            change=(f"Two-factor log-in was just turned off for your {settings.PLATFORM_NAME} account: a password "
                    "alone logs in to it again."))


def secret_base32(device: AuthenticatorDevice) -> str:
    return base64.b32encode(device.bin_key).decode("ascii").rstrip("=")


def qr_svg(uri: str) -> str:
    """The otpauth:// URI as a QR code, an SVG element (drawn here: no request leaves the page)."""
    image = qrcode.make(uri, image_factory=qrcode.image.svg.SvgPathImage, box_size=8, border=2)
    out = BytesIO()
    image.save(out)
    svg = out.getvalue().decode("utf-8")
    return svg[svg.index("<svg"):]
