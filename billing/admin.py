"""The operators' view of money: read-only, except through actions that call a billing service.

Nothing in the ledger (accounts, transactions, entries, usage) can be added, changed or deleted
here. A manual credit, a reversal or a refund is an action with a form that asks for a reason; the
service posts a ledger transaction that records the operator and the reason. No operator posts money to or from
their own accounts, and only a superuser to or from a staff account's (_refuse_own_account, _refuse_staff_account).
"""
import json
from datetime import timedelta
from decimal import Decimal

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.core.validators import RegexValidator
from django.db import connections, transaction
from django.db.models import BigIntegerField, F, OuterRef, Subquery, Sum
from django.db.models.functions import Coalesce
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.crypto import get_random_string
from django.utils.html import format_html, format_html_join

from billing import selectors
from billing.models import (
    Account,
    AccountKind,
    BillingEvent,
    BillingProfile,
    Card,
    Dispute,
    Entry,
    LedgerTransaction,
    Payout,
    PayoutStatus,
    Refund,
    RefundStatus,
    StripeEvent,
    StripeEventStatus,
    TopUp,
    UsageInterval,
)
from billing.selectors import WAITING_TOP_UPS
from billing.services import ledger, payments, payouts, profiles
from billing.services.refunds import OWN_ACCOUNT_REFUSED, REFUND_NOTE, refund_create_once, refundable_micros
from billing.services.webhooks import redact_secrets
from core.admin_paginator import EstimatedCountPaginator
from core.admin_search import KeySearchAdmin
from core.errors import ApplicationError, Conflict
from core.idempotency import web_idempotency_key
from marketplace.admin.common import STAFF_ACCOUNT_REFUSED, refuse_stale_value, staff_of_a_non_superuser, to_write
from marketplace.models import Instance, Volume
from marketplace.money import micros_to_usd, usd_to_micros


def usd(micros: int | None) -> str:
    """The ledger's exact figure for operators (six decimals), with the pages' sign rule: "−$5.000000"."""
    if micros is None:
        return ""
    return f"{'−' if micros < 0 else ''}${micros_to_usd(abs(micros))}"


class ReadOnlyAdmin(KeySearchAdmin):
    """View only: money is changed by services, never by editing rows. An id searched by its index
    (core/admin_search.py)."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


# What each action needs. The rows stay read-only to everyone (ReadOnlyAdmin), so an action cannot ride on the
# model's change permission; each asks for the permission to create what it posts (a superuser has them all).
# billing/api/top_ups.py asks the API's refunds for REFUND_PERMISSION too.
POST_TRANSACTION_PERMISSION = "billing.add_ledgertransaction"  # a manual credit, a reversal
REFUND_PERMISSION = "billing.add_refund"


class ReasonForm(forms.Form):
    """Two wordings: the operator's reason stays with the operators; the customer reads only `customer_note`."""

    customer_note_default = ledger.REVERSAL_NOTE
    reason = forms.CharField(label="Internal reason (operators only)", max_length=1000,
                             widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
                             help_text="Kept in the ledger with your name; the customer never sees it.")
    customer_note = forms.CharField(label="What the customer reads", max_length=1000, required=False,
                                    widget=forms.Textarea(attrs={"rows": 2, "cols": 60}))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["customer_note"].help_text = (
            f"Shown on their statement and in the notice they get. Empty: “{self.customer_note_default}”")


