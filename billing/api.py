"""The billing API under /api/v1/billing/: balance, usage, cards, top-ups, the Stripe webhook, events,
statements, earnings, payouts, the billing profile, and refunds (operators).

Thin: serializers check input, billing.services does the work, PaymentError becomes its HTTP answer
here. Amounts are USD decimal strings (six places out; whole cents in).
"""
import re
from datetime import UTC, date
from decimal import Decimal

import django_filters
from django import forms
from django.conf import settings
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import selectors
from billing.models import (
    BillingEvent,
    BillingProfile,
    Card,
    EventKind,
    Payout,
    PayoutStatus,
    Refund,
    RefundStatus,
    TopUp,
    TopUpStatus,
    UsageInterval,
)
from billing.services import ledger, metering, payments
from billing.services.payments import WebhookInvalid
from billing.services.payouts import payout_minimum_micros
from billing.services.stripe_gateway import PaymentError
from marketplace.api.fields import StrictFieldsMixin, UsdField, no_control_characters
from marketplace.api.filtering import StrictFilterSet
from marketplace.api.schema import ErrorDetailSerializer
from marketplace.money import micros_to_usd, usd_to_micros

IDEMPOTENCY_HEADER = "Idempotency-Key"
_IDEMPOTENCY_KEY_RE = re.compile(r"[\x21-\x7e]{1,100}")
_MONTH_RE = re.compile(r"(\d{4})-(\d{2})")
PAGINATION_PARAMS = {"page", "page_size", "format"}


