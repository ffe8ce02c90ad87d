from django.urls import path

from billing.api.cards import CardViewSet
from billing.api.providers import EarningsView, PayoutViewSet
from billing.api.statements import StatementDetailView, StatementListView
from billing.api.terms import TermsView
from billing.api.top_ups import RefundView, TopUpViewSet
from billing.api.wallet import BalanceView, BillingEventViewSet, ProfileView, UsageViewSet
from billing.api.webhooks import StripeWebhookView
from marketplace.api.urls import ApiRouter

router = ApiRouter(trailing_slash=True)
router.include_root_view = False
router.register("usage", UsageViewSet, basename="billing-usage")
router.register("cards", CardViewSet, basename="billing-card")
router.register("top-ups", TopUpViewSet, basename="billing-top-up")
router.register("events", BillingEventViewSet, basename="billing-event")
router.register("payouts", PayoutViewSet, basename="billing-payout")

urlpatterns = [
    path("balance/", BalanceView.as_view(), name="billing-balance"),
    path("terms/", TermsView.as_view(), name="billing-terms"),
    path("stripe/webhook/", StripeWebhookView.as_view(), name="billing-stripe-webhook"),
    path("statements/", StatementListView.as_view(), name="billing-statements"),
    path("statements/<str:month>/", StatementDetailView.as_view(), name="billing-statement"),
    path("earnings/", EarningsView.as_view(), name="billing-earnings"),
    path("profile/", ProfileView.as_view(), name="billing-profile"),
    path("refunds/", RefundView.as_view(), name="billing-refunds"),
    *router.urls,
]
