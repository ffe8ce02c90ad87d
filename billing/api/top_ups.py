"""Top-ups (adding money with a saved card, with an Idempotency-Key for safe retries) and refunds of them
(operators)."""
from decimal import Decimal

from django.conf import settings
from django.http import Http404
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import selectors
from billing.api.common import (
    E402,
    E409,
    E502,
    E503,
    PAYMENT_ERRORS,
    top_up_amount_field,
)
from billing.models import Card, Refund, RefundStatus, TopUp, TopUpStatus
from billing.services.refunds import refund_create_once, refund_for_idempotency_key
from billing.services.top_ups import top_up_create, top_up_for_idempotency_key
from core.api.fields import CentsField, MoneyField, StrictFieldsMixin
from core.api.filtering import reject_unknown_params
from core.api.idempotency import idempotency_key, idempotency_parameter
from core.api.schema import error_response
from core.api.scopes import ANY, RENTER_ONLY
from core.validators import no_control_characters
from marketplace.money import micros_to_usd, usd_to_micros


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


class TopUpErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()
    top_up = serializers.IntegerField(required=False, help_text="The failed top-up (status `failed`), to look at.")


class TopUpCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    amount = top_up_amount_field(help_text="USD in whole cents, e.g. \"25.00\".")
    card = serializers.IntegerField(min_value=1, max_value=2**63 - 1, help_text="The `id` of one of your saved cards.")
    read_only_elsewhere = ["id", "status", "card_label", "automatic", "failure_message", "refunded", "created_at",
                           "credited_at"]

    def validate_card(self, value):
        card = Card.objects.filter(pk=value, user=self.context["request"].user).first()
        if card is None:
            raise ValidationError("No such card of yours; save one at /api/v1/billing/cards/.")
        return card


