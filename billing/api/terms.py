"""The marketplace's published terms: the platform fee, the funds rules and the interruption credit rule.

Public (no key needed): renters and providers read what they agree to before they sign up.
"""
from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import permissions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from billing.services import credits, metering
from core.api.scopes import PUBLIC


class InterruptionTermsSerializer(serializers.Serializer):
    detected_after_failed_health_checks = serializers.IntegerField(
        help_text="A running instance is `interrupted` when its node misses this many health checks in a row, "
                  "or at once when the node answers but the instance's VM is not running.")
    health_check_interval_seconds = serializers.IntegerField()
    billing_stops_at = serializers.CharField(help_text="The moment billing stops for an interrupted instance.")
    credit_multiple = serializers.CharField(
        help_text="The renter is credited this multiple of the instance's price for the time lost, on top of not "
                  "being billed for it.")
    credit_max_seconds = serializers.IntegerField(help_text="The time lost counted per interruption, at most.")
    charged_to = serializers.CharField(help_text="Who pays the credit: the provider's earnings.")
    unreachable_destroy = serializers.CharField(help_text="What deleting an instance on an unreachable node does.")
    resumed = serializers.CharField(help_text="What happens when an interrupted instance runs again.")


class HardwareTermsSerializer(serializers.Serializer):
    price_cut = serializers.CharField(help_text="What renters pay when a re-check finds their node worse.")
    price_back = serializers.CharField(help_text="What they pay when a later re-check finds it better again.")
    tolerance = serializers.CharField(help_text="Score drops within this share are measurement noise: no cut.")


class TermsSerializer(serializers.Serializer):
    currency = serializers.CharField()
    platform_fee_percent = serializers.CharField(help_text="The platform's share of what renters pay, for new "
                                                           "rentals; each rental keeps the fee it was booked with.")
    funds_required_seconds = serializers.IntegerField(
        help_text="Renting or starting an instance needs this much of your whole burn rate in the balance.")
    low_balance_warning_seconds = serializers.IntegerField()
    zero_balance = serializers.CharField()
    grace_period_seconds = serializers.IntegerField(
        help_text="A renter at zero balance keeps stopped instances (and failed ones holding a volume) and "
                  "volumes this long from when each became due, and is warned by name before any is destroyed.")
    interruptions = InterruptionTermsSerializer()
    hardware_found_worse = HardwareTermsSerializer()


class TermsView(APIView):
    api_scope = PUBLIC  # core/api/scopes.py
    permission_classes = [permissions.AllowAny]

    @extend_schema(tags=["billing"], summary="The published terms: fee, funds rules, interruption credits",
                   responses={200: TermsSerializer})
    def get(self, request):
        rule = credits.credit_terms()
        return Response(TermsSerializer({
            "currency": "usd",
            "platform_fee_percent": str(metering.fee_percent(metering.platform_fee_bps())),
            "funds_required_seconds": settings.BILLING_FUNDS_REQUIRED_S,
            "low_balance_warning_seconds": settings.BILLING_LOW_BALANCE_WARNING_S,
            "zero_balance": "Running instances are stopped (disks kept, billed as storage at the node's disk price "
                            "per GB-month); stopped instances, failed ones that hold a volume and volumes are "
                            "destroyed once a destroy warning has named each and its grace period (from when it "
                            "became due: the balance at zero, or later) is over; nothing no warning named is.",
            "grace_period_seconds": settings.BILLING_GRACE_PERIOD_S,
            "interruptions": {
                "detected_after_failed_health_checks": settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS,
                "health_check_interval_seconds": settings.HEALTH_CHECK_INTERVAL_S,
                "billing_stops_at": "the last moment the node was seen healthy (or the VM seen running)",
                "credit_multiple": rule["credit_multiple"],
                "credit_max_seconds": rule["credit_max_seconds"],
                "charged_to": rule["charged_to"],
                "unreachable_destroy": "ends at once for the renter (billing stops); the VM is removed when the "
                                       "node answers again",
                "resumed": "billing starts again when the node (or the lost GPU) is back and the instance runs; a "
                           "resume that leaves the balance low (less than low_balance_warning_seconds of the burn "
                           "rate with it counted) warns at once, and running instances are not stopped at zero "
                           "before low_balance_warning_seconds after it (what runs meanwhile is owed); one such "
                           "notice per low balance, as for a raise",
            },
            "hardware_found_worse": {
                "price_cut": "from the re-check on, each instance on the node pays its price times the new score "
                             "over the last score of a check that listed the node, of the same cards (found by UUID) "
                             "where the re-check measured only some of them (a rejection without a score: "
                             "nothing, for the instances on the GPUs it names, or every one for a finding about the "
                             "whole server; a GPU missing from the server interrupts its holder instead; a benchmark "
                             "that hung, run on the free cards only, cuts no one); the renter is told at once",
                "price_back": "a later re-check that lists the node again raises a cut price back in proportion "
                              "to its score against the score before the cut, of the same cards the cut compared "
                              "and only once every card that caused the cut is measured again, up to the price "
                              "before the cut and "
                              "never above (within the tolerance of it: in full; a rejection's full cut ends when "
                              "the node passes again, measured or not); the renter is told at once. A raise that "
                              "leaves the balance low (less than low_balance_warning_seconds of the new burn rate) "
                              "warns at once, and running instances are not stopped at zero before "
                              "low_balance_warning_seconds after it (what runs meanwhile is owed); one such notice "
                              "per low balance: none after a stop at zero or a notice run out, until the balance "
                              "recovers",
                "tolerance": str(settings.HARDWARE_PRICE_CUT_TOLERANCE),
            },
        }).data)
