"""The account's security page and two-factor log-in: enrol (the password, then the secret, otpauth URI and QR
code, shown once), confirm with a code, recovery codes, disable (password and code), and the code step of the
log-in. Thin: marketplace/services/two_factor.py."""
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
    TwoFactorStartForm,
)

PENDING = "two_factor_pending"
ENROLLING = "two_factor_enrolling"  # the id of the unconfirmed authenticator this session's password started


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


def _enable_page(request, *, start_form=None, code_form=None, device=None, gone="", locked=None, status=200):
    """The enable page: the password form (start_form, after `gone`: why a secret can no longer be turned on), or
    the code form (code_form), with the secret only when `device` is given: in the answer to the password, never
    again."""
    context = {"start_form": start_form, "code_form": code_form, "gone": gone,
               "minutes": int(svc.ENROL_TIMEOUT.total_seconds() // 60)}
    if device is not None:
        uri = device.config_url
        context.update(secret=svc.secret_base32(device), uri=uri, qr_svg=svc.qr_svg(uri))
    response = _no_store(render(request, "marketplace/two_factor_enable.html", context, status=status))
    if locked is not None:
        response.status_code = 429
        response["Retry-After"] = str(locked.retry_after)
    return response


@login_required
@never_cache
@require_http_methods(["GET", "POST"])
def two_factor_enable(request):
    """GET: the password form (nothing is made or changed: a session alone, a copied cookie, can neither learn nor
    disturb an enrolment). POST with the right password: a new secret in place of any unconfirmed one, shown in
    this answer only (its id kept in the session), with the code form."""
    if svc.two_factor_enabled(user=request.user):
        messages.info(request, svc.ALREADY_ON)
        return redirect("account-security")
    form = TwoFactorStartForm(request.POST or None)
    if request.method != "POST" or not form.is_valid():
        return _enable_page(request, start_form=form, status=400 if form.errors else 200)
    try:
        device = svc.totp_enrol_start(user=request.user, password=form.cleaned_data["password"],
                                      client_address=client_ip(request))
    except LoginLocked as locked:
        form.add_error(None, lockout_message(locked))
        return _enable_page(request, start_form=form, locked=locked)
    except Conflict as exc:  # turned on meanwhile, from another session
        messages.info(request, exc.message)
        return redirect("account-security")
    except ApplicationError as exc:
        form_error(form, exc, default_field="password")
        return _enable_page(request, start_form=form, status=400)
    # The password was right: this session moves to a new key, so a copy of its cookie made before is logged out.
    request.session.cycle_key()
    request.session[ENROLLING] = device.pk
    return _enable_page(request, code_form=TwoFactorConfirmForm(initial={"enrolment": device.pk}), device=device)


@login_required
@never_cache
@require_POST
def two_factor_confirm(request):
    """The code of the secret the password's answer showed turns two-factor on, then the recovery codes, once. A
    wrong code shows the code form again, never the secret (whoever holds a copy of the cookie could post one to
    read it); a secret expired or replaced by a newer start (another tab) sends back to the password."""
    form = TwoFactorConfirmForm(request.POST)
    if not form.is_valid():
        return _enable_page(request, code_form=form, status=400)
    held = request.session.get(ENROLLING)
    # The page's secret, if still this session's newest: else ENROL_GONE, not a wrong code for another secret.
    device_id = held if form.cleaned_data["enrolment"] in (held, None) else None
    try:
        codes = svc.totp_enrol_confirm(user=request.user, device_id=device_id, code=form.cleaned_data["code"],
                                       client_address=client_ip(request), base_url=request.build_absolute_uri("/"))
    except LoginLocked as locked:
        form.add_error(None, lockout_message(locked))
        return _enable_page(request, code_form=form, locked=locked)
    except Conflict as exc:  # on already (from another session)
        messages.info(request, exc.message)
        return redirect("account-security")
    except svc.WrongCode as exc:
        form_error(form, exc, default_field="code")
        return _enable_page(request, code_form=form, status=400)
    except ApplicationError as exc:  # ENROL_GONE: the password again, for a new secret
        return _enable_page(request, start_form=TwoFactorStartForm(), gone=exc.message, status=400)
    request.session.pop(ENROLLING, None)
    update_session_auth_hash(request, request.user)  # the other sessions ended; this one stays
    otp_login(request, svc.totp_confirmed(user=request.user))
    return _no_store(render(request, "marketplace/two_factor_codes.html", {"codes": codes, "new": True}))


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

