"""Money pages: a renter's balance (top-ups, cards, warnings), usage and monthly statements; a provider's earnings
and payouts. Thin: billing.selectors reads, billing.services.payments / payouts write (the API's own services), and
amounts stay integer micro-dollars until a template formats them.

Cards: with a real Stripe publishable key the page loads Stripe.js and Stripe Elements confirms a SetupIntent in
the browser (the card number never reaches this server); the server then saves the SetupIntent's card. Without
one (localstripe in tests and the demo) and outside live mode, the page offers Stripe's test cards instead, which
the server attaches through the same `card_add` service.
"""
import re
from datetime import date
from decimal import Decimal

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Sum
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.crypto import get_random_string
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from billing import selectors
from billing.models import PayoutStatus, TopUpStatus
from billing.services import ledger, metering, payments, payouts, profiles
from core.errors import ApplicationError, IdempotencyKeyReused
from core.idempotency import request_fingerprint, web_idempotency_key
from core.web_errors import form_error
from marketplace.models import Node
from marketplace.money import parse_cents, usd_to_micros
from marketplace.reauth import with_form_status
from marketplace.services import instances as instance_svc

from .billing_forms import ElementsCardForm, PayoutAccountForm, TestCardForm, TopUpForm, UsageFilterForm

_REAL_PUBLISHABLE_KEY = re.compile(r"pk_(test|live)_[A-Za-z0-9]{20,}")
_MONTH = re.compile(r"(\d{4})-(\d{2})", re.ASCII)
IN_FLIGHT = (TopUpStatus.PENDING, TopUpStatus.PROCESSING)
USAGE_PER_PAGE = 50
PAYOUTS_PER_PAGE = 50


def stripe_mode() -> dict:
    """How cards are added: Stripe Elements with a real publishable key; Stripe's test cards unless live."""
    key = settings.STRIPE_PUBLISHABLE_KEY or ""
    return {"elements": bool(_REAL_PUBLISHABLE_KEY.fullmatch(key)), "publishable_key": key,
            "test_cards": not key.startswith("pk_live_"), "js_url": settings.STRIPE_JS_URL}


# ------------------------------------------------------------------------------------------ balance

def _balance_live_context(user) -> dict:
    top_ups = list(selectors.top_ups_for_user(user=user)[:10])
    return {
        "status": selectors.balance_status(user=user),
        "top_ups": top_ups,
        "in_flight": any(t.status in IN_FLIGHT for t in top_ups),
    }


def _balance_page(request, *, top_up_form=None, card_form=None, status=200):
    user = request.user
    mode = stripe_mode()
    if top_up_form is None:
        initial = {"request_token": get_random_string(32)}
        amount = request.GET.get("amount", "").strip()
        try:  # a link may suggest an amount (?amount=25): shown as given if the form would take it
            parse_cents(amount)
            initial["amount"] = Decimal(amount)
        except ValueError:
            pass
        top_up_form = TopUpForm(user=user, initial=initial)
    if card_form is None and mode["test_cards"]:
        card_form = TestCardForm()
    context = {
        **_balance_live_context(user),
        "form": top_up_form,
        "card_form": card_form,
        "elements_form": ElementsCardForm(),
        "cards": list(selectors.cards_for_user(user=user)),
        "events": list(selectors.events_for_user(user=user)[:8]),
        "stripe": mode,
        "low_balance_warning_s": settings.BILLING_LOW_BALANCE_WARNING_S,
        "funds_required_s": settings.BILLING_FUNDS_REQUIRED_S,
    }
    response = render(request, "marketplace/balance.html", context, status=status)
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_GET
def balance(request):
    return _balance_page(request)


@login_required
@require_GET
def balance_live(request):
    """The polled part of the balance page: the balance and the latest top-ups (it stops when none is in flight)."""
    context = _balance_live_context(request.user)
    response = render(request, "marketplace/includes/balance_live.html", context)
    if not context["in_flight"]:
        response["X-Poll-Stop"] = "1"
    response["Cache-Control"] = "no-store"
    return response


