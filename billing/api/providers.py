"""Providers' money: earnings, and the payouts of them."""
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import selectors
from billing.models import BillingProfile, Payout, PayoutStatus
from billing.services import metering
from billing.services.payouts import payout_minimum_micros
from core.api.fields import MoneyField
from core.api.filtering import reject_unknown_params
from core.api.scopes import PROVIDER_ONLY

# ------------------------------------------------------------------------------------- earnings


class EarningsMonthSerializer(serializers.Serializer):
    month = serializers.SerializerMethodField()
    earned = MoneyField(source="earned_micros")
    paid_out = MoneyField(source="paid_out_micros", help_text="Payouts made this month that Stripe confirmed.")
    payout_pending = MoneyField(source="payout_pending_micros", help_text=(
        "Payouts made this month whose transfer Stripe has not confirmed yet."))

    def get_month(self, row) -> str:
        return f"{row['month']:%Y-%m}"


class EarningsSerializer(serializers.Serializer):
    balance = MoneyField(source="balance_micros", help_text=(
        "Earned and not paid out yet, nor reserved for a pending payout."))
    earned = MoneyField(source="earned_micros", help_text="All time, after the platform fee.")
    paid_out = MoneyField(source="paid_out_micros", help_text=(
        "Payouts Stripe confirmed. A failed payout is not in it: its earnings are back in balance. "
        "earned - paid_out - payout_pending = balance."))
    payout_pending = MoneyField(source="payout_pending_micros", help_text=(
        "Reserved for payouts whose transfer Stripe has not confirmed yet (status pending)."))
    renters_paid = MoneyField(source="gross_micros", help_text=(
        "What renters paid for your GPU time and storage (volumes, stopped instances' disks), net of corrections."))
    platform_fees = MoneyField(source="fees_micros", help_text="The platform's share of it.")
    adjustments = MoneyField(source="adjustments_micros", help_text=(
        "Service credits charged to your earnings (interruptions) and other corrections; negative when taken. "
        "renters_paid - platform_fees + adjustments = earned."))
    billed_seconds = serializers.IntegerField(source="seconds", help_text=(
        "Running time billed on your servers, in seconds, each instance counted once whatever its GPUs or slices "
        "(a 4-GPU instance for an hour is 3600). GPU time is gpu_seconds_sold. Time given back to renters (billed "
        "after a VM's last sighting, found lost; your earnings on it taken back) is not counted, here or below."))
    gpu_seconds_sold = serializers.IntegerField(source="gpu_seconds", help_text=(
        "Whole-GPU time sold, in GPU-seconds: each instance's billed seconds times its GPUs (a 4-GPU instance for "
        "an hour is 14400). MIG slices are not in it (mig_slice_seconds_sold)."))
    mig_slice_seconds_sold = serializers.DictField(
        source="mig_slice_seconds", child=serializers.IntegerField(), help_text=(
            "MIG slice time sold by profile, in slice-seconds: each instance's billed seconds times its slices, e.g. "
            "{\"1g.10gb\": 50400}. A slice is a part of a GPU, so this is not GPU time; profiles are not added up."))
    platform_fee_percent = serializers.CharField(help_text="For new rentals; each rental keeps the fee it "
                                                           "was booked with.")
    payout_minimum = MoneyField()
    payout_account_set = serializers.BooleanField(help_text="Whether your Stripe Connect account id is set "
                                                            "(PATCH /api/v1/billing/profile/).")
    months = EarningsMonthSerializer(many=True)


@extend_schema(tags=["billing"])
class EarningsView(APIView):
    api_scope = PROVIDER_ONLY  # core/api/scopes.py

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
    api_scope = PROVIDER_ONLY  # core/api/scopes.py
    serializer_class = PayoutSerializer
    queryset = Payout.objects.none()
    filterset_class = None

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.payouts_for_user(user=self.request.user)

    def list(self, request, *args, **kwargs):
        reject_unknown_params(request, ())
        return super().list(request, *args, **kwargs)