class MoneyField(UsdField):
    """USD with six places, like prices, but room for balances and totals up to $999,999,999,999."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_digits", 18)
        super().__init__(**kwargs)


def _error(code: int, text: str) -> OpenApiResponse:
    return OpenApiResponse(ErrorDetailSerializer, text)


E402 = _error(402, "The card was declined; nothing was charged or credited. `detail` says why.")
E409 = _error(409, "The state of the top-up or balance forbids it; `detail` says why.")
E502 = _error(502, "The payment provider refused the request; nothing was done.")
E503 = _error(503, "The payment provider could not be reached; nothing was done. Try again later.")


class PaymentErrorsMixin:
    """Payment errors become their HTTP answers ({"detail": ...}, or the field at fault for a 400)."""

    def handle_exception(self, exc):
        if isinstance(exc, PaymentError):
            if exc.status_code == 400 and exc.field:
                body = {exc.field: [exc.message]}
            else:
                body = {"detail": exc.message}
                if getattr(exc, "top_up", None) is not None:
                    body["top_up"] = exc.top_up
            return Response(body, status=exc.status_code)
        return super().handle_exception(exc)


def _reject_unknown_params(request, allowed) -> None:
    unknown = sorted(set(request.query_params) - set(allowed) - PAGINATION_PARAMS)
    if unknown:
        raise ValidationError({name: ["Unknown query parameter."] for name in unknown})


# ------------------------------------------------------------------------------------- balance


class AutoTopUpSerializer(serializers.Serializer):
    enabled = serializers.BooleanField()
    threshold = MoneyField(allow_null=True, help_text="Top up when the balance falls below this.")
    amount = MoneyField(allow_null=True, help_text="How much each automatic top-up adds.")
    card = serializers.IntegerField(allow_null=True, help_text="The saved card charged.")


class BalanceSerializer(serializers.Serializer):
    balance = MoneyField(help_text="Your prepaid balance. It can dip below zero by at most one minute of usage.")
    currency = serializers.CharField()
    running_cost_per_hour = MoneyField(help_text="What your running instances cost per hour now.")
    seconds_left = serializers.IntegerField(
        allow_null=True, help_text="How long the balance lasts at that rate; null when nothing runs.")
    low_balance_warning_seconds = serializers.IntegerField(
        help_text="You are warned (events, email) when less than this much time is left.")
    funds_required_seconds = serializers.IntegerField(
        help_text="Renting or starting an instance needs this much of its price in the balance.")
    auto_top_up = AutoTopUpSerializer()


@extend_schema(tags=["billing"])
class BalanceView(APIView):
    @extend_schema(summary="Your balance and how long it lasts", responses={200: BalanceSerializer})
    def get(self, request):
        balance = ledger.wallet_balance(user_id=request.user.pk)
        rate = selectors.burn_rate_micros(user=request.user)
        profile = BillingProfile.objects.filter(user=request.user).first()
        auto = {"enabled": False, "threshold": None, "amount": None, "card": None}
        if profile is not None and profile.auto_top_up_enabled:
            auto = {"enabled": True, "threshold": profile.auto_top_up_threshold_micros,
                    "amount": profile.auto_top_up_amount_micros, "card": profile.auto_top_up_card_id}
        return Response(BalanceSerializer({
            "balance": balance, "currency": "usd", "running_cost_per_hour": rate,
            "seconds_left": max(balance, 0) * 3600 // rate if rate else None,
            "low_balance_warning_seconds": settings.BILLING_LOW_BALANCE_WARNING_S,
            "funds_required_seconds": settings.BILLING_FUNDS_REQUIRED_S, "auto_top_up": auto,
        }).data)


# --------------------------------------------------------------------------------------- usage


class UsageIntervalSerializer(serializers.ModelSerializer):
    instance = serializers.IntegerField(source="instance_id", read_only=True)
    price_per_hour = MoneyField(source="price_per_hour_micros", read_only=True,
                              help_text="The instance's price, fixed at booking.")
    platform_fee_percent = serializers.SerializerMethodField()
    amount = MoneyField(source="amount_micros", read_only=True, help_text="What you paid for these seconds.")
    platform_fee = MoneyField(source="fee_micros", read_only=True, help_text="The platform's share of `amount`.")
    provider_earnings = MoneyField(source="provider_micros", read_only=True,
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

    field_class = forms.IntegerField


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
    """Per-second usage of your instances while running, newest first. Stopped instances are not charged
    (not even for their disk)."""

    serializer_class = UsageIntervalSerializer
    filterset_class = UsageFilter
    queryset = UsageInterval.objects.none()

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.usage_for_user(user=self.request.user).order_by("-started_at", "-id")

    def list(self, request, *args, **kwargs):
        _reject_unknown_params(request, UsageFilter.base_filters)
        return super().list(request, *args, **kwargs)


# ---------------------------------------------------------------------------------------- cards


class CardSerializer(serializers.ModelSerializer):
    class Meta:
        model = Card
        fields = ["id", "brand", "last4", "exp_month", "exp_year", "created_at"]
        read_only_fields = fields


class CardCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    payment_method = serializers.CharField(max_length=100, required=False,
                                           help_text="A payment method id (pm_...) from Stripe.js.")
    setup_intent = serializers.CharField(max_length=100, required=False,
                                         help_text="A SetupIntent (seti_...) you confirmed with the card.")

    def validate(self, attrs):
        if bool(attrs.get("payment_method")) == bool(attrs.get("setup_intent")):
            raise ValidationError({"payment_method": ["Give either `payment_method` or `setup_intent`."]})
        return attrs


class SetupIntentSerializer(serializers.Serializer):
    setup_intent = serializers.CharField()
    client_secret = serializers.CharField(help_text="For Stripe.js: stripe.confirmCardSetup(client_secret, ...).")
    publishable_key = serializers.CharField()


@extend_schema_view(
    list=extend_schema(summary="Your saved cards"),
    create=extend_schema(summary="Save a card", request=CardCreateSerializer, responses={
        201: CardSerializer, 200: OpenApiResponse(CardSerializer, "The card was saved before."),
        402: E402, 502: E502, 503: E503}),
    destroy=extend_schema(summary="Forget a saved card", responses={204: None}),
    setup_intent=extend_schema(summary="Start saving a card (a Stripe SetupIntent)", request=None,
                               responses={201: SetupIntentSerializer, 502: E502, 503: E503}),
)
@extend_schema(tags=["billing"])
class CardViewSet(PaymentErrorsMixin, mixins.ListModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Cards are saved at Stripe; here only their brand, last digits and expiry are kept."""

    serializer_class = CardSerializer
    queryset = Card.objects.none()
    filterset_class = None
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.cards_for_user(user=self.request.user)

    def get_object(self):
        pk = self.kwargs["pk"]
        if not str(pk).isdigit():
            raise Http404
        return super().get_object()

    def create(self, request):
        data = CardCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        card, created = payments.card_add(user=request.user, payment_method=data.validated_data.get(
            "payment_method", ""), setup_intent=data.validated_data.get("setup_intent", ""))
        return Response(CardSerializer(card).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    def perform_destroy(self, instance):
        payments.card_remove(card=instance)

    @action(detail=False, methods=["post"], url_path="setup-intent")
    def setup_intent(self, request):
        return Response(SetupIntentSerializer(payments.setup_intent_create(user=request.user)).data,
                        status=status.HTTP_201_CREATED)


# -------------------------------------------------------------------------------------- top-ups


class TopUpSerializer(serializers.ModelSerializer):
    amount = MoneyField(source="amount_micros", read_only=True)
    card = serializers.IntegerField(source="card_id", read_only=True, allow_null=True)
    status = serializers.ChoiceField(choices=TopUpStatus.choices, read_only=True, help_text=(
        "pending: recorded, not charged yet; processing: charged, the credit follows within seconds; "
        "succeeded: credited; failed: declined or not charged, nothing credited."))
    refunded = serializers.SerializerMethodField()

    class Meta:
        model = TopUp
        fields = ["id", "amount", "card", "card_label", "automatic", "status", "failure_message", "refunded",
                  "created_at", "credited_at"]
        read_only_fields = fields

    def get_refunded(self, top_up) -> str:
        total = sum(r.amount_micros for r in top_up.refunds.all() if r.status == RefundStatus.SUCCEEDED)
        return str(micros_to_usd(total))


class CentsField(serializers.DecimalField):
    """USD in whole cents as a plain decimal string ("25" or "25.00"): no exponents, no more places."""

    _PLAIN = re.compile(r"\d{1,7}(\.\d{1,2})?")

    def __init__(self, **kwargs):
        kwargs.setdefault("max_digits", 9)
        kwargs.setdefault("decimal_places", 2)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, str) and not self._PLAIN.fullmatch(data.strip()):
            self.fail("invalid")
        return super().to_internal_value(data)


