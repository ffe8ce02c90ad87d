"""Every password log-in (the API's, the web pages', the admin's) goes through this backend, so all of them share
the lock-out of core.login_throttle; the form mixin turns a lock-out into an error that says how long to wait.

A locked attempt raises LoginLocked out of django.contrib.auth.authenticate() (it is not PermissionDenied, which
authenticate() would swallow into "wrong password"): a path that does not handle it fails closed.
"""
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import ValidationError

from core.client_address import client_ip
from core.login_throttle import LoginLocked, login_attempt, normalize_account
from core.password_validation import password_checkable

__all__ = ["LoginLocked", "ThrottledLoginFormMixin", "ThrottledModelBackend", "lockout_message"]


class ThrottledModelBackend(ModelBackend):
    """Django's email + password check, behind the lock-out.

    The client's address comes from `request` (web and admin forms) or `client_address` (the API's service,
    which takes no request). Unknown emails cost the same password hashing as wrong passwords (ModelBackend),
    and count and lock the same way. A password over PASSWORD_CHECK_MAX_LENGTH is wrong, unhashed and uncounted."""

    def authenticate(self, request, username=None, password=None, client_address=None, **kwargs):
        if username is None:
            username = kwargs.get("email")
        if username is None or password is None:
            return None
        # An absurd length is a wrong password, neither hashed nor counted (core/password_validation.py): here, so
        # every log-in path has it, the admin's included (its form had none: found by review).
        if not password_checkable(password):
            return None
        email = normalize_account(username)
        if client_address is None and request is not None:
            client_address = client_ip(request)
        # The attempt takes its place in the lock-out's counters before the password is looked at (exact under
        # parallel guesses).
        with login_attempt(account=email, address=client_address) as attempt:
            user = super().authenticate(request, username=email, password=password)
            if user is None:
                attempt.failed()
            else:
                attempt.succeeded()
        return user


def lockout_message(locked: LoginLocked) -> str:
    minutes = locked.minutes
    return (f"Too many failed log-ins for this email or from your network. Wait {minutes} "
            f"minute{'s' if minutes != 1 else ''} and try again.")


class ThrottledLoginFormMixin:
    """For AuthenticationForm subclasses: a lock-out becomes a form error; `locked` keeps it for the view."""

    locked: LoginLocked | None = None

    def clean(self):
        try:
            return super().clean()
        except LoginLocked as locked:
            self.locked = locked
            self.user_cache = None
            raise ValidationError(lockout_message(locked), code="throttled") from None
