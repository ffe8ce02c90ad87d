"""Production: the same settings, but refuse to start with the development defaults."""
from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import (
    DATABASES,
    DEBUG,
    DEFAULT_FIELD_ENCRYPTION_KEY,
    DEFAULT_SECRET_KEY,
    FIELD_ENCRYPTION_KEYS,
    SECRET_KEY,
)


def check_production_settings() -> None:
    """Raise ImproperlyConfigured naming every unsafe default still in force."""
    problems = []
    if DEBUG:
        problems.append("DEBUG is on; set DEBUG=false")
    if SECRET_KEY == DEFAULT_SECRET_KEY or len(SECRET_KEY) < 32:
        problems.append("SECRET_KEY is the development default or shorter than 32 characters")
    if DEFAULT_FIELD_ENCRYPTION_KEY in FIELD_ENCRYPTION_KEYS:
        problems.append("FIELD_ENCRYPTION_KEYS contains the development default key")
    if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        problems.append("DATABASE_URL is not set (SQLite is for a first run only)")
    if problems:
        raise ImproperlyConfigured("Refusing to start in production: " + "; ".join(problems))


check_production_settings()

SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_CONTENT_TYPE_NOSNIFF = True
