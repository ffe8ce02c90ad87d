"""Your wallet: the balance, usage intervals, billing events, and the billing profile (payout account,
auto top-up)."""
from datetime import UTC

import django_filters
from django import forms
from django.conf import settings
from django.db.models import Q
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, viewsets
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import selectors
from billing.api.common import top_up_amount_field
from billing.models import AccountKind, BillingEvent, BillingProfile, EventKind, UsageInterval
from billing.services import ledger, metering, profiles
from billing.services.customers import profile_for
from billing.services.profiles import CONNECT_ACCOUNT_ID_SET
from core.api.fields import CentsField, MoneyField, StrictFieldsMixin
from core.api.filtering import StrictFilterSet, reject_unknown_params
from core.api.schema import error_response
from core.api.scopes import PROVIDER, PROVIDER_ONLY, RENTER, RENTER_ONLY, RENTER_OR_PROVIDER, missing_scopes
from marketplace.models import ApiKey
from marketplace.money import micros_to_usd, usd_to_micros
from marketplace.reauth import refuse_session_alone

# ------------------------------------------------------------------------------------- balance


class AutoTopUpSerializer(serializers.Serializer):
    enabled = serializers.BooleanField()
    threshold = MoneyField(allow_null=True, help_text="Top up when the balance falls below this.")
    amount = MoneyField(allow_null=True, help_text="How much each automatic top-up adds.")
    card = serializers.IntegerField(allow_null=True, help_text="The saved card charged.")


class DestroyDeadlineSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=["instance", "volume"], read_only=True,
                                   help_text="What is destroyed: a stopped or failed instance (its disk), or a volume.")
    id = serializers.IntegerField(read_only=True, help_text="The instance's or the volume's id.")
    destroy_at = serializers.DateTimeField(source="at", read_only=True, help_text=(
        "When it is destroyed (UTC) if the balance is still at zero then. A warning names it with this time first."))
    warned = serializers.BooleanField(read_only=True, help_text=(
        "Whether a destroy warning (a `destroy_warning` event, an e-mail) named it with this time yet. Nothing is "
        "destroyed before one did: until then `destroy_at` may move later."))


class BalanceSerializer(serializers.Serializer):
    balance = MoneyField(help_text="Your prepaid balance. It can dip below zero by at most one minute of usage.")
    currency = serializers.CharField()
    running_cost_per_hour = MoneyField(help_text="What your running instances cost per hour now (GPU time).")
    storage_cost_per_hour = MoneyField(
        help_text="What your storage costs per hour now: your volumes at their size, and your stopped instances' "
                  "disks at the size booked, each at the price per GB-month it was created with.")
    cost_per_hour = MoneyField(
        help_text="All you are billed per hour now: `running_cost_per_hour` plus `storage_cost_per_hour`.")
    seconds_left = serializers.IntegerField(
        allow_null=True, help_text="How long the balance lasts at `cost_per_hour` (running instances and storage; "
                                   "0 at or below zero); null when nothing is billed.")
    low_balance_warning_seconds = serializers.IntegerField(
        help_text="You are warned (events, email) when less than this much time is left.")
    funds_required_seconds = serializers.IntegerField(
        help_text="Renting or starting an instance needs this much of its price in the balance.")
    stop_not_before = serializers.DateTimeField(
        allow_null=True, read_only=True,
        help_text="While a notice holds: your running instances are not stopped at zero balance before this time "
                  "(UTC). It is set when what you pay went up without a funds check and left the balance low or at "
                  "zero: an instance's price raised back after a cut, or an interrupted instance running again. You "
                  "were warned then (a `low_balance` event, with this time); top up before it. What runs meanwhile "
                  "is billed as always and owed. Null when no such notice holds.")
    destroy_deadlines = DestroyDeadlineSerializer(
        many=True, read_only=True,
        help_text="While the balance is at zero: your stopped or failed instances and your volumes that the grace "
                  "period destroys, and when, soonest first. Topping up before that time keeps them. Empty when none.")
    auto_top_up = AutoTopUpSerializer()


