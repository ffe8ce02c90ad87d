"""Forms of the account pages: password reset and change, two-factor. Django's own auth forms where there is one;
the checks of a typed password go through the log-in lock-out (marketplace/reauth.py)."""
from django import forms
from django.contrib.auth.forms import SetPasswordForm
from django.core.exceptions import ValidationError

from core.client_address import client_ip
from core.email_address import email_canonical
from core.errors import ValidationFailed
from marketplace.auth import LoginLocked, lockout_message
from marketplace.reauth import (
    LockoutMixin,
    PasswordConfirmedForm,
    PasswordOnlySave,
    ThrottledPasswordChangeForm,
    current_password_field,
)
from marketplace.services import two_factor as two_factor_svc
from marketplace.validators import EMAIL_MAX_LENGTH


class PasswordResetRequestForm(forms.Form):
    email = forms.EmailField(max_length=EMAIL_MAX_LENGTH,
                             widget=forms.EmailInput(attrs={"autocomplete": "email", "autofocus": True}),
                             help_text="The address you log in with.")

    def clean_email(self):
        # An address no e-mail can reach (its domain cannot be encoded for delivery) is refused, as at sign-up.
        email = self.cleaned_data["email"]
        try:
            email_canonical(email)
        except ValidationFailed as exc:
            raise ValidationError(exc.message) from None
        return email


class PasswordResetSetForm(PasswordOnlySave, SetPasswordForm):
    """The new password of a reset (web/passwords.PasswordResetConfirmView)."""


class PasswordChangeForm(ThrottledPasswordChangeForm):
    """The site's password change (web/passwords.PasswordChangeView): the old password behind the log-in
    lock-out."""


class RecoveryCodesForm(PasswordConfirmedForm):
    """New recovery codes log in as the account: not for a session alone (a copied cookie)."""

    why_asked = "Your account's password: the codes you have now stop working."


CODE_FIELD = forms.CharField(
    label="Code", max_length=two_factor_svc.CODE_MAX_LENGTH, strip=True,
    widget=forms.TextInput(attrs={"autocomplete": "one-time-code", "inputmode": "numeric", "autofocus": True}),
    help_text="The 6 digits your authenticator app shows now, or one of your recovery codes.")


class TwoFactorLoginForm(forms.Form):
    code = CODE_FIELD


class TwoFactorStartForm(forms.Form):
    # Checked by the service, behind the log-in lock-out (two_factor.totp_enrol_start), not here.
    password = current_password_field("Your account's password: the secret is shown only after it.")


class TwoFactorConfirmForm(forms.Form):
    code = forms.CharField(
        label="Code from the app", max_length=two_factor_svc.CODE_MAX_LENGTH, strip=True,
        widget=forms.TextInput(attrs={"autocomplete": "one-time-code", "inputmode": "numeric", "autofocus": True}),
        help_text="The 6 digits the app shows for this account once you have added it. Turning two-factor on logs "
                  "out every other browser.")
    # The secret the page showed (its id, no secret): a newer start, in another tab, is told apart from a wrong code.
    enrolment = forms.IntegerField(required=False, widget=forms.HiddenInput)


class TwoFactorDisableForm(LockoutMixin, forms.Form):
    password = current_password_field()
    code = forms.CharField(
        label="Code", max_length=two_factor_svc.CODE_MAX_LENGTH, strip=True,
        widget=forms.TextInput(attrs={"autocomplete": "one-time-code", "inputmode": "numeric"}),
        help_text="From your authenticator app, or a recovery code.")

    def __init__(self, *args, user, request, **kwargs):
        super().__init__(*args, **kwargs)
        self.user, self.request = user, request

    def clean(self):
        cleaned = super().clean()
        if "password" in cleaned and "code" in cleaned:
            try:
                self._check_password(self.user, cleaned["password"], self.request)
                two_factor_svc.code_check(user=self.user, code=cleaned["code"], client_address=client_ip(self.request))
            except LoginLocked as locked:
                self.locked = locked
                raise ValidationError(lockout_message(locked), code="throttled") from None
            except two_factor_svc.WrongCode as exc:
                raise ValidationError({"code": str(exc)}) from None
        return cleaned
