"""Monthly statements: totals per month, and one month in detail."""
import re
from datetime import date

from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import selectors
from billing.api.top_ups import TopUpSerializer
from billing.models import RefundStatus
from core.api.fields import MoneyField
from core.api.schema import error_response
from core.api.scopes import RENTER_ONLY

_MONTH_RE = re.compile(r"(\d{4})-(\d{2})", re.ASCII)  # as the schema says: not ٢٠٢٤-٠١


class StatementSummarySerializer(serializers.Serializer):
    month = serializers.CharField(help_text="YYYY-MM (UTC).")
    opening_balance = MoneyField(source="opening_micros")
    top_ups = MoneyField(source="top_ups_micros")
    usage = MoneyField(source="usage_micros", help_text="Charged for running instances.")
    storage = MoneyField(source="storage_micros", help_text="Charged for volumes and stopped instances' disks.")
    refunds = MoneyField(source="refunds_micros")
    adjustments = MoneyField(source="adjustments_micros", help_text="Credits and corrections (signed).")
    closing_balance = MoneyField(source="closing_micros",
                               help_text="opening_balance + top_ups - usage - storage - refunds + adjustments.")

    def to_representation(self, statement):
        data = super().to_representation(statement)
        data["month"] = f"{statement.month:%Y-%m}"
        return data


class UsageLineSerializer(serializers.Serializer):
    instance = serializers.IntegerField()
    label = serializers.CharField()  # type: ignore[assignment]  # a declared field (DRF's metaclass takes it)
    gpu_model = serializers.CharField()
    num_gpus = serializers.IntegerField()
    price_per_hour = MoneyField(source="price_per_hour_micros")
    seconds = serializers.IntegerField()
    amount = MoneyField(source="amount_micros")
    intervals = serializers.IntegerField()
    started_at = serializers.DateTimeField(source="from")
    ended_at = serializers.DateTimeField(source="to")


# The refunds API's `status` values (RefundStatusEnum), as a schema of their own (RefundLineStatusEnum): a second
# ChoiceField of the same choices made drf-spectacular rename RefundStatusEnum to a hash for both.
@extend_schema_field({"type": "string", "enum": list(RefundStatus.values)})
class RefundStatusField(serializers.CharField):
    pass


@extend_schema_field({"type": "string", "enum": [selectors.RefundLineKind.HOLD, selectors.RefundLineKind.DEBIT]})
class RefundLineKindField(serializers.CharField):
    pass


class RefundLineSerializer(serializers.Serializer):  # a selectors.RefundLine
    """One time a refund's money left your balance: its hold, or its debit."""

    id = serializers.IntegerField(source="refund.pk", help_text="The refund's id (a refund can have two lines).")
    top_up = serializers.IntegerField(source="refund.top_up_id")
    kind = RefundLineKindField(help_text=(
        "`hold`: the amount was held from your balance when the refund was asked for; `debit`: debited when the "
        "payment provider had the refund (one made there, or one made after its hold was given back)."))
    amount = MoneyField(source="amount_micros", help_text="What left your balance on this line.")
    status = RefundStatusField(
        source="refund.status",
        help_text="The refund's, now: `pending`, its amount held from your balance for the refund, which the payment "
                  "provider has not confirmed yet; `succeeded`, refunded to your card; `failed`, not made (or failed "
                  "after it was made).")
    given_back = serializers.BooleanField(help_text=(
        "This line's amount came back to your balance since (the hold given back when the refund was not made, or "
        "the debit when it failed): an adjustment line, in the month it came back."))
    note = serializers.CharField(source="refund.customer_note", help_text="What the platform tells you about it.")
    debited_at = serializers.DateTimeField(source="at", help_text=(
        "When this line's amount left your balance: when the refund was asked for (`hold`), or when the payment "
        "provider had it (`debit`)."))
    refunded_at = serializers.DateTimeField(source="refund.transaction.created_at", allow_null=True, help_text=(
        "When the payment provider took the refund; null while it is pending, or if it never did."))


class AdjustmentLineSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    kind = serializers.CharField()
    amount = MoneyField(source="amount_micros")
    memo = serializers.CharField()
    note = serializers.CharField(help_text="What the platform tells you about it.")


class StorageLineSerializer(AdjustmentLineSerializer):
    amount = MoneyField(source="charged_micros",
                        help_text="Charged: positive, as `storage` and the usage lines (a storage credit: negative).")


class StatementSerializer(StatementSummarySerializer):
    usage_lines = UsageLineSerializer(many=True, help_text="Usage per instance.")
    top_up_lines = TopUpSerializer(source="top_ups", many=True)
    refund_lines = RefundLineSerializer(source="refunds", many=True, help_text=(
        "Each time a refund's amount left your balance this month, its hold or its debit: they sum to `refunds`."))
    adjustment_lines = AdjustmentLineSerializer(source="adjustments", many=True, help_text=(
        "Credits and corrections, each signed as it moved the balance, as `adjustments`."))
    storage_lines = StorageLineSerializer(source="storage", many=True,
                                             help_text="Each storage charge (a volume's or a stopped disk's).")


@extend_schema(tags=["billing"])
class StatementListView(APIView):
    # The renter wallet's statement (its balance, top-ups with card labels, refunds): `renter`, as the balance and
    # the top-ups are; a `provider`-only key (a node script's) reads earnings and payouts, not the wallet.
    api_scope = RENTER_ONLY  # core/api/scopes.py

    @extend_schema(summary="Your monthly statements (totals; newest first)",
                   responses={200: StatementSummarySerializer(many=True)})
    def get(self, request):
        return Response(StatementSummarySerializer(selectors.statement_months(user=request.user), many=True).data)


@extend_schema(tags=["billing"])
class StatementDetailView(APIView):
    api_scope = RENTER_ONLY  # core/api/scopes.py: the wallet's, as StatementListView

    @extend_schema(summary="Your statement of one month: usage per instance, top-ups, refunds, totals",
                   parameters=[OpenApiParameter("month", str, OpenApiParameter.PATH, pattern=r"^\d{4}-\d{2}$",
                                                description="YYYY-MM (UTC)")],
                   responses={200: StatementSerializer,
                              404: error_response("Not a month (YYYY-MM from 2000 to 2999).")})
    def get(self, request, month: str):
        match = _MONTH_RE.fullmatch(month)
        if not match or not 2000 <= int(match[1]) <= 2999 or not 1 <= int(match[2]) <= 12:
            raise Http404
        statement = selectors.statement_for(user=request.user, month=date(int(match[1]), int(match[2]), 1))
        return Response(StatementSerializer(statement).data)
