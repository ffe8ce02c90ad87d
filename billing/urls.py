from django.urls import path

from marketplace.api.urls import ApiRouter

from . import api

router = ApiRouter(trailing_slash=True)
router.include_root_view = False
router.register("usage", api.UsageViewSet, basename="billing-usage")
router.register("cards", api.CardViewSet, basename="billing-card")
router.register("top-ups", api.TopUpViewSet, basename="billing-top-up")
router.register("events", api.BillingEventViewSet, basename="billing-event")
router.register("payouts", api.PayoutViewSet, basename="billing-payout")

urlpatterns = [
    path("balance/", api.BalanceView.as_view(), name="billing-balance"),
    path("stripe/webhook/", api.StripeWebhookView.as_view(), name="billing-stripe-webhook"),
    path("statements/", api.StatementListView.as_view(), name="billing-statements"),
    path("statements/<str:month>/", api.StatementDetailView.as_view(), name="billing-statement"),
    path("earnings/", api.EarningsView.as_view(), name="billing-earnings"),
    path("profile/", api.ProfileView.as_view(), name="billing-profile"),
    path("refunds/", api.RefundView.as_view(), name="billing-refunds"),
    *router.urls,
]
