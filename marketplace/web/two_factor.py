"""The account's security page and two-factor log-in: enrol (secret, otpauth URI, QR code), confirm, recovery
codes, disable (password and code), and the code step of the log-in. Thin: marketplace/services/two_factor.py."""
import time

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model, login, update_session_auth_hash
from django.contrib.auth.decorators import login_required
from django.http import HttpResponseRedirect
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST
from django_otp import login as otp_login

from core.client_address import client_ip
from core.errors import ApplicationError, Conflict
from core.web_errors import form_error
from marketplace.auth import LoginLocked, lockout_message
from marketplace.reauth import with_form_status
from marketplace.services import two_factor as svc

from .account_forms import (
    RecoveryCodesForm,
    TwoFactorConfirmForm,
    TwoFactorDisableForm,
    TwoFactorLoginForm,
)

PENDING = "two_factor_pending"
ENROLLING = "two_factor_enrolling"  # the id of the unconfirmed authenticator this session was shown


def _no_store(response):
    response["Cache-Control"] = "no-store"
    return response


def _security_page(request, recovery_form: RecoveryCodesForm, status: int = 200):
    user = request.user
    response = render(request, "marketplace/account_security.html", {
        "two_factor": svc.two_factor_enabled(user=user),
        "codes_left": svc.recovery_codes_left(user=user),
        "recovery_form": recovery_form,
    }, status=status)
    if recovery_form.locked:
        response["Retry-After"] = str(recovery_form.locked.retry_after)
    return response


@login_required
def security(request):
    return _security_page(request, RecoveryCodesForm(user=request.user, request=request))


