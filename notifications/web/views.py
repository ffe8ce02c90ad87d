"""Pages: your notifications; your notification settings (channels per event kind, webhook endpoints); one
endpoint's delivery log with a test button. Thin: the services hold the rules; another user's endpoint is a 404."""
import math

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.crypto import get_random_string
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST

from core.api.throttling import scoped_rate_wait
from core.errors import ApplicationError, NotFound, TooManyRequests, ValidationFailed
from core.idempotency import web_idempotency_key
from core.web_errors import form_error, message_error
from marketplace.reauth import with_form_status
from notifications import selectors
from notifications.services import notify as notify_svc
from notifications.services import unsubscribe as unsubscribe_svc
from notifications.services import webhooks as webhook_svc

from .forms import ChannelsForm, EndpointForm

PER_PAGE = 25
ENDPOINT_STATES = {"1": True, "0": False}  # the Pause / Resume form's `active`


@login_required
def notifications(request):
    page = Paginator(selectors.notifications_for(user=request.user), PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "notifications/list.html", {
        "page": page, "unread": selectors.unread_count(user=request.user)})


@login_required
@require_POST
def notification_read(request, pk: int):
    notification = get_object_or_404(selectors.notifications_for(user=request.user), pk=pk)
    notify_svc.notification_mark_read(notification=notification)
    return redirect("notifications")


@login_required
@require_POST
def notifications_read_all(request):
    count = notify_svc.notifications_mark_all_read(user=request.user)
    messages.success(request, f"{count} notification{'s' if count != 1 else ''} marked read.")
    return redirect("notifications")


def _new_endpoint_form(request) -> EndpointForm:
    return EndpointForm(user=request.user, request=request, initial={"request_token": get_random_string(32)})


def _settings_page(request, form, created=None, status: int = 200):
    response = render(request, "notifications/settings.html", {
        "channels": ChannelsForm(preferences=selectors.preferences_for(user=request.user)),
        "endpoints": selectors.endpoints_for(user=request.user), "form": form, "created": created,
    }, status=status)
    if created:
        response["Cache-Control"] = "no-store"
    return response


@login_required
@require_http_methods(["GET", "POST"])
def notification_settings(request):
    """The channels grid (POSTed with `preferences`) and the endpoint form (POSTed with `url`)."""
    if "url" in request.POST:
        form = EndpointForm(request.POST, user=request.user, request=request)
    else:
        form = _new_endpoint_form(request)
    if request.method == "POST" and "preferences" in request.POST:
        channels = ChannelsForm(request.POST, preferences=selectors.preferences_for(user=request.user))
        if not channels.shown_any():  # a page from before the shown values: what it shows may be long out of date
            messages.error(request, "Nothing was saved: the page was out of date. Check the choices below and save "
                                    "again.")
            return _settings_page(request, form, status=400)
        # Only what was changed on the page: the other choices may have been changed since it was opened.
        for kind, changes in channels.changes_since_shown().items():
            notify_svc.preference_change(user=request.user, kind=kind, channels=changes)
        messages.success(request, "Your notification settings were saved.")
        return redirect("notification-settings")
    if request.method == "POST" and form.is_valid():
        # Before the URL's host name is looked up: the API's rate and counter (ENDPOINT_WRITES_SCOPE), one budget.
        wait = scoped_rate_wait(request, webhook_svc.ENDPOINT_WRITES_SCOPE)
        if wait is not None:
            form_error(form, TooManyRequests(webhook_svc.endpoint_writes_refused(wait)))
            response = _settings_page(request, form, status=429)
            response["Retry-After"] = str(max(1, math.ceil(wait)))
            return response
        try:
            endpoint, secret = webhook_svc.endpoint_create(
                user=request.user, url=form.cleaned_data["url"], description=form.cleaned_data["description"],
                base_url=request.build_absolute_uri("/"),
                idempotency_key=web_idempotency_key(form.cleaned_data["request_token"]))
        except webhook_svc.EndpointRequestReused as exc:
            # This page's form added one already: shown again with a fresh token (not validated again, which
            # would check the password once more), so that adding again adds another.
            form.data = form.data.copy()
            form.data["request_token"] = get_random_string(32)
            form_error(form, exc)
        except ApplicationError as exc:
            form_error(form, exc, default_field="url")
        else:
            # Rendered, not redirected: the secret exists only in this answer (and its replay by the same form).
            return _settings_page(request, _new_endpoint_form(request),
                                  created={"endpoint": endpoint, "secret": secret})
    return with_form_status(_settings_page(request, form), form)