class ReverseForm(ReasonForm):
    """A reversal moves money both ways: each account holder it moves money for (a renter's wallet, a provider's
    earnings) is told, and by default each reads the wording for their side (ledger.reversal_note)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["customer_note"].help_text = (
            "Shown on the customer's statement and in the notice each account holder whose money it moves gets (a "
            "usage or storage charge: its renter and its provider). Empty: worded for each by what is reversed, "
            f"e.g. a usage charge: “{ledger.USAGE_GIVEN_BACK_NOTE}” "
            f"to the renter; a credit: “{ledger.REVERSAL_NOTE}”")


class TokenForm(ReasonForm):
    """A form that does its work once however often it is sent (a double click, a page sent again): what it posts
    is keyed by `form_token`, drawn when the form is shown."""

    form_token = forms.CharField(widget=forms.HiddenInput, max_length=64,
                                 validators=[RegexValidator(r"^[A-Za-z0-9]+$", "Not a token of this form.")])

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.is_bound:
            self.initial.setdefault("form_token", get_random_string(32))


class CreditForm(TokenForm):
    customer_note_default = ledger.CREDIT_NOTE
    amount = forms.DecimalField(min_value=Decimal("0.01"), max_value=Decimal("100000"), decimal_places=2,
                                help_text="USD credited to each selected wallet.")


def _refuse_own_account(operator, user_ids) -> None:
    """Separation of duties: an operator does not post money to or from their own accounts (a credit to their own
    wallet, a reversal of their own usage or earnings, a refund of their own top-up), superuser or not; another
    operator does. Raised per row, so a bulk action still does the other rows (_form_action)."""
    if operator.pk in set(user_ids):
        raise Conflict(OWN_ACCOUNT_REFUSED)


def _refuse_staff_account(operator, user_ids) -> None:
    """The admin's rule for staff accounts (marketplace.admin.common.staff_of_a_non_superuser): only a superuser
    posts money to or from one. The own-account rule alone let two non-superuser staff holding
    add_ledgertransaction credit each other's wallets, $100,000 a form (found by review). Raised per row, as above."""
    ids = {user_id for user_id in user_ids if user_id is not None}  # a platform account is no one's
    if not operator.is_superuser and ids and any(
            staff_of_a_non_superuser(operator, user) for user in get_user_model()._default_manager.filter(pk__in=ids)):
        raise Conflict(f"{STAFF_ACCOUNT_REFUSED}: a superuser posts money to or from a staff account; nothing was "
                       "posted.")


def _credit(account: Account, data: dict, operator) -> None:
    assert account.user is not None  # a customer wallet (the action takes no other)
    _refuse_own_account(operator, [account.user_id])
    _refuse_staff_account(operator, [account.user_id])
    _, created = ledger.credit_grant(
        user=account.user, amount_micros=usd_to_micros(data["amount"]), reason=data["reason"],
        customer_note=data["customer_note"], created_by=operator,
        idempotency_key=f"admin-credit:{data['form_token']}:{account.pk}")
    if not created:
        raise Conflict("already credited by this form, which was sent twice; nothing more was credited.")


def _reverse(txn: LedgerTransaction, data: dict, operator) -> None:
    users = list(txn.entries.values_list("account__user_id", flat=True))
    _refuse_own_account(operator, users)
    _refuse_staff_account(operator, users)
    reversal, created = ledger.ledger_reverse(txn=txn, reason=data["reason"], customer_note=data["customer_note"],
                                              created_by=operator)
    if not created:  # a transaction is reversed once: this one was before, and nothing was posted now
        raise Conflict(f"already reversed by #{reversal.pk}; nothing more was reversed.")


class RefundForm(TokenForm):
    customer_note_default = REFUND_NOTE
    amount = forms.DecimalField(min_value=Decimal("0.01"), max_value=Decimal("100000"), decimal_places=2,
                                required=False, help_text="USD; leave empty to refund all that is left of each.")


def _refund(top_up: TopUp, data: dict, operator) -> None:
    """Each top-up's refund is keyed by the form's token (refund_unique_idempotency_key, per operator): the form
    sent again finds the refund it made instead of refunding again (found by review: $20 back for a $10 refund).
    Not the operator's own top-up, nor a staff account's unless a superuser's (refund_create_once refuses both too,
    for every other caller: the refunds API)."""
    _refuse_own_account(operator, [top_up.user_id])
    _refuse_staff_account(operator, [top_up.user_id])
    amount = usd_to_micros(data["amount"]) if data["amount"] else refundable_micros(top_up=top_up)
    if not amount:
        raise Conflict("nothing of it can still be refunded (refunded already, or held by a dispute).")
    refund, created = refund_create_once(
        top_up=top_up, amount_micros=amount, reason=data["reason"], customer_note=data["customer_note"],
        created_by=operator, idempotency_key=web_idempotency_key(f"{data['form_token']}:{top_up.pk}"))
    if not created:
        raise Conflict(f"already refunded by this form, which was sent twice (refund {refund.pk}, "
                       f"{refund.status}); nothing more was refunded. Open the action again for another refund.")


