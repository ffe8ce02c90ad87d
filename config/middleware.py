"""Middleware of the project as a whole."""
from config.views import healthz


class HealthCheckMiddleware:
    """Answers GET /healthz before anything reads the request's Host: load balancers and container health checks
    probe the process by its IP address, which ALLOWED_HOSTS rightly does not list (and over plain HTTP)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path_info == "/healthz" and request.method in ("GET", "HEAD"):
            return healthz(request)
        return self.get_response(request)