def _top_up_amount_field(**kwargs):
    return CentsField(min_value=settings.BILLING_TOP_UP_MIN_USD, max_value=settings.BILLING_TOP_UP_MAX_USD, **kwargs)


class TopUpErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()
    top_up = serializers.IntegerField(required=False, help_text="The failed top-up (status `failed`), to look at.")


class TopUpCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    amount = _top_up_amount_field(help_text="USD in whole cents, e.g. \"25.00\".")
    card = serializers.IntegerField(min_value=1, max_value=2**63 - 1, help_text="The `id` of one of your saved cards.")
    read_only_elsewhere = ["id", "status", "card_label", "automatic", "failure_message", "refunded", "created_at",
                           "credited_at"]

    def validate_card(self, value):
        card = Card.objects.filter(pk=value, user=self.context["request"].user).first()
        if card is None:
            raise ValidationError("No such card of yours; save one at /api/v1/billing/cards/.")
        return card


@extend_schema_view(
    list=extend_schema(summary="Your top-ups"),
    retrieve=extend_schema(summary="One of your top-ups"),
    create=extend_schema(
        summary="Add money to your balance with a saved card",
        description=("Charges the card at once (off-session). The answer is 202 with status `processing`: the "
                     "balance is credited when the payment provider confirms the payment, within seconds. "
                     "A declined card is a 402 and credits nothing."),
        request=TopUpCreateSerializer,
        parameters=[OpenApiParameter(
            IDEMPOTENCY_HEADER, {"type": "string", "minLength": 1, "maxLength": 100, "pattern": r"^[!-~]+$"},
            OpenApiParameter.HEADER,
            description="Makes retries safe: the same key and body return the same top-up (200) without "
                        "charging again; the same key with another body is a 422.",
        )],
        responses={202: TopUpSerializer, 200: OpenApiResponse(TopUpSerializer, "The top-up an earlier request "
                                                                                "with this Idempotency-Key made."),
                   402: OpenApiResponse(TopUpErrorSerializer, E402.description),
                   422: _error(422, "The Idempotency-Key was used for a different top-up."),
                   502: OpenApiResponse(TopUpErrorSerializer, E502.description),
                   503: OpenApiResponse(TopUpErrorSerializer, E503.description)},
    ),
)
@extend_schema(tags=["billing"])
class TopUpViewSet(PaymentErrorsMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = TopUpSerializer
    queryset = TopUp.objects.none()
    filterset_class = None

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.top_ups_for_user(user=self.request.user).prefetch_related("refunds")

    def get_object(self):
        if not str(self.kwargs["pk"]).isdigit():
            raise Http404
        return super().get_object()

    def list(self, request, *args, **kwargs):
        _reject_unknown_params(request, ())
        return super().list(request, *args, **kwargs)

    def create(self, request):
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is not None and not _IDEMPOTENCY_KEY_RE.fullmatch(key):
            raise ValidationError({IDEMPOTENCY_HEADER: ["Must be 1 to 100 printable ASCII characters."]})
        key = key or ""
        fingerprint = payments.request_fingerprint(request.data) if key else ""
        if key:
            earlier = payments.top_up_for_idempotency_key(user=request.user, idempotency_key=key,
                                                          request_fingerprint=fingerprint)
            if earlier is not None:
                return Response(TopUpSerializer(earlier).data)
        data = TopUpCreateSerializer(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        top_up, created = payments.top_up_create(  # a PaymentError names the failed top-up (`top_up`)
            user=request.user, amount_micros=usd_to_micros(data.validated_data["amount"]),
            card=data.validated_data["card"], idempotency_key=key, request_fingerprint=fingerprint)
        top_up = self.get_queryset().get(pk=top_up.pk)
        return Response(TopUpSerializer(top_up).data,
                        status=status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK)


# -------------------------------------------------------------------------------------- webhook


class WebhookAnswerSerializer(serializers.Serializer):
    received = serializers.BooleanField()
    status = serializers.CharField(help_text="processed, ignored (not an event this platform acts on) or failed.")


@extend_schema(tags=["billing"])
class StripeWebhookView(APIView):
    """Stripe's events. Verified with the Stripe-Signature header (the webhook secret); each event id is
    acted on once however often it is delivered."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(
        summary="Stripe webhook (called by Stripe)",
        request={"application/json": OpenApiTypes.OBJECT},
        parameters=[OpenApiParameter("Stripe-Signature", str, OpenApiParameter.HEADER, required=False,
                                     description="t=<timestamp>,v1=<HMAC-SHA256 of \"t.body\">")],
        responses={200: WebhookAnswerSerializer,
                   400: _error(400, "Missing or bad signature, or not an event: nothing was recorded."),
                   500: _error(500, "Processing failed; the event is kept as failed and Stripe delivers it again.")},
    )
    def post(self, request):
        try:
            event = payments.webhook_receive(payload=request.body, signature=request.headers.get("Stripe-Signature"))
        except WebhookInvalid as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        code = status.HTTP_500_INTERNAL_SERVER_ERROR if event.status == "failed" else status.HTTP_200_OK
        return Response({"received": True, "status": event.status}, status=code)


# --------------------------------------------------------------------------------------- events


class BillingEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = BillingEvent
        fields = ["id", "kind", "message", "data", "emailed", "created_at"]
        read_only_fields = fields


class EventFilter(StrictFilterSet):
    kind = django_filters.MultipleChoiceFilter(choices=EventKind.choices, help_text="Repeat for several.")

    class Meta:
        model = BillingEvent
        fields: list[str] = []


@extend_schema_view(list=extend_schema(summary="Your billing events: warnings, credits, top-ups, payouts"))
@extend_schema(tags=["billing"])
class BillingEventViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    serializer_class = BillingEventSerializer
    filterset_class = EventFilter
    queryset = BillingEvent.objects.none()

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.events_for_user(user=self.request.user)

    def list(self, request, *args, **kwargs):
        _reject_unknown_params(request, EventFilter.base_filters)
        return super().list(request, *args, **kwargs)


# ----------------------------------------------------------------------------------- statements


class StatementSummarySerializer(serializers.Serializer):
    month = serializers.CharField(help_text="YYYY-MM (UTC).")
    opening_balance = MoneyField(source="opening_micros")
    top_ups = MoneyField(source="top_ups_micros")
    usage = MoneyField(source="usage_micros", help_text="Charged for running instances.")
    refunds = MoneyField(source="refunds_micros")
    adjustments = MoneyField(source="adjustments_micros", help_text="Credits and corrections (signed).")
    closing_balance = MoneyField(source="closing_micros",
                               help_text="opening_balance + top_ups - usage - refunds + adjustments.")

    def to_representation(self, statement):
        data = super().to_representation(statement)
        data["month"] = f"{statement.month:%Y-%m}"
        return data


class UsageLineSerializer(serializers.Serializer):
    instance = serializers.IntegerField()
    label = serializers.CharField()
    gpu_model = serializers.CharField()
    num_gpus = serializers.IntegerField()
    price_per_hour = MoneyField(source="price_per_hour_micros")
    seconds = serializers.IntegerField()
    amount = MoneyField(source="amount_micros")
    intervals = serializers.IntegerField()
    started_at = serializers.DateTimeField(source="from")
    ended_at = serializers.DateTimeField(source="to")


class RefundLineSerializer(serializers.ModelSerializer):
    top_up = serializers.IntegerField(source="top_up_id")
    amount = MoneyField(source="amount_micros")
    refunded_at = serializers.DateTimeField(source="transaction.created_at")

    class Meta:
        model = Refund
        fields = ["id", "top_up", "amount", "reason", "refunded_at"]


class AdjustmentLineSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    kind = serializers.CharField()
    amount = MoneyField(source="amount_micros")
    memo = serializers.CharField()
    reason = serializers.CharField()


class StatementSerializer(StatementSummarySerializer):
    usage_lines = UsageLineSerializer(many=True, help_text="Usage per instance.")
    top_up_lines = TopUpSerializer(source="top_ups", many=True)
    refund_lines = RefundLineSerializer(source="refunds", many=True)
    adjustment_lines = AdjustmentLineSerializer(source="adjustments", many=True)


@extend_schema(tags=["billing"])
class StatementListView(APIView):
    @extend_schema(summary="Your monthly statements (totals; newest first)",
                   responses={200: StatementSummarySerializer(many=True)})
    def get(self, request):
        return Response(StatementSummarySerializer(selectors.statement_months(user=request.user), many=True).data)


@extend_schema(tags=["billing"])
class StatementDetailView(APIView):
    @extend_schema(summary="Your statement of one month: usage per instance, top-ups, refunds, totals",
                   parameters=[OpenApiParameter("month", str, OpenApiParameter.PATH, pattern=r"^\d{4}-\d{2}$",
                                                description="YYYY-MM (UTC)")],
                   responses={200: StatementSerializer,
                              404: _error(404, "Not a month (YYYY-MM from 2000 to 2999).")})
    def get(self, request, month: str):
        match = _MONTH_RE.fullmatch(month)
        if not match or not 2000 <= int(match[1]) <= 2999 or not 1 <= int(match[2]) <= 12:
            raise Http404
        statement = selectors.statement_for(user=request.user, month=date(int(match[1]), int(match[2]), 1))
        return Response(StatementSerializer(statement).data)


# ------------------------------------------------------------------------------------- earnings


class EarningsMonthSerializer(serializers.Serializer):
    month = serializers.SerializerMethodField()
    earned = MoneyField(source="earned_micros")
    paid_out = MoneyField(source="paid_out_micros")

    def get_month(self, row) -> str:
        return f"{row['month']:%Y-%m}"


class EarningsSerializer(serializers.Serializer):
    balance = MoneyField(source="balance_micros", help_text="Earned and not paid out yet.")
    earned = MoneyField(source="earned_micros", help_text="All time, after the platform fee.")
    paid_out = MoneyField(source="paid_out_micros")
    renters_paid = MoneyField(source="gross_micros", help_text="What renters paid for your instances.")
    platform_fees = MoneyField(source="fees_micros", help_text="The platform's share of it.")
    billed_seconds = serializers.IntegerField(source="seconds")
    platform_fee_percent = serializers.CharField(help_text="For new rentals; each rental keeps the fee it "
                                                           "was booked with.")
    payout_minimum = MoneyField()
    payout_account_set = serializers.BooleanField(help_text="Whether your Stripe Connect account id is set "
                                                            "(PATCH /api/v1/billing/profile/).")
    months = EarningsMonthSerializer(many=True)


@extend_schema(tags=["billing"])
class EarningsView(APIView):
    @extend_schema(summary="Your earnings as a provider", responses={200: EarningsSerializer})
    def get(self, request):
        earnings = selectors.earnings_for(user=request.user)
        account = (BillingProfile.objects.filter(user=request.user)
                   .values_list("stripe_connect_account_id", flat=True).first())
        earnings.platform_fee_percent = str(metering.fee_percent(metering.platform_fee_bps()))
        earnings.payout_minimum = payout_minimum_micros()
        earnings.payout_account_set = bool(account)
        return Response(EarningsSerializer(earnings).data)


# -------------------------------------------------------------------------------------- payouts


class PayoutSerializer(serializers.ModelSerializer):
    amount = MoneyField(source="amount_micros", read_only=True)
    status = serializers.ChoiceField(choices=PayoutStatus.choices, read_only=True)

    class Meta:
        model = Payout
        fields = ["id", "period_start", "period_end", "amount", "destination", "status", "transfer_id",
                  "failure_message", "created_at", "paid_at"]
        read_only_fields = fields


@extend_schema_view(list=extend_schema(summary="Your payouts (weekly transfers of your earnings)"))
@extend_schema(tags=["billing"])
class PayoutViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    serializer_class = PayoutSerializer
    queryset = Payout.objects.none()
    filterset_class = None

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.payouts_for_user(user=self.request.user)

    def list(self, request, *args, **kwargs):
        _reject_unknown_params(request, ())
        return super().list(request, *args, **kwargs)


# -------------------------------------------------------------------------------------- profile


class ProfileSerializer(StrictFieldsMixin, serializers.Serializer):
    stripe_connect_account_id = serializers.RegexField(
        r"^(acct_[A-Za-z0-9]{1,90})?$", max_length=100, required=False, allow_blank=True,
        help_text="Your Stripe Connect account (acct_...), where payouts of your earnings go. Blank: none.")
    auto_top_up_enabled = serializers.BooleanField(required=False)
    auto_top_up_threshold = CentsField(
        min_value=0, max_value=settings.BILLING_TOP_UP_MAX_USD, required=False,
        help_text="Top up automatically when the balance falls below this (USD).")
    auto_top_up_amount = _top_up_amount_field(required=False, help_text="How much to add each time (USD).")
    auto_top_up_card = serializers.IntegerField(min_value=1, max_value=2**63 - 1, required=False, allow_null=True,
                                                help_text="The saved card to charge.")

    def validate_auto_top_up_card(self, value):
        if value is None:
            return None
        card = Card.objects.filter(pk=value, user=self.context["request"].user).first()
        if card is None:
            raise ValidationError("No such card of yours.")
        return card


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


@extend_schema(tags=["billing"])
class ProfileView(APIView):
    @extend_schema(summary="Your billing settings", responses={200: ProfileOutSerializer})
    def get(self, request):
        return Response(_profile_data(payments.profile_for(user=request.user)))

    @extend_schema(summary="Change your billing settings (payout account, auto top-up)",
                   request=ProfileSerializer, responses={200: ProfileOutSerializer})
    def patch(self, request):
        data = ProfileSerializer(data=request.data, context={"request": request}, partial=True)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        profile = payments.profile_for(user=request.user)
        if "stripe_connect_account_id" in v:
            profile.stripe_connect_account_id = v["stripe_connect_account_id"]
        if "auto_top_up_threshold" in v:
            profile.auto_top_up_threshold_micros = usd_to_micros(v["auto_top_up_threshold"])
        if "auto_top_up_amount" in v:
            profile.auto_top_up_amount_micros = usd_to_micros(v["auto_top_up_amount"])
        if "auto_top_up_card" in v:
            profile.auto_top_up_card = v["auto_top_up_card"]
        if "auto_top_up_enabled" in v:
            profile.auto_top_up_enabled = v["auto_top_up_enabled"]
        if profile.auto_top_up_enabled:
            problems = {}
            if profile.auto_top_up_card_id is None:
                problems["auto_top_up_card"] = ["Auto top-up needs a saved card."]
            low, high = payments.top_up_bounds()
            if not low <= profile.auto_top_up_amount_micros <= high:
                problems["auto_top_up_amount"] = [f"Between ${micros_to_usd(low)} and ${micros_to_usd(high)}."]
            if profile.auto_top_up_threshold_micros <= 0:
                problems["auto_top_up_threshold"] = ["Give a threshold above zero."]
            if problems:
                raise ValidationError(problems)
        profile.save()
        return Response(_profile_data(profile))


# --------------------------------------------------------------------------------------- refunds


class RefundCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    top_up = serializers.IntegerField(min_value=1, max_value=2**63 - 1)
    amount = CentsField(min_value=Decimal("0.01"), max_value=settings.BILLING_TOP_UP_MAX_USD,
                        help_text="USD, whole cents.")
    reason = serializers.CharField(max_length=1000, validators=[no_control_characters])


class RefundSerializer(serializers.ModelSerializer):
    top_up = serializers.IntegerField(source="top_up_id", read_only=True)
    amount = MoneyField(source="amount_micros", read_only=True)
    created_by = serializers.EmailField(source="created_by.email", read_only=True)

    class Meta:
        model = Refund
        fields = ["id", "top_up", "amount", "status", "stripe_refund_id", "reason", "created_by", "failure_message",
                  "created_at"]
        read_only_fields = fields


class IsOperator(permissions.BasePermission):
    message = "Only operators can refund."

    def has_permission(self, request, view):
        return bool(request.user and request.user.is_staff)


@extend_schema(tags=["billing"])
class RefundView(PaymentErrorsMixin, APIView):
    permission_classes = [permissions.IsAuthenticated, IsOperator]

    @extend_schema(summary="Refund (part of) a customer's top-up to their card (operators)",
                   request=RefundCreateSerializer,
                   responses={201: RefundSerializer, 409: E409, 502: E502, 503: E503})
    def post(self, request):
        data = RefundCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        top_up = TopUp.objects.filter(pk=data.validated_data["top_up"]).first()
        if top_up is None:
            raise ValidationError({"top_up": ["No such top-up."]})
        refund = payments.refund_create(top_up=top_up, amount_micros=usd_to_micros(data.validated_data["amount"]),
                                        reason=data.validated_data["reason"], created_by=request.user)
        return Response(RefundSerializer(Refund.objects.select_related("created_by").get(pk=refund.pk)).data,
                        status=status.HTTP_201_CREATED)

