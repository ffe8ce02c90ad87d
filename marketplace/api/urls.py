from django.urls import path
from rest_framework import permissions
from rest_framework.routers import APIRootView, DefaultRouter

from core.api.scopes import PUBLIC
from provisioning import api as provisioning_api

from . import accounts, catalogue, images, instances, nodes, offers, ssh_keys, volumes


class ApiRootView(APIRootView):
    """GET /api/v1/: links to the resources; public (it declared PUBLIC but kept DRF's IsAuthenticated: a 401)."""

    api_scope = PUBLIC
    permission_classes = [permissions.AllowAny]


class ApiRouter(DefaultRouter):
    """DRF's router, but any path segment reaches the view as the lookup value.

    DRF's default lookup pattern excludes dots, so `/nodes/1.5/` matched no URL and
    got Django's HTML 404 page; now the view answers with the API's JSON 404.
    """

    include_format_suffixes = False  # `.json` suffixes are not part of this API
    APIRootView = ApiRootView

    def get_lookup_regex(self, viewset, lookup_prefix=""):
        kwarg = getattr(viewset, "lookup_url_kwarg", None) or getattr(viewset, "lookup_field", "pk")
        value = getattr(viewset, "lookup_value_regex", "[^/]+")
        return f"(?P<{lookup_prefix}{kwarg}>{value})"


router = ApiRouter(trailing_slash=True)
router.register("api-keys", accounts.ApiKeyViewSet, basename="api-key")
router.register("gpu-models", catalogue.GpuModelViewSet, basename="gpu-model")
router.register("nodes", nodes.NodeViewSet, basename="node")
router.register("offers", offers.OfferViewSet, basename="offer")
router.register("ssh-keys", ssh_keys.SshKeyViewSet, basename="ssh-key")
router.register("images", images.ImageViewSet, basename="image")
router.register("instances", instances.InstanceViewSet, basename="instance")
router.register("volumes", volumes.VolumeViewSet, basename="volume")

urlpatterns = [
    path("auth/register/", accounts.RegisterView.as_view(), name="auth-register"),
    path("auth/confirm/", accounts.ConfirmView.as_view(), name="auth-confirm"),
    path("auth/login/", accounts.LoginView.as_view(), name="auth-login"),
    path("auth/me/", accounts.MeView.as_view(), name="auth-me"),
    path("auth/verify-email/", accounts.VerifyEmailView.as_view(), name="auth-verify-email"),
    path("nodes/<str:id>/benchmarks/", provisioning_api.NodeBenchmarksView.as_view(), name="node-benchmarks"),
    path("nodes/<str:id>/events/", provisioning_api.NodeEventsView.as_view(), name="node-events"),
    *router.urls,
]
