from django.contrib import admin
from django.urls import include, path

from config.views import ApiDocsView, SchemaView, healthz
from operations import metrics as platform_metrics

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    # Prometheus: a staff session or METRICS_TOKEN; 404 to anyone else (core/metrics.py, docs/SCALING.md).
    path("metrics", platform_metrics.metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/v1/billing/", include("billing.urls")),
    path("api/v1/", include("marketplace.api.urls")),
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("api/v1/", include("notifications.api.urls")),
    path("api/docs/", ApiDocsView.as_view(url_name="schema"), name="api-docs"),
    path("compat/vast/", include("compat.vast.urls")),  # the `vastai` CLI's API (docs/vast-cli.md), unpublished
    path("account/notifications/", include("notifications.web.urls")),
    path("", include("marketplace.web.urls")),
]

# Under /api/ every error is JSON (config/views.py); elsewhere Django's pages.
handler400 = "config.views.bad_request"
handler403 = "config.views.permission_denied"
handler404 = "config.views.not_found"
handler500 = "config.views.server_error"
