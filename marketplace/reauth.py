"""A change a browser session alone (a copied cookie) must not make needs more: an API key, or the account's
password asked again behind the log-in lock-out (core.login_throttle.password_confirm). The pages' form pieces and
the API's refusal, for every app (notifications' webhook endpoints too, which import no marketplace services or
pages)."""
from django import forms
from django.contrib.auth.forms import PasswordChangeForm
from django.core.exceptions import ValidationError
from rest_framework import exceptions

from core.client_address import client_ip
from core.login_throttle import LoginLocked, password_confirm
from core.password_validation import password_checkable
from marketplace.auth import lockout_message
from marketplace.models import ApiKey


def refuse_session_alone(request, *, instead: str) -> None:
    """A change that outlives the session (a key, where earnings go, where events are sent) is not made by a
    browser session alone: an API key, or a page that asks for the password, proves more. `instead` says where
    to do it, e.g. "on the SSH keys page (it asks for your password)"."""
    if not isinstance(request.auth, ApiKey):
        raise exceptions.PermissionDenied(f"Do this {instead} or with an API key; a browser session alone cannot.")


class LockoutMixin:
    """A lock-out (too many wrong passwords or codes) becomes a form error saying how long to wait; `locked` keeps
    it for the view's 429."""

    locked: LoginLocked | None = None

    def _check_password(self, user, password: str, request) -> None:
        try:
            # An absurd length is a wrong password, not hashed nor counted (core/password_validation.py).
            ok = password_checkable(password) and password_confirm(user=user, password=password,
                                                                   client_address=client_ip(request))
        except LoginLocked as locked:
            self.locked = locked
            raise ValidationError(lockout_message(locked), code="throttled") from None
        if not ok:
            raise ValidationError("Your password was entered incorrectly.", code="password_incorrect")


def with_form_status(response, form):
    """A page's answer to its form: 400 when the form has errors, 429 with Retry-After when the log-in lock-out
    refused the password (`form.locked`), else as rendered."""
    if form.errors:
        response.status_code = 400
    locked = getattr(form, "locked", None)
    if locked is not None:
        response.status_code = 429
        response["Retry-After"] = str(locked.retry_after)
    return response


def current_password_field(help_text: str = "") -> forms.CharField:
    # No PASSWORD_MAX_LENGTH: it bounds a password being set, and an account may hold a longer one set before the
    # bound held everywhere (core/password_validation.py); _check_password answers an absurd length as wrong.
    return forms.CharField(strip=False, help_text=help_text,
                           widget=forms.PasswordInput(attrs={"autocomplete": "current-password"}))


class PasswordConfirmedForm(LockoutMixin, forms.Form):
    """A form for a change a session alone (a copied cookie) must not make: the account's password is asked and
    checked behind the log-in lock-out. Subclasses word the field's help for their change (`why_asked`)."""

    why_asked = "Your account's password."

    def __init__(self, *args, user, request, **kwargs):
        super().__init__(*args, **kwargs)
        self.user, self.request = user, request
        self.fields["password"] = current_password_field(self.why_asked)

    def clean_password(self):
        password = self.cleaned_data["password"]
        self._check_password(self.user, password, self.request)
        return password


class PasswordOnlySave:
    """Save the new password alone. Django's forms save the whole user row as it was read at the request's start: an
    operator's change of the address (or of the active flag) committed meanwhile was written back to the old value
    (an account turned off came back on, with the new password). The password's hash changes all the same, so every
    other session ends (Django checks the hash), and AbstractBaseUser.save still reports the change to the
    validators."""

    cleaned_data: dict

    def set_password_and_save(self, user, password_field_name="password1", commit=True):  # noqa: S107 (Django's)
        user.set_password(self.cleaned_data[password_field_name])
        if commit:
            user.save(update_fields=["password"])
        return user


class ThrottledPasswordChangeForm(PasswordOnlySave, LockoutMixin, PasswordChangeForm):
    """Django's password change form; the old password is checked behind the log-in lock-out. The site's page
    (/account/password/) and the admin's (/admin/password_change/) both use it: neither may be a way to guess the
    password with a session alone."""

    def __init__(self, user, *args, request=None, **kwargs):
        super().__init__(user, *args, **kwargs)
        self.request = request

    def clean_old_password(self):
        old = self.cleaned_data["old_password"]
        self._check_password(self.user, old, self.request)
        return old