@extend_schema(tags=["billing"])
class BalanceView(APIView):
    api_scope = RENTER_ONLY  # core/api/scopes.py

    @extend_schema(summary="Your balance and how long it lasts", responses={200: BalanceSerializer})
    def get(self, request):
        balance = ledger.wallet_balance(user_id=request.user.pk)
        rate = selectors.burn_rate(user=request.user)  # GPU time and storage, as the low-balance warning counts
        profile = BillingProfile.objects.filter(user=request.user).first()
        auto = {"enabled": False, "threshold": None, "amount": None, "card": None}
        if profile is not None and profile.auto_top_up_enabled:
            auto = {"enabled": True, "threshold": profile.auto_top_up_threshold_micros,
                    "amount": profile.auto_top_up_amount_micros, "card": profile.auto_top_up_card_id}
        return Response(BalanceSerializer({
            "balance": balance, "currency": "usd", "running_cost_per_hour": rate.instances_micros,
            "storage_cost_per_hour": rate.storage_micros, "cost_per_hour": rate.total_micros,
            "seconds_left": selectors.seconds_left(balance_micros=balance, rate_micros=rate.total_micros),
            "low_balance_warning_seconds": settings.BILLING_LOW_BALANCE_WARNING_S,
            "funds_required_seconds": settings.BILLING_FUNDS_REQUIRED_S, "auto_top_up": auto,
            "stop_not_before": selectors.stop_notice_until(
                stop_not_before=profile.stop_not_before if profile is not None else None),
            # At zero only: above it nothing is destroyed, though the record is cleared at the next enforcement tick.
            "destroy_deadlines": selectors.destroy_deadlines(
                profile.destroy_deadlines if profile is not None and balance <= 0 else None),
        }).data)


# --------------------------------------------------------------------------------------- usage


class UsageIntervalSerializer(serializers.ModelSerializer):
    instance = serializers.IntegerField(source="instance_id", read_only=True)
    price_per_hour = MoneyField(source="price_per_hour_micros", read_only=True,
                              help_text="The instance's price, fixed at booking.")
    platform_fee_percent = serializers.SerializerMethodField()
    # Net of what was given back since (billing.selectors.usage_net): what the ledger, the statement and the
    # balance count. Before, what was charged: a charge given back still read as paid here (found by review).
    amount = MoneyField(source="net_amount_micros", read_only=True, help_text=(
        "What you paid for these seconds: what was charged, less what was given back of it since (a reversal, an "
        "adjustment line of your statement: e.g. time billed after your instance's VM was last seen, found lost "
        "just as it stopped running)."))
    platform_fee = MoneyField(source="net_fee_micros", read_only=True, help_text="The platform's share of `amount`.")
    provider_earnings = MoneyField(source="net_provider_micros", read_only=True,
                                   help_text="The provider's share of `amount`.")

    class Meta:
        model = UsageInterval
        fields = ["id", "instance", "started_at", "ended_at", "seconds", "price_per_hour", "platform_fee_percent",
                  "amount", "platform_fee", "provider_earnings", "created_at"]
        read_only_fields = fields

    def get_platform_fee_percent(self, interval) -> str:
        return str(metering.fee_percent(interval.platform_fee_bps))


class IntegerFilter(django_filters.NumberFilter):
    """A whole number: "0.5" or "6e16" is a 400, as the schema's `integer` says."""

    field_class = forms.IntegerField  # type: ignore[assignment]  # django-filter takes any form field class


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    """An ISO 8601 time with any offset Python accepts, compared in UTC (PostgreSQL refuses odd offsets)."""

    def __init__(self, *args, param: str, **kwargs):
        self.param = param
        super().__init__(*args, **kwargs)

    def filter(self, qs, value):
        if value is not None:
            try:
                value = value.astimezone(UTC)
            except (OverflowError, ValueError):
                raise ValidationError({self.param: ["Out of range."]}) from None
        return super().filter(qs, value)


class UsageFilter(StrictFilterSet):
    instance = IntegerFilter(field_name="instance_id", min_value=1, max_value=2**63 - 1,
                             help_text="One of your instances.")
    since = UtcDateTimeFilter(param="since", field_name="ended_at", lookup_expr="gt",
                              help_text="Intervals that end after this time (ISO 8601).")
    until = UtcDateTimeFilter(param="until", field_name="started_at", lookup_expr="lt",
                              help_text="Intervals that start before this time (ISO 8601).")

    class Meta:
        model = UsageInterval
        fields: list[str] = []


