"""Accounts: home, sign-up, log in/out, SSH keys and API keys. Thin: the services hold the rules."""
from datetime import timedelta
from urllib.parse import unquote, urlsplit

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login, logout
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import LoginView
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from core.errors import ApplicationError, ValidationFailed
from core.web_errors import form_error
from marketplace.auth_rate import auth_rate_refusal
from marketplace.models import ApiKey, SshKey
from marketplace.reauth import with_form_status
from marketplace.services import accounts as account_svc
from marketplace.services import ssh_keys as ssh_svc
from marketplace.services import two_factor as two_factor_svc

from .forms import ApiKeyForm, LoginForm, SignupConfirmForm, SignupForm, SshKeyForm
from .two_factor import start_code_step


def home(request):
    return render(request, "marketplace/home.html")


class EmailLoginView(LoginView):
    template_name = "marketplace/login.html"
    authentication_form = LoginForm
    redirect_authenticated_user = True

    def post(self, request, *args, **kwargs):
        return auth_rate_refusal(request) or super().post(request, *args, **kwargs)

    def get_redirect_url(self):
        """The page asked for (`next`), unless it is this log-in page itself: then LOGIN_REDIRECT_URL. A signed-in
        user sent to /accounts/login/?next=/accounts/login/ (a link, a bookmark, a page that asked them to log in
        again) got a 500: Django's redirect_authenticated_user refuses a redirect to the page it is on ("Redirection
        loop for authenticated user detected"; found by review), and a log-in would only land on the form again. Nor
        the log-in's code step (found by review, r49)."""
        url = super().get_redirect_url()
        # Nor the code step: after the code the user, logged in, landed there and was told to log in again.
        return "" if url and unquote(urlsplit(url).path) in (self.request.path, reverse("login-code")) else url

    def form_valid(self, form):
        user = form.get_user()
        if two_factor_svc.two_factor_enabled(user=user):  # the password was right: now the code
            return start_code_step(self.request, user, self.get_redirect_url())
        return super().form_valid(form)

    def form_invalid(self, form):
        response = super().form_invalid(form)
        if form.locked is not None:  # the log-in lock-out: the form says how long to wait
            response.status_code = 429
            response["Retry-After"] = str(form.locked.retry_after)
        return response


@require_http_methods(["GET", "POST"])
def signup(request):
    if request.method == "POST" and (refused := auth_rate_refusal(request)):
        return refused
    form = SignupForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        account_svc.user_register(email=form.cleaned_data["email"], password=form.cleaned_data["password"],
                                  base_url=request.build_absolute_uri("/"))
        # The same page for a new address and one that has an account: only the e-mail tells them apart.
        return render(request, "marketplace/signup_sent.html", {"email": form.cleaned_data["email"]})
    return render(request, "marketplace/signup.html", {"form": form}, status=400 if form.errors else 200)


@require_http_methods(["GET", "POST"])
def signup_confirm(request, token: str):
    """The link in the sign-up e-mail. GET only shows the form: mail scanners that open links must not use up
    the token (and see the API key). The POST needs the password chosen at that sign-up (a link from someone
    else's sign-up with the address holds their password), behind the `auth` rate as the API's confirm."""
    if request.method == "POST" and (refused := auth_rate_refusal(request)):
        return refused
    form = SignupConfirmForm(request.POST or None, initial={"token": token})
    if request.method == "POST" and form.is_valid():
        try:
            user, _key, api_key = account_svc.user_register_confirm(token=form.cleaned_data["token"],
                                                                    password=form.cleaned_data["password"])
        except account_svc.InvalidSignupToken:
            form.add_error(None, "This link is invalid, has expired, or was used already. Sign up again, or log in "
                                 "if you confirmed it before.")
        except account_svc.SignupPasswordMismatch as exc:
            form.add_error("password", exc.message)
        except ValidationFailed as exc:  # e.g. a token whose address is too long to be an account's
            form.add_error(None, exc.message)
        else:
            login(request, user, backend=settings.AUTHENTICATION_BACKENDS[0])
            # The key is shown once, on the very next page, then forgotten.
            response = render(request, "marketplace/signup_done.html", {"api_key": api_key})
            response["Cache-Control"] = "no-store"
            return response
    return render(request, "marketplace/signup_confirm.html", {"form": form}, status=400 if form.errors else 200)


@require_POST
def logout_view(request):
    logout(request)
    return redirect("home")


# ------------------------------------------------------------------------------------------- SSH keys

@login_required
@require_http_methods(["GET", "POST"])
def ssh_keys(request):
    form = SshKeyForm(request.POST or None, user=request.user, request=request)
    if request.method == "POST" and form.is_valid():
        try:
            key = ssh_svc.ssh_key_create(user=request.user, public_key=form.cleaned_data["public_key"],
                                         name=form.cleaned_data["name"])
        except ApplicationError as exc:  # a key that does not parse, or one of yours already
            form_error(form, exc, default_field="public_key")
        else:
            messages.success(request, f"Key “{key.name or key.fingerprint}” added ({key.fingerprint}).")
            return redirect("ssh-keys")
    keys = SshKey.objects.filter(user=request.user).order_by("-created_at", "-id")
    return with_form_status(render(request, "marketplace/ssh_keys.html", {"form": form, "keys": keys}), form)


@login_required
@require_POST
def ssh_key_delete(request, pk: int):
    key = get_object_or_404(SshKey, pk=pk, user=request.user)
    ssh_svc.ssh_key_delete(ssh_key=key)
    messages.success(request, f"Key “{key.name or key.fingerprint}” deleted. Instances created with it keep it.")
    return redirect("ssh-keys")


# ------------------------------------------------------------------------------------------- API keys

@login_required
@require_http_methods(["GET", "POST"])
def api_keys(request):
    form = ApiKeyForm(request.POST or None, user=request.user, request=request)
    created = None
    if request.method == "POST" and form.is_valid():
        days = form.cleaned_data["expires_in_days"]
        try:
            key, raw = account_svc.api_key_create(
                user=request.user, name=form.cleaned_data["name"], scopes=form.cleaned_data["scopes"],
                expires_at=timezone.now() + timedelta(days=days) if days else None,
                base_url=request.build_absolute_uri("/"))
        except ApplicationError as exc:
            form_error(form, exc, default_field="scopes")
        else:
            # Rendered, not redirected: the raw key exists only in this one answer.
            created = {"key": key, "raw": raw}
            form = ApiKeyForm(user=request.user, request=request)
    keys = ApiKey.objects.active().filter(user=request.user)
    response = with_form_status(
        render(request, "marketplace/api_keys.html", {"form": form, "keys": keys, "created": created}), form)
    if created:
        response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def api_key_revoke(request, pk: int):
    key = get_object_or_404(ApiKey.objects.active(), pk=pk, user=request.user)
    account_svc.api_key_revoke(api_key=key)
    messages.success(request, f"Key {key.prefix}… revoked: requests with it are refused from now on.")
    return redirect("api-keys")