@login_required
@never_cache
@require_http_methods(["GET", "POST"])
def two_factor_enable(request):
    """GET: the secret to add to an app; POST: confirm with the password and the app's code, then the recovery
    codes, once. The secret is this session's (its id in the session, ENROLLING): another session opening the page
    makes a new one, and one older than the service's ENROL_TIMEOUT is replaced."""
    held = request.session.get(ENROLLING)
    try:
        device = svc.totp_enrol_start(user=request.user, device_id=held)
    except ApplicationError as exc:
        messages.info(request, exc.message)
        return redirect("account-security")
    request.session[ENROLLING] = device.pk
    form = TwoFactorConfirmForm(request.POST or None)
    locked = None
    if request.method == "POST" and form.is_valid():
        try:
            # `held`, not device.pk: a secret made just now, in place of one that expired or another session
            # replaced, was never shown, so no code for it can be right (ENROL_GONE says to add the new one).
            codes = svc.totp_enrol_confirm(user=request.user, device_id=held, code=form.cleaned_data["code"],
                                           password=form.cleaned_data["password"], client_address=client_ip(request),
                                           base_url=request.build_absolute_uri("/"))
        except LoginLocked as exc:
            locked = exc
            form.add_error(None, lockout_message(exc))
        except Conflict as exc:  # turned on meanwhile, from another session
            messages.info(request, exc.message)
            return redirect("account-security")
        except ApplicationError as exc:
            form_error(form, exc, default_field="code")
            try:
                device = svc.totp_enrol_start(user=request.user, device_id=device.pk)  # a new one if it expired
            except ApplicationError as gone:
                messages.info(request, gone.message)
                return redirect("account-security")
            request.session[ENROLLING] = device.pk
        else:
            request.session.pop(ENROLLING, None)
            update_session_auth_hash(request, request.user)  # the other sessions ended; this one stays
            otp_login(request, device)
            return _no_store(render(request, "marketplace/two_factor_codes.html", {"codes": codes, "new": True}))
    uri = device.config_url
    response = _no_store(render(request, "marketplace/two_factor_enable.html", {
        "form": form, "secret": svc.secret_base32(device), "uri": uri, "qr_svg": svc.qr_svg(uri),
        "minutes": int(svc.ENROL_TIMEOUT.total_seconds() // 60),
    }, status=(429 if locked else 400) if form.errors else 200))
    if locked:
        response["Retry-After"] = str(locked.retry_after)
    return response


@login_required
@require_POST
def two_factor_restart(request):
    try:
        device = svc.totp_enrol_restart(user=request.user)
    except ApplicationError as exc:
        messages.info(request, exc.message)
        return redirect("account-security")
    request.session[ENROLLING] = device.pk
    return redirect("two-factor-enable")


@login_required
@require_POST
def recovery_codes_regenerate(request):
    """New recovery codes, with the password (on the security page's form)."""
    form = RecoveryCodesForm(request.POST, user=request.user, request=request)
    if not form.is_valid():
        return _security_page(request, form, status=429 if form.locked else 400)
    try:
        codes = svc.recovery_codes_regenerate(user=request.user, base_url=request.build_absolute_uri("/"))
    except ApplicationError as exc:
        messages.info(request, exc.message)
        return redirect("account-security")
    return _no_store(render(request, "marketplace/two_factor_codes.html", {"codes": codes, "new": False}))


@login_required
@require_http_methods(["GET", "POST"])
def two_factor_disable(request):
    if not svc.two_factor_enabled(user=request.user):
        messages.info(request, "Two-factor log-in is off.")
        return redirect("account-security")
    form = TwoFactorDisableForm(request.POST or None, user=request.user, request=request)
    if request.method == "POST" and form.is_valid():
        svc.two_factor_disable(user=request.user, base_url=request.build_absolute_uri("/"))
        messages.success(request, "Two-factor log-in is off: a password alone logs in to your account again.")
        return redirect("account-security")
    return with_form_status(render(request, "marketplace/two_factor_disable.html", {"form": form}), form)


# ------------------------------------------------------------------------------------------- the log-in's code step

def start_code_step(request, user, next_url: str):
    """After a right password, for an account with two-factor on: remember who (not logged in yet) and ask for
    the code."""
    request.session.cycle_key()
    request.session[PENDING] = {"user": user.pk, "hash": user.get_session_auth_hash(), "at": time.time(),
                                "next": next_url, "backend": user.backend}
    return redirect("login-code")


def _pending_user(request):
    pending = request.session.get(PENDING)
    if not isinstance(pending, dict) or time.time() - pending.get("at", 0) > settings.TWO_FACTOR_LOGIN_TIMEOUT_S:
        return None, None
    user = get_user_model().objects.filter(pk=pending.get("user"), is_active=True).first()
    if user is None or user.get_session_auth_hash() != pending.get("hash"):
        return None, None
    return user, pending


@never_cache
@require_http_methods(["GET", "POST"])
def login_code(request):
    user, pending = _pending_user(request)
    if user is None:
        request.session.pop(PENDING, None)
        messages.info(request, "Log in again: the code step lasts a few minutes.")
        return redirect("login")
    form = TwoFactorLoginForm(request.POST or None)
    status = 200
    if request.method == "POST" and form.is_valid():
        try:
            device = svc.code_check(user=user, code=form.cleaned_data["code"], client_address=client_ip(request))
        except LoginLocked as locked:
            form.add_error(None, lockout_message(locked))
            response = render(request, "marketplace/login_code.html", {"form": form}, status=429)
            response["Retry-After"] = str(locked.retry_after)
            return response
        except ApplicationError as exc:
            form_error(form, exc, default_field="code")
            status = 400
        else:
            request.session.pop(PENDING, None)
            login(request, user, backend=pending["backend"])
            otp_login(request, device)
            next_url = pending.get("next") or ""
            if not url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()},
                                                   require_https=request.is_secure()):
                return redirect(settings.LOGIN_REDIRECT_URL)
            # A URL, never a URL name: redirect() would reverse a bare word such as "ssh-key-delete" (a 500, after
            # the code was used up).
            return HttpResponseRedirect(next_url)
    if form.errors:
        status = 400
    return render(request, "marketplace/login_code.html", {"form": form}, status=status)