def _fresh_token(form: TopUpForm, user) -> TopUpForm:
    """The same input with a new request token: the next submission is a new top-up, not the one that failed."""
    data = form.data.copy()  # type: ignore[attr-defined]  # a QueryDict (or a test's dict): both copy
    data["request_token"] = get_random_string(32)
    fresh = TopUpForm(data, user=user)
    fresh.is_valid()
    return fresh


@login_required
@require_POST
def top_up(request):
    form = TopUpForm(request.POST, user=request.user)
    if not form.is_valid():
        return _balance_page(request, top_up_form=form, status=400)
    data = form.cleaned_data
    token = data.get("request_token") or ""
    body = {k: v for k, v in request.POST.lists() if k != "csrfmiddlewaretoken"}
    try:
        top_up, created = payments.top_up_create(
            user=request.user, amount_micros=usd_to_micros(data["amount"]), card=data["card"],
            idempotency_key=web_idempotency_key(token),
            request_fingerprint=request_fingerprint(body) if token else "")
    except IdempotencyKeyReused:  # worded for the page: it is this form's token, not a header
        form = _fresh_token(form, request.user)
        form.add_error(None, "This form was already used for a top-up with other choices. Check them and "
                             "submit again.")
        return _balance_page(request, top_up_form=form, status=400)
    except ApplicationError as exc:
        form = _fresh_token(form, request.user)
        form_error(form, exc)
        return _balance_page(request, top_up_form=form, status=exc.status_code)
    if top_up.status == TopUpStatus.FAILED:  # the same form sent again after it failed
        messages.error(request, f"This top-up failed: {top_up.failure_message}")
    elif top_up.status == TopUpStatus.SUCCEEDED:
        messages.success(request, "Your balance was topped up.")
    else:
        messages.success(request, "Payment accepted: your balance rises as soon as the payment provider confirms "
                                  "it, usually within seconds." if created else "This top-up is on its way.")
    return redirect("web-balance")


@login_required
@require_POST
def card_add(request):
    mode = stripe_mode()
    if "setup_intent" in request.POST:
        form, field = ElementsCardForm(request.POST), "setup_intent"
    elif mode["test_cards"]:
        form, field = TestCardForm(request.POST), "payment_method"
    else:
        raise Http404("Cards are added with the card form.")
    if form.is_valid():
        try:
            card, created = payments.card_add(user=request.user, **{field: form.cleaned_data[field]})
        except ApplicationError as exc:
            form_error(form, exc, default_field=field)
        else:
            label = f"{(card.brand or 'card').title()} •••• {card.last4}"
            messages.success(request, f"Card {label} saved." if created else f"Card {label} was saved before.")
            return redirect("web-balance")
    if field == "setup_intent":  # Elements' hidden form: the error shows above the card field
        for errors in form.errors.values():
            for error in errors:
                messages.error(request, f"The card could not be saved: {error}")
        return _balance_page(request, status=400)
    return _balance_page(request, card_form=form, status=400)


@login_required
@require_POST
def card_remove(request, pk: int):
    card = get_object_or_404(selectors.cards_for_user(user=request.user), pk=pk)
    label = str(card)
    payments.card_remove(card=card)
    messages.success(request, f"Card {label} removed.")
    return redirect("web-balance")


# -------------------------------------------------------------------------------------------- usage