def _form_action(modeladmin, request, queryset, form_class, title, apply):
    """An action with a form: show the form; on submit, call `apply(obj, data)` for each selected object.

    When one is refused, the form comes back with what the operator typed, the error on the field it names (or
    above the form), and only the refused objects still selected: the others were done and are not done twice.
    """
    objects = list(queryset)
    status = 200
    if "apply" in request.POST:
        form = form_class(request.POST)
        if form.is_valid():
            done, refused = 0, []
            for obj in objects:
                try:
                    apply(obj, form.cleaned_data)
                    done += 1
                except (ApplicationError, ledger.LedgerError) as exc:
                    refused.append(obj)
                    message = f"{obj}: {getattr(exc, 'message', exc)}"
                    field = getattr(exc, "field", None)
                    form.add_error(field if field in form.fields else None, message)
            if done:
                modeladmin.message_user(request, f"{title}: {done} done.", messages.SUCCESS)
            if not refused:
                return None
            objects, status = refused, 400
        else:
            status = 400
    else:
        form = form_class()
    return TemplateResponse(request, "admin/billing/action_form.html", {
        **modeladmin.admin_site.each_context(request), "title": title, "form": form, "objects": objects,
        "action": request.POST.get("action"), "opts": modeladmin.model._meta,
        "selected": [str(obj.pk) for obj in objects],
    }, status=status)