@extend_schema_view(
    list=extend_schema(summary="Your top-ups", description=PAYMENT_ERRORS),
    retrieve=extend_schema(summary="One of your top-ups", description=PAYMENT_ERRORS),
    create=extend_schema(
        summary="Add money to your balance with a saved card",
        description=("Charges the card at once (off-session). The answer is 202 with status `processing`: the "
                     "balance is credited when the payment provider confirms the payment, within seconds. "
                     "A declined card is a 402 and credits nothing."),
        request=TopUpCreateSerializer,
        parameters=[idempotency_parameter(
            "Makes retries safe: the same key and body return the same top-up (200) without "
            "charging again; the same key with another body is a 422.",
        )],
        responses={202: TopUpSerializer, 200: OpenApiResponse(TopUpSerializer, "The top-up an earlier request "
                                                                                "with this Idempotency-Key made."),
                   402: OpenApiResponse(TopUpErrorSerializer, E402.description),
                   422: error_response("The Idempotency-Key was used for a different top-up."),
                   502: OpenApiResponse(TopUpErrorSerializer, E502.description),
                   503: OpenApiResponse(TopUpErrorSerializer, E503.description)},
    ),
)
@extend_schema(tags=["billing"])
class TopUpViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    api_scope = RENTER_ONLY  # core/api/scopes.py
    serializer_class = TopUpSerializer
    queryset = TopUp.objects.none()
    filterset_class = None

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.top_ups_for_user(user=self.request.user).prefetch_related("refunds")

    def get_object(self):
        if not (str(self.kwargs["pk"]).isascii() and str(self.kwargs["pk"]).isdigit()):  # "²" is a digit to Python
            raise Http404
        return super().get_object()

    def list(self, request, *args, **kwargs):
        reject_unknown_params(request, ())
        return super().list(request, *args, **kwargs)

    def create(self, request):
        key, fingerprint = idempotency_key(request)
        if key:
            earlier = top_up_for_idempotency_key(user=request.user, idempotency_key=key,
                                                          request_fingerprint=fingerprint)
            if earlier is not None:
                return Response(TopUpSerializer(earlier).data)
        data = TopUpCreateSerializer(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        top_up, created = top_up_create(  # a payment error names the failed top-up (`top_up`)
            user=request.user, amount_micros=usd_to_micros(data.validated_data["amount"]),
            card=data.validated_data["card"], idempotency_key=key, request_fingerprint=fingerprint)
        top_up = self.get_queryset().get(pk=top_up.pk)
        return Response(TopUpSerializer(top_up).data,
                        status=status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK)


# --------------------------------------------------------------------------------------- refunds


class RefundCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    top_up = serializers.IntegerField(min_value=1, max_value=2**63 - 1)
    amount = CentsField(min_value=Decimal("0.01"), max_value=settings.BILLING_TOP_UP_MAX_USD,
                        help_text="USD, whole cents.")
    reason = serializers.CharField(max_length=1000, validators=[no_control_characters],
                                   help_text="Why you refund: for operators only, never shown to the customer.")
    customer_note = serializers.CharField(max_length=1000, required=False, allow_blank=True,
                                          validators=[no_control_characters],
                                          help_text="What the customer reads (\"Refunded to your card.\" if empty).")


class RefundSerializer(serializers.ModelSerializer):
    top_up = serializers.IntegerField(source="top_up_id", read_only=True)
    amount = MoneyField(source="amount_micros", read_only=True)
    created_by = serializers.EmailField(source="created_by.email", read_only=True)

    class Meta:
        model = Refund
        fields = ["id", "top_up", "amount", "status", "stripe_refund_id", "reason", "customer_note", "created_by",
                  "failure_message", "created_at"]
        read_only_fields = fields


# The permission the admin's Refund action asks for (billing/admin.py REFUND_PERMISSION): a staff account the admin
# lets only view could otherwise refund here.
REFUND_PERMISSION = "billing.add_refund"


class IsOperator(permissions.BasePermission):
    message = "Only operators allowed to refund (permission billing.add_refund) can refund."

    def has_permission(self, request, view):
        return bool(request.user and request.user.is_staff and request.user.has_perm(REFUND_PERMISSION))


@extend_schema(tags=["billing"])
class RefundView(APIView):
    api_scope = ANY  # core/api/scopes.py
    permission_classes = [permissions.IsAuthenticated, IsOperator]

    @extend_schema(summary="Refund (part of) a customer's top-up to their card (operators with billing.add_refund)",
                   description=PAYMENT_ERRORS, request=RefundCreateSerializer,
                   parameters=[idempotency_parameter(
                       "Makes retries safe: the same key and body (from the same operator) return the refund the "
                       "first request made (200), as it is now, without refunding again; the same key with another "
                       "body is a 422.",
                   )],
                   responses={201: RefundSerializer,
                              200: OpenApiResponse(RefundSerializer, "The refund an earlier request with this "
                                                                     "Idempotency-Key made."),
                              409: E409,
                              422: error_response("The Idempotency-Key was used for a different refund."),
                              502: E502, 503: E503})
    def post(self, request):
        key, fingerprint = idempotency_key(request)
        if key:  # a retry gets what the first request made, even if its input would not validate now
            earlier = refund_for_idempotency_key(created_by=request.user, idempotency_key=key,
                                                 request_fingerprint=fingerprint)
            if earlier is not None:
                return Response(RefundSerializer(earlier).data)
        data = RefundCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        top_up = TopUp.objects.filter(pk=data.validated_data["top_up"]).first()
        if top_up is None:
            raise ValidationError({"top_up": ["No such top-up."]})
        refund, created = refund_create_once(
            top_up=top_up, amount_micros=usd_to_micros(data.validated_data["amount"]),
            reason=data.validated_data["reason"], created_by=request.user,
            customer_note=data.validated_data.get("customer_note", ""), idempotency_key=key,
            request_fingerprint=fingerprint)
        return Response(RefundSerializer(Refund.objects.select_related("created_by").get(pk=refund.pk)).data,
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)