@login_required
@require_GET
def usage(request):
    instances = instance_svc.instances_for_user(user=request.user).select_related("gpu_model").order_by("-id")
    form = UsageFilterForm(request.GET or None, instances=instances)
    rows = selectors.usage_for_user(user=request.user).select_related("instance__gpu_model") \
        .order_by("-started_at", "-id")
    valid = form.is_valid() if form.is_bound else True
    if not valid:
        rows = rows.none()
    elif form.is_bound and form.cleaned_data.get("instance"):
        rows = rows.filter(instance=form.cleaned_data["instance"])
    # What was paid: net of what was given back since (selectors.usage_net), as the statement and the balance say.
    totals = selectors.usage_totals(rows)
    page = Paginator(rows, USAGE_PER_PAGE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(request, "marketplace/usage.html", {
        "form": form, "page": page, "totals": totals, "query": query.urlencode(),
        "chosen": form.cleaned_data.get("instance") if valid and form.is_bound else None,
    }, status=200 if valid else 400)


# --------------------------------------------------------------------------------------- statements

@login_required
@require_GET
def statements(request):
    return render(request, "marketplace/statements.html", {
        "months": selectors.statement_months(user=request.user), "current": selectors.current_month(),
    })


@login_required
@require_GET
def statement(request, month: str):
    match = _MONTH.fullmatch(month)
    if not match or not 2000 <= int(match[1]) <= 2999 or not 1 <= int(match[2]) <= 12:
        raise Http404("No such month.")
    return render(request, "marketplace/statement.html", {
        "statement": selectors.statement_for(user=request.user, month=date(int(match[1]), int(match[2]), 1)),
    })


# ----------------------------------------------------------------------------------------- providers

@login_required
@require_GET
def earnings(request):
    user = request.user
    per_node = selectors.earnings_by_node(user=user)
    nodes = [{"node": n, "earned_micros": per_node.get(n.pk, 0)}
             for n in Node.objects.filter(provider=user).select_related("gpu_model").order_by("name", "id")]
    account = selectors.payout_account(user=user)
    return render(request, "marketplace/earnings.html", {
        "earnings": selectors.earnings_for(user=user), "nodes": nodes,
        "fee_percent": metering.fee_percent(metering.platform_fee_bps()),
        "payout_minimum_micros": payouts.payout_minimum_micros(), "payout_account": account,
    })


@login_required
@require_http_methods(["GET", "POST"])
def payouts_page(request):
    user = request.user
    form = PayoutAccountForm(request.POST or None, user=user, request=request,
                             initial={"stripe_connect_account_id": selectors.payout_account(user=user)})
    if request.method == "POST" and form.is_valid():  # the password is checked there (behind the lock-out)
        account_id = form.cleaned_data["stripe_connect_account_id"]
        try:
            profiles.profile_update(user=user, changes=profiles.ProfileChanges(stripe_connect_account_id=account_id),
                                    base_url=request.build_absolute_uri("/"))
        except ApplicationError as exc:
            form_error(form, exc)
        else:
            # A payout still being sent keeps its account: named, with why, not "earnings stay here".
            pending = payouts.payouts_pending_elsewhere_text(
                payouts.payouts_pending_elsewhere(user_id=user.pk, account=account_id))
            if account_id:
                said = "Payout account saved."
            elif pending:
                said = "Payout account removed: earnings not in a payout being sent stay here until you set one."
            else:
                said = "Payout account removed: earnings stay here until you set one."
            messages.success(request, f"{said} {pending}" if pending else said)
            return redirect("web-payouts")
    account = selectors.payout_account(user=user)
    # Every payout, newest first, by pages (before: the newest 100, the older ones left out without a word).
    page = Paginator(selectors.payouts_for_user(user=user).order_by("-period_start", "-id"),
                     PAYOUTS_PER_PAGE).get_page(request.GET.get("page"))
    return with_form_status(render(request, "marketplace/payouts.html", {
        "payouts": page.object_list, "page": page, "form": form, "payout_account": account,
        "pending_elsewhere": payouts.payouts_pending_elsewhere_text(
            payouts.payouts_pending_elsewhere(user_id=user.pk, account=account)),
        # The earnings account's balance, cached on its row: earnings_for aggregated the whole ledger history for it.
        "balance_micros": ledger.earnings_balance(user_id=user.pk),
        # Not in that balance, and not paid yet: shown apart, so that the balance does not read as all that is owed.
        "pending_payouts_micros": selectors.payouts_for_user(user=user).filter(status=PayoutStatus.PENDING)
        .aggregate(total=Sum("amount_micros"))["total"] or 0,
        "payout_minimum_micros": payouts.payout_minimum_micros(),
    }), form)