@admin.register(Account)
class AccountAdmin(ReadOnlyAdmin):
    list_display = ["id", "kind", "user", "balance"]
    list_filter = ["kind"]
    search_fields = ["user__email"]
    list_select_related = ["user"]
    fields = ["kind", "user", "balance", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    actions = ["credit"]

    @admin.display(ordering="balance_micros")
    def balance(self, account):
        return usd(account.balance_micros)

    def has_credit_permission(self, request):
        return request.user.has_perm(POST_TRANSACTION_PERMISSION)

    @admin.action(description="Credit selected customer wallets (asks for amount and reason)", permissions=["credit"])
    def credit(self, request, queryset):
        wallets = queryset.filter(kind=AccountKind.CUSTOMER_WALLET)
        if wallets.count() != queryset.count():
            self.message_user(request, "Only customer wallets can be credited.", messages.ERROR)
            return None
        return _form_action(self, request, wallets, CreditForm, "Credit wallets",
                            lambda account, data: _credit(account, data, request.user))


class EntryInline(admin.TabularInline):
    model = Entry
    fields = ["account", "amount"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display()
    def amount(self, entry):
        return usd(entry.amount_micros)


@admin.register(LedgerTransaction)
class LedgerTransactionAdmin(ReadOnlyAdmin):
    list_display = ["id", "created_at", "kind", "memo", "created_by", "reverses"]
    list_filter = ["kind", "created_at"]
    search_fields = ["idempotency_key", "memo", "reason", "created_by__email"]
    list_select_related = ["created_by", "reverses"]
    # Millions of rows: no COUNT(*) of them all per page (core/admin_paginator.py).
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    fields = ["idempotency_key", "kind", "memo", "reason", "customer_note", "created_by", "reverses", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    inlines = [EntryInline]
    actions = ["reverse"]

    def has_reverse_permission(self, request):
        return request.user.has_perm(POST_TRANSACTION_PERMISSION)

    @admin.action(description="Reverse selected transactions (asks for a reason)", permissions=["reverse"])
    def reverse(self, request, queryset):
        return _form_action(self, request, queryset, ReverseForm, "Reverse transactions",
                            lambda txn, data: _reverse(txn, data, request.user))


@admin.register(UsageInterval)
class UsageIntervalAdmin(ReadOnlyAdmin):
    list_display = ["id", "instance", "started_at", "ended_at", "seconds", "amount", "fee"]
    list_filter = ["ended_at"]
    search_fields = ["=instance__id", "instance__renter__email"]
    # A number is an instance id, found by the (instance, started_at) index; "5" OR'd with the renter's e-mail
    # LIKE '%5%' over the join read the whole table again (core/admin_search.py).
    key_terms_search_keys_only = True
    raw_id_fields = ["instance"]
    # The largest table (a row per instance per meter run). Newest first by the primary key's index: the model's
    # (-started_at, -id) has none, and sorted the whole table for each page. The instance column shows its id and
    # status only: without names, Django's select_related() joined the instance's renter, node, provider and GPU
    # models. No COUNT(*) of every row per page: an estimate when unfiltered, and no second "N total" count
    # (core/admin_paginator.py). Found by review: 2 s a page at 2 million rows, growing with the table.
    ordering = ["-id"]
    list_select_related = ["instance"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    readonly_fields = ["instance", "started_at", "ended_at", "seconds", "price_per_hour_micros", "platform_fee_bps",
                       "amount_micros", "fee_micros", "transaction", "created_at"]

    @admin.display(ordering="amount_micros")
    def amount(self, interval):
        return usd(interval.amount_micros)

    @admin.display(ordering="fee_micros")
    def fee(self, interval):
        return usd(interval.fee_micros)


class StripeAnswerFilter(admin.SimpleListFilter):
    """The top-ups whose outcome Stripe has not told yet: processing, or failed with its answer lost (charged or not
    is not known). What the dashboard's "money waiting on Stripe" counts (billing.selectors.waiting_on_stripe)."""
    title = "Stripe's answer"
    parameter_name = "stripe"

    def lookups(self, request, model_admin):
        return [("waiting", "not known yet (processing, or its answer lost)")]

    def queryset(self, request, queryset):
        if self.value() == "waiting":
            return queryset.filter(WAITING_TOP_UPS)
        return queryset


class PastDelayFilter(admin.SimpleListFilter):
    """Rows made longer ago than the follow-up's delay (BILLING_TOP_UP_RECONCILE_AFTER_S): the dashboard's "money
    waiting on Stripe" counts only those (billing.selectors.waiting_on_stripe) and links here with past_delay=yes, so
    that rows still inside the delay are in neither its count nor its list (review r54)."""
    title = "age"
    parameter_name = "past_delay"

    def lookups(self, request, model_admin):
        return [("yes", "past the follow-up's delay")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            cutoff = timezone.now() - timedelta(seconds=settings.BILLING_TOP_UP_RECONCILE_AFTER_S)
            return queryset.filter(created_at__lt=cutoff)
        return queryset


class PayoutHeldFilter(admin.SimpleListFilter):
    """Payouts held by the platform while their provider's account is deactivated (billing.services.payouts:
    pending, nothing sent) apart from the others: the dashboard's "waiting on Stripe" counts only the others and links
    here with held=no, so its count and its list agree."""
    title = "held (provider deactivated)"
    parameter_name = "held"

    def lookups(self, request, model_admin):
        return [("yes", "held: provider deactivated"), ("no", "not held")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(provider__is_active=False)
        if self.value() == "no":
            return queryset.filter(provider__is_active=True)
        return queryset


@admin.register(TopUp)
class TopUpAdmin(ReadOnlyAdmin):
    list_display = ["id", "created_at", "user", "amount", "status", "automatic", "card_label", "payment_intent_id"]
    # Grows by the day, read on every page: newest first by the primary key's index (the model's order, newest
    # first by its time, has none and sorted the whole table), counted once, estimated when unfiltered and large
    # (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = [StripeAnswerFilter, PastDelayFilter, "status", "automatic", "created_at"]
    search_fields = ["user__email", "payment_intent_id", "charge_id"]
    list_select_related = ["user"]
    readonly_fields = ["user", "amount_micros", "refundable", "card", "card_label", "automatic", "status",
                       "failure_message", "payment_intent_id", "charge_id", "idempotency_key", "transaction",
                       "created_at", "updated_at", "credited_at"]

    @admin.display(description="refundable now")
    def refundable(self, top_up):
        # Less every refund not failed (the platform's and those made at Stripe) and what disputes hold.
        return usd(refundable_micros(top_up=top_up))
    actions = ["refund"]

    @admin.display(ordering="amount_micros")
    def amount(self, top_up):
        return usd(top_up.amount_micros)

    def has_refund_permission(self, request):
        return request.user.has_perm(REFUND_PERMISSION)

    @admin.action(description="Refund selected top-ups to their cards (asks for amount and reason)",
                  permissions=["refund"])
    def refund(self, request, queryset):
        return _form_action(self, request, queryset, RefundForm, "Refund top-ups",
                            lambda top_up, data: _refund(top_up, data, request.user))


@admin.register(Refund)
class RefundAdmin(ReadOnlyAdmin):
    list_display = ["id", "created_at", "top_up", "amount", "status", "origin", "created_by", "stripe_refund_id"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["status", PastDelayFilter, "origin"]
    search_fields = ["top_up__user__email", "stripe_refund_id", "reason"]
    list_select_related = ["top_up", "created_by"]  # created_by may be null: the admin's default would not join it
    readonly_fields = ["top_up", "amount_micros", "status", "origin", "stripe_refund_id", "reason", "customer_note",
                       "created_by", "failure_message", "hold", "transaction", "idempotency_key", "created_at"]

    @admin.display(ordering="amount_micros")
    def amount(self, refund):
        return usd(refund.amount_micros)


class OverRefundsFilter(admin.SimpleListFilter):
    """Disputes for more than what was left of their top-up after refunds (DisputeAdmin.get_queryset's annotation):
    the bank took money that had been refunded already, so they are answered with the refund (review r55)."""
    title = "over refunds"
    parameter_name = "over_refunds"

    def lookups(self, request, model_admin):
        return [("yes", "over a refunded charge: answer with the refund")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(amount_micros__gt=F("top_up__amount_micros") - F("refunded_micros"))
        return queryset


@admin.register(Dispute)
class DisputeAdmin(ReadOnlyAdmin):
    list_display = ["stripe_dispute_id", "created_at", "top_up", "amount", "state", "over_refunds", "bank_reason"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    search_fields = ["stripe_dispute_id", "top_up__user__email", "top_up__payment_intent_id", "top_up__charge_id"]
    list_select_related = ["top_up"]
    list_filter = [OverRefundsFilter]
    readonly_fields = ["stripe_dispute_id", "top_up", "amount_micros", "state", "over_refunds", "bank_reason", "debit",
                       "reversal", "created_at", "updated_at"]

    def get_queryset(self, request):
        # What of each dispute's top-up was refunded, or is being refunded (billing.services.disputes.refunded_micros),
        # one subquery a row of the page.
        refunded = (Refund.objects.filter(top_up=OuterRef("top_up"),
                                          status__in=[RefundStatus.PENDING, RefundStatus.SUCCEEDED])
                    .values("top_up").annotate(total=Sum("amount_micros")).values("total")[:1])
        return super().get_queryset(request).annotate(
            refunded_micros=Coalesce(Subquery(refunded, output_field=BigIntegerField()), 0))

    @admin.display(ordering="amount_micros")
    def amount(self, dispute):
        return usd(dispute.amount_micros)

    @admin.display(description="over refunds")
    def over_refunds(self, dispute):
        """A dispute for more than its top-up less its refunds: Stripe took it in full, and it is usually won."""
        refunded = dispute.refunded_micros
        if dispute.amount_micros <= dispute.top_up.amount_micros - refunded:
            return ""
        return (f"over a refunded charge: {usd(refunded)} of the {usd(dispute.top_up.amount_micros)} top-up was "
                "refunded. Answer the dispute at Stripe with the refund as evidence (usually won).")

    @admin.display(description="state")
    def state(self, dispute):
        if dispute.held:
            return "debited: under dispute, or lost (not refundable)"
        return "won: the debit was given back" if dispute.reversal_id else "not debited"


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnlyAdmin):
    list_display = ["event_id", "type", "status", "deliveries", "received_at", "processed_at"]
    # Grows by the day, read on every page: newest first by the primary key's index (the model's order, newest
    # first by its time, has none and sorted the whole table), counted once, estimated when unfiltered and large
    # (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["status", "type"]
    search_fields = ["event_id", "type"]
    fields = ["event_id", "type", "status", "error", "deliveries", "received_at", "processed_at", "payload_shown"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    actions = ["process_again"]

    @admin.display(description="payload")
    def payload_shown(self, event):
        # Events stored before webhook_receive redacted them may still hold a PaymentIntent's client_secret.
        return format_html("<pre>{}</pre>", json.dumps(redact_secrets(event.payload), indent=2))

    def has_process_again_permission(self, request):
        return request.user.has_perm("billing.change_stripeevent")

    @admin.action(description="Process selected failed events again", permissions=["process_again"])
    def process_again(self, request, queryset):
        for event in queryset.filter(status=StripeEventStatus.FAILED):
            event = payments.stripe_event_process(event_id=event.pk)
            self.message_user(request, f"{event.event_id}: {event.status}")


@admin.register(Payout)
class PayoutAdmin(ReadOnlyAdmin):
    list_display = ["id", "provider", "period_start", "period_end", "amount", "status", "transfer_id", "attempts"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its period, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["status", PayoutHeldFilter, PastDelayFilter, "period_start"]
    search_fields = ["provider__email", "transfer_id", "destination"]
    readonly_fields = ["provider", "period_start", "period_end", "amount_micros", "destination", "status",
                       "transfer_id", "failure_message", "attempts", "transaction", "reversal", "created_at",
                       "paid_at"]
    actions = ["send_again"]

    @admin.display(ordering="amount_micros")
    def amount(self, payout):
        return usd(payout.amount_micros)

    def has_send_again_permission(self, request):
        return request.user.has_perm("billing.change_payout")

    @admin.action(description="Send selected pending payouts again", permissions=["send_again"])
    def send_again(self, request, queryset):
        for payout in queryset.filter(status=PayoutStatus.PENDING):
            payout = payouts.payout_send(payout=payout)
            self.message_user(request, f"payout {payout.pk}: {payout.status} {payout.failure_message}")


class BillingProfileAdminForm(forms.ModelForm):
    """The change goes through profile_update while the form is checked: what the service refuses is shown on the
    form (it was a 500), and nothing of it is written (the service's own transaction is undone).

    The page sends back the account it showed (a hidden initial), and only the operator's change of that is made:
    compared with the profile as read at the save, a page opened before the provider moved its payouts (the API)
    and saved unchanged wrote the old account back and e-mailed the owner "Your payout account was changed" (found
    by review). Sent with a value other than the stored one when that moved since the page showed it, the save is
    refused on the form. The profile's other fields are read-only here (shown, never written:
    BillingProfileAdmin.save_model)."""

    stripe_connect_account_id = forms.RegexField(
        regex=profiles.CONNECT_ACCOUNT_ID, max_length=100, required=False, label="Stripe Connect account id",
        error_messages={"invalid": profiles.CONNECT_ACCOUNT_MESSAGE})
    base_url = ""  # the e-mail's links (BillingProfileAdmin.get_form sets the request's)

    class Meta:
        model = BillingProfile
        fields = ["stripe_connect_account_id"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["stripe_connect_account_id"].show_hidden_initial = True

    def clean(self):
        cleaned = super().clean()
        if refuse_stale_value(self, "stripe_connect_account_id", lambda stored: f"“{stored or 'none'}”"):
            return cleaned
        if not to_write(self, "stripe_connect_account_id"):
            return cleaned  # as the page showed it, or as it is now: nothing to change
        try:
            with transaction.atomic():  # refused: undone, whatever it had written
                profiles.profile_update(user=self.instance.user, base_url=self.base_url, changes=(
                    profiles.ProfileChanges(stripe_connect_account_id=cleaned["stripe_connect_account_id"])))
        except ApplicationError as exc:
            field = getattr(exc, "field", None)
            self.add_error(field if field in self.fields else None, exc.message)
        return cleaned


@admin.register(BillingProfile)
class BillingProfileAdmin(admin.ModelAdmin):
    """Operators may set a provider's Connect account, through the same service as the provider (the account's
    pattern, and the e-mail that tells the owner where the earnings go now); nothing else here is editable."""

    form = BillingProfileAdminForm

    list_display = ["user", "stripe_customer_id", "stripe_connect_account_id", "auto_top_up_enabled",
                    "low_balance_warned_at", "depleted_at", "stop_not_before"]
    search_fields = ["user__email", "stripe_customer_id", "stripe_connect_account_id"]
    list_select_related = ["user"]
    fields = ["user", "stripe_customer_id", "stripe_connect_account_id", "auto_top_up_enabled",
              "auto_top_up_threshold_micros", "auto_top_up_amount_micros", "auto_top_up_card",
              "low_balance_warned_at", "depleted_at", "destroy_warned_at", "destroy_deadlines_shown",
              "stop_not_before", "created_at"]
    readonly_fields = [f for f in fields if f != "stripe_connect_account_id"]  # type: ignore[misc]  # names only

    @admin.display(description="destroy deadlines")
    def destroy_deadlines_shown(self, obj):
        """What the zero-balance grace period destroys, and when (billing.services.enforcement._grace), as a table:
        the raw JSON field was not shown at all, so operators could not see it. Shown only, never a form field."""
        entries = selectors.destroy_deadlines(obj.destroy_deadlines if obj is not None else None)
        if not entries:
            return "none"
        models = {"instance": Instance, "volume": Volume}
        existing = {kind: set(model.objects.filter(pk__in=[e.id for e in entries if e.kind == kind])
                              .values_list("pk", flat=True)) for kind, model in models.items()}

        def thing(entry):
            if entry.id not in existing[entry.kind]:  # destroyed since, or gone: its id alone
                return format_html("{} {} (gone)", entry.kind, entry.id)
            return format_html('<a href="{}">{} {}</a>', reverse(f"admin:marketplace_{entry.kind}_change",
                                                                 args=[entry.id]), entry.kind, entry.id)

        rows = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td></tr>", (
            (thing(e), f"{e.at:%Y-%m-%d %H:%M:%S} UTC", "warned" if e.warned else "not warned yet") for e in entries))
        return format_html('<table class="destroy-deadlines"><thead><tr><th>thing</th><th>destroyed at</th>'
                           "<th>warning</th></tr></thead><tbody>{}</tbody></table>", rows)

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change, **kwargs)
        return type(form.__name__, (form,), {"base_url": request.build_absolute_uri("/")})

    def get_object(self, request, object_id, from_field=None):
        """Read under its lock when the form is sent (in the change form's transaction; never on the history page,
        outside one), as profile_update reads it: the account the form compares with the page's stays the stored
        one until the change is made."""
        obj = super().get_object(request, object_id, from_field)
        if obj is not None and request.method == "POST" and connections[obj._state.db].in_atomic_block:
            obj = type(obj)._default_manager.select_for_update().filter(pk=obj.pk).first()
        return obj

    def save_model(self, request, obj, form, change):
        pass  # the form's check made the change, through profile_update

    def has_change_permission(self, request, obj=None):
        # Where a staff account's earnings are paid is a superuser's to change (staff_of_a_non_superuser).
        return (super().has_change_permission(request, obj)
                and not (obj is not None and staff_of_a_non_superuser(request.user, obj.user)))

    def has_add_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Card)
class CardAdmin(ReadOnlyAdmin):
    list_display = ["id", "user", "brand", "last4", "exp_month", "exp_year", "created_at"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    search_fields = ["user__email", "stripe_payment_method_id"]
    readonly_fields = ["user", "stripe_payment_method_id", "brand", "last4", "exp_month", "exp_year", "created_at"]


@admin.register(BillingEvent)
class BillingEventAdmin(ReadOnlyAdmin):
    list_display = ["id", "created_at", "user", "kind", "short_message", "emailed"]
    # Grows by the day, read on every page: newest first by the primary key's index (the model's order, newest
    # first by its time, has none and sorted the whole table), counted once, estimated when unfiltered and large
    # (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["kind", "emailed"]
    search_fields = ["user__email", "message"]
    readonly_fields = ["user", "kind", "message", "data", "emailed", "created_at"]

    @admin.display(description="message")
    def short_message(self, event):
        return format_html("{}", event.message[:120])
