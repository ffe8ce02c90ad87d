from django.urls import path
from rest_framework.routers import DefaultRouter

from . import accounts, catalogue, nodes, offers

router = DefaultRouter(trailing_slash=True)
router.register("api-keys", accounts.ApiKeyViewSet, basename="api-key")
router.register("gpu-models", catalogue.GpuModelViewSet, basename="gpu-model")
router.register("nodes", nodes.NodeViewSet, basename="node")
router.register("offers", offers.OfferViewSet, basename="offer")

urlpatterns = [
    path("auth/register/", accounts.RegisterView.as_view(), name="auth-register"),
    path("auth/login/", accounts.LoginView.as_view(), name="auth-login"),
    path("auth/me/", accounts.MeView.as_view(), name="auth-me"),
    *router.urls,
]
