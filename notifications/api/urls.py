from django.urls import path
from rest_framework.routers import DefaultRouter

from . import views


class Router(DefaultRouter):
    """Any path segment reaches the view as the lookup value (so `/notifications/x/` is the API's JSON 404)."""

    include_format_suffixes = False
    include_root_view = False

    def get_lookup_regex(self, viewset, lookup_prefix=""):
        return f"(?P<{lookup_prefix}pk>[^/]+)"


router = Router(trailing_slash=True)
router.register("notifications", views.NotificationViewSet, basename="notification")
router.register("webhook-endpoints", views.WebhookEndpointViewSet, basename="webhook-endpoint")
router.register("webhook-deliveries", views.WebhookDeliveryViewSet, basename="webhook-delivery")

urlpatterns = [
    path("notification-preferences/", views.PreferenceListView.as_view(), name="notification-preferences"),
    path("notification-preferences/<str:kind>/", views.PreferenceDetailView.as_view(),
         name="notification-preference"),
    *router.urls,
]
