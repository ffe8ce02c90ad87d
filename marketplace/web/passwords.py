"""Password reset by e-mail and password change: Django's own views, with our templates and our token generator
(services/passwords.reset_tokens: bound to the account's state too), the per-address limit on reset e-mails, the
per-client `auth` rate on asking for one (marketplace/auth_rate.py auth_rate_refusal) and the log-in lock-out on the
old password (marketplace/services/passwords.py).
"""
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.http import HttpResponseRedirect
from django.urls import reverse_lazy

from marketplace.auth_rate import auth_rate_refusal
from marketplace.services import email_verification as email_svc
from marketplace.services import passwords as password_svc

from .account_forms import PasswordChangeForm, PasswordResetRequestForm, PasswordResetSetForm


class PasswordResetView(auth_views.PasswordResetView):
    """Ask for a reset link. The next page is the same whether or not the address has an account."""

    template_name = "marketplace/password_reset.html"
    form_class = PasswordResetRequestForm  # type: ignore[assignment]  # ours sends through the service
    success_url = reverse_lazy("password-reset-done")

    def post(self, request, *args, **kwargs):
        # Per client, before anything is sent: the per-address limit alone let one client mail any number of
        # addresses.
        return auth_rate_refusal(request) or super().post(request, *args, **kwargs)

    def form_valid(self, form):
        password_svc.password_reset_request(email=form.cleaned_data["email"],
                                            base_url=self.request.build_absolute_uri("/"))
        return HttpResponseRedirect(self.get_success_url())

    def form_invalid(self, form):
        response = super().form_invalid(form)
        response.status_code = 400
        return response


class PasswordResetDoneView(auth_views.PasswordResetDoneView):
    template_name = "marketplace/password_reset_sent.html"


class PasswordResetConfirmView(auth_views.PasswordResetConfirmView):
    """The link from the e-mail (Django moves the token into the session, then shows the form). A new password
    ends every session of the account; the user logs in with it."""

    template_name = "marketplace/password_reset_confirm.html"
    form_class = PasswordResetSetForm  # Django's SetPasswordForm, saving the password alone
    success_url = reverse_lazy("password-reset-complete")
    post_reset_login = False
    token_generator = password_svc.reset_tokens  # bound to the account's state too: the one that made the link

    def get_user(self, uidb64):
        """The account, while it is on: a deactivated account's link is an invalid link (as the verification
        link's; reset links are mailed to active accounts only). Its token is void too (reset_tokens)."""
        user = super().get_user(uidb64)
        return user if user is not None and user.is_active else None

    def form_valid(self, form):
        response = super().form_valid(form)
        email_svc.email_mark_verified(user=form.user)  # the link came from the address
        password_svc.password_changed_notify(user=form.user, base_url=self.request.build_absolute_uri("/"))
        return response

    def form_invalid(self, form):
        response = super().form_invalid(form)
        response.status_code = 400
        return response


class PasswordResetCompleteView(auth_views.PasswordResetCompleteView):
    template_name = "marketplace/password_reset_done.html"


class PasswordChangeView(auth_views.PasswordChangeView):
    """Change the password (the old one first, behind the log-in lock-out). This session stays logged in; every
    other session of the account ends."""

    template_name = "marketplace/password_change.html"
    form_class = PasswordChangeForm  # saves the password alone
    success_url = reverse_lazy("account-security")

    def get_form_kwargs(self):
        return {**super().get_form_kwargs(), "request": self.request}

    def form_valid(self, form):
        response = super().form_valid(form)
        password_svc.password_changed_notify(user=form.user, base_url=self.request.build_absolute_uri("/"))
        messages.success(self.request, "Password changed. Every other browser logged in to your account was "
                                       "logged out.")
        return response

    def form_invalid(self, form):
        response = super().form_invalid(form)
        response.status_code = 429 if form.locked is not None else 400
        if form.locked is not None:
            response["Retry-After"] = str(form.locked.retry_after)
        return response