@extend_schema_view(list=extend_schema(summary="Your usage intervals (what each stretch of running time cost)"))
@extend_schema(tags=["billing"])
class UsageViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Per-second usage of your instances while running, newest first. Storage (volumes, and the disks of stopped
    instances, at the node's price per GB-month) is charged apart: ledger transactions of kind `storage`."""

    api_scope = RENTER_ONLY  # core/api/scopes.py
    serializer_class = UsageIntervalSerializer
    filterset_class = UsageFilter
    queryset = UsageInterval.objects.none()

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.usage_for_user(user=self.request.user).order_by("-started_at", "-id")

    def list(self, request, *args, **kwargs):
        reject_unknown_params(request, UsageFilter.base_filters)
        return super().list(request, *args, **kwargs)


# --------------------------------------------------------------------------------------- events


# What an event's data keeps for the platform's own use, never shown: a price cut's cards are every card its check
# compared, by UUID with their scores, other renters' cards of the node among them (kept for the raise back to
# compare the same cards: marketplace.services.instances.pricing).
PRIVATE_EVENT_DATA = frozenset({"cards"})


class BillingEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = BillingEvent
        fields = ["id", "kind", "message", "data", "emailed", "created_at"]
        read_only_fields = fields

    def to_representation(self, instance):
        shown = super().to_representation(instance)
        if isinstance(shown.get("data"), dict):
            shown["data"] = {k: v for k, v in shown["data"].items() if k not in PRIVATE_EVENT_DATA}
        return shown


class EventFilter(StrictFilterSet):
    kind = django_filters.MultipleChoiceFilter(choices=EventKind.choices, help_text="Repeat for several.")

    class Meta:
        model = BillingEvent
        fields: list[str] = []


# A provider's events: about their earnings and payouts. The rest are the renter's (the wallet: balance warnings,
# top-ups with their amounts, refunds, disputes, credits to the balance; their instances and volumes).
PROVIDER_EVENTS = (Q(kind__in=[EventKind.PAYOUT_PAID, EventKind.PAYOUT_FAILED, EventKind.SERVICE_CREDIT])
                   | Q(kind__in=[EventKind.CREDIT, EventKind.CREDIT_REVERSED],
                       data__account=AccountKind.PROVIDER_EARNINGS))  # a reversal's, told to the earnings


@extend_schema_view(list=extend_schema(
    summary="Your billing events: warnings, credits, top-ups, payouts",
    description="A key without the `renter` scope (nor `read`) lists the provider's events only (payouts, service "
                "credits and reversals charged to the earnings): the wallet's are the renter's, as the balance. "
                "A key without the `provider` scope (nor `read`) lists all but those, as the payouts are the "
                "provider's."))
@extend_schema(tags=["billing"])
class BillingEventViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    api_scope = RENTER_OR_PROVIDER  # core/api/scopes.py; a provider-only key: PROVIDER_EVENTS (review r54), a
    # renter-only key: all others (review r55)
    serializer_class = BillingEventSerializer
    filterset_class = EventFilter
    queryset = BillingEvent.objects.none()

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        events = selectors.events_for_user(user=self.request.user)
        key = self.request.auth
        if isinstance(key, ApiKey) and missing_scopes(scopes=key.scopes, rule=RENTER_ONLY, method="GET"):
            events = events.filter(PROVIDER_EVENTS)
        elif isinstance(key, ApiKey) and missing_scopes(scopes=key.scopes, rule=PROVIDER_ONLY, method="GET"):
            # The mirror: a renter-only key reads no payout (review r55). By id: `exclude` dropped a credit without
            # an `account` in its data too (an operator's credit to the wallet), its JSON test being NULL.
            events = events.exclude(pk__in=events.filter(PROVIDER_EVENTS).values("pk"))
        return events

    def list(self, request, *args, **kwargs):
        reject_unknown_params(request, EventFilter.base_filters)
        return super().list(request, *args, **kwargs)


# -------------------------------------------------------------------------------------- profile


class ProfileSerializer(StrictFieldsMixin, serializers.Serializer):
    # Parses only: billing.services.profiles holds the rules (a card of yours, what auto top-up needs).
    stripe_connect_account_id = serializers.RegexField(
        CONNECT_ACCOUNT_ID_SET, max_length=100, required=False, allow_blank=True,
        help_text="Your Stripe Connect account (acct_...), where payouts of your earnings go. Blank: none.")
    auto_top_up_enabled = serializers.BooleanField(required=False)
    auto_top_up_threshold = CentsField(
        min_value=0, max_value=settings.BILLING_TOP_UP_MAX_USD, required=False,
        help_text="Top up automatically when the balance falls below this (USD).")
    auto_top_up_amount = top_up_amount_field(required=False, help_text="How much to add each time (USD).")
    auto_top_up_card = serializers.IntegerField(min_value=1, max_value=2**63 - 1, required=False, allow_null=True,
                                                help_text="The saved card to charge.")


def _profile_data(profile: BillingProfile) -> dict:
    return {
        "stripe_connect_account_id": profile.stripe_connect_account_id,
        "auto_top_up_enabled": profile.auto_top_up_enabled,
        "auto_top_up_threshold": f"{micros_to_usd(profile.auto_top_up_threshold_micros):.2f}",
        "auto_top_up_amount": f"{micros_to_usd(profile.auto_top_up_amount_micros):.2f}",
        "auto_top_up_card": profile.auto_top_up_card_id,
    }


class ProfileOutSerializer(serializers.Serializer):
    stripe_connect_account_id = serializers.CharField()
    auto_top_up_enabled = serializers.BooleanField()
    auto_top_up_threshold = serializers.DecimalField(max_digits=9, decimal_places=2)
    auto_top_up_amount = serializers.DecimalField(max_digits=9, decimal_places=2)
    auto_top_up_card = serializers.IntegerField(allow_null=True)


def _payout_account_change_allowed(request) -> None:
    """Where the earnings go is changed with an API key that may act as a provider (payouts are the provider
    scope's), never by a browser session alone (a copied cookie): the Payouts page asks for the password, and a key
    was made with it. Sending back the account as it is changes nothing and is not refused."""
    refuse_session_alone(request, instead="on the Payouts page (it asks for your password)")
    if PROVIDER not in request.auth.scopes:
        raise PermissionDenied("Changing the payout account needs an API key with the provider scope (payouts are "
                               "a provider's); this key does not hold it.")


def _auto_top_up_change_allowed(request, profile: BillingProfile, v: dict) -> None:
    """Auto top-up charges a saved card: the renter scope's (balance, cards, top-ups). A key that may act only as
    a provider turned it on (found by review). Sending back the settings as they are is no change."""
    stored = {"auto_top_up_enabled": profile.auto_top_up_enabled,
              "auto_top_up_threshold": micros_to_usd(profile.auto_top_up_threshold_micros),
              "auto_top_up_amount": micros_to_usd(profile.auto_top_up_amount_micros),
              "auto_top_up_card": profile.auto_top_up_card_id}
    if not any(name in v and v[name] != value for name, value in stored.items()):
        return
    if isinstance(request.auth, ApiKey) and RENTER not in request.auth.scopes:
        raise PermissionDenied("Changing auto top-up needs an API key with the renter scope (it charges your saved "
                               "card); this key does not hold it.")


@extend_schema(tags=["billing"])
class ProfileView(APIView):
    api_scope = RENTER_OR_PROVIDER  # core/api/scopes.py

    @extend_schema(summary="Your billing settings", responses={200: ProfileOutSerializer})
    def get(self, request):
        return Response(_profile_data(profile_for(user=request.user)))

    @extend_schema(summary="Change your billing settings (payout account, auto top-up)",
                   description="A new payout account is e-mailed to your address. Changing it needs an API key with "
                               "the provider scope: from a browser session, the Payouts page asks for the password. "
                               "Changing auto top-up with an API key needs the renter scope (it charges your card).",
                   request=ProfileSerializer, responses={
                       200: ProfileOutSerializer,
                       403: error_response("The payout account asked to change with a browser session, or with an "
                                           "API key without the provider scope; or auto top-up with an API key "
                                           "without the renter scope; nothing was changed.")})
    def patch(self, request):
        data = ProfileSerializer(data=request.data, context={"request": request}, partial=True)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        profile = profile_for(user=request.user)
        new_account = v.get("stripe_connect_account_id")
        if new_account is not None and new_account != profile.stripe_connect_account_id:
            _payout_account_change_allowed(request)
        _auto_top_up_change_allowed(request, profile, v)
        micros = {name: usd_to_micros(v[name]) for name in ("auto_top_up_threshold", "auto_top_up_amount") if name in v}
        changes = profiles.ProfileChanges(
            stripe_connect_account_id=v.get("stripe_connect_account_id"),
            auto_top_up_enabled=v.get("auto_top_up_enabled"),
            auto_top_up_threshold_micros=micros.get("auto_top_up_threshold"),
            auto_top_up_amount_micros=micros.get("auto_top_up_amount"),
            auto_top_up_card_id=v["auto_top_up_card"] if "auto_top_up_card" in v else profiles.KEEP,
        )
        return Response(_profile_data(profiles.profile_update(user=request.user, changes=changes,
                                                              base_url=request.build_absolute_uri("/"))))