def _endpoint_page(request, endpoint, status: int = 200):
    deliveries = selectors.deliveries_for(user=request.user, endpoint_id=endpoint.pk).prefetch_related("attempt_log")
    page = Paginator(deliveries, PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "notifications/endpoint.html", {"endpoint": endpoint, "page": page}, status=status)


@login_required
def endpoint(request, pk: int):
    return _endpoint_page(request, get_object_or_404(selectors.endpoints_for(user=request.user), pk=pk))


@login_required
@require_POST
def endpoint_test(request, pk: int):
    endpoint = get_object_or_404(selectors.endpoints_for(user=request.user), pk=pk)
    try:
        webhook_svc.endpoint_test(endpoint=endpoint)
    except ApplicationError as exc:  # past the hourly limit of test events
        message_error(request, exc)
    else:
        messages.success(request, "A test event is on its way: its delivery appears below (reload to follow it).")
    return redirect("notification-endpoint", pk=endpoint.pk)


@login_required
@require_POST
def endpoint_toggle(request, pk: int):
    """Pause or Resume: the form posts the state it asks for (`active`, 1 or 0), and that state is set. Not a flip of
    the stored one: Pause clicked twice, or on a page opened before a pause made elsewhere, resumed the endpoint
    (found by review). Without a valid `active` nothing changes (a 400)."""
    endpoint = get_object_or_404(selectors.endpoints_for(user=request.user), pk=pk)
    wanted = ENDPOINT_STATES.get(request.POST.get("active", ""))
    if wanted is None:
        messages.error(request, "Nothing changed: the form did not say whether to pause or resume the endpoint. "
                                "Use the button below.")
        return _endpoint_page(request, endpoint, status=400)
    was_active = endpoint.active
    try:
        endpoint = webhook_svc.endpoint_update(endpoint=endpoint, active=wanted)
    except NotFound as exc:  # deleted meanwhile (another tab, the API)
        message_error(request, exc)
        return redirect("notification-settings")
    verb = "resumed" if wanted else "paused"
    messages.success(request, f"Endpoint {verb}." if was_active != wanted else f"The endpoint was already {verb}.")
    return redirect("notification-endpoint", pk=endpoint.pk)


@login_required
@require_POST
def endpoint_delete(request, pk: int):
    endpoint = get_object_or_404(selectors.endpoints_for(user=request.user), pk=pk)
    webhook_svc.endpoint_delete(endpoint=endpoint)
    messages.success(request, f"Endpoint {endpoint.url} deleted with its delivery log.")
    return redirect("notification-settings")


@csrf_exempt  # the mail client's one-click POST (RFC 8058) has no CSRF token; the signed token is the proof
@require_http_methods(["GET", "POST"])
def unsubscribe(request, token: str):
    """The List-Unsubscribe link of a notification e-mail, no log-in needed. GET: a page with the button (a link
    scanner opening it turns nothing off); POST: that kind's e-mails turned off (services/unsubscribe.py)."""
    try:
        if request.method == "POST":
            user, kind = unsubscribe_svc.unsubscribe(token=token)
        else:
            user, kind = unsubscribe_svc.unsubscribe_check(token=token)
        context = {"kind_label": unsubscribe_svc.kind_label(kind), "done": request.method == "POST", "status": 200}
    except ValidationFailed as exc:  # a bad, tampered, expired or outdated token
        context = {"error": exc.message, "status": 400}
    response = render(request, "notifications/unsubscribe.html", context, status=context["status"])
    response["Cache-Control"] = "no-store"
    response["Referrer-Policy"] = "no-referrer"  # the token is in the URL
    return response
