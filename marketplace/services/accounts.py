"""Use cases for accounts and API keys."""
import hashlib
import secrets
from datetime import timedelta

from django.contrib.auth import authenticate
from django.db import transaction
from django.utils import timezone

from marketplace.models import ApiKey, User

API_KEY_PREFIX = "gpm_"
# Writing last_used_at on every request would turn each read into a write.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class InvalidCredentials(Exception):
    pass


class EmailTaken(Exception):
    pass


def hash_api_key(raw_key: str) -> str:
    # Keys are 256 bits of randomness, so a fast unsalted hash is enough (no dictionary to attack).
    return hashlib.sha256(raw_key.encode()).hexdigest()


def api_key_create(*, user: User, name: str = "") -> tuple[ApiKey, str]:
    """Create a key and return it with the raw value, which is never stored or shown again."""
    raw = API_KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(user=user, name=name, prefix=raw[:12], key_hash=hash_api_key(raw))
    return key, raw


def api_key_revoke(*, api_key: ApiKey) -> None:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])


def api_key_authenticate(*, raw_key: str) -> ApiKey | None:
    """The active key with this value (and its user), or None."""
    key = (
        ApiKey.objects.active()
        .select_related("user")
        .filter(key_hash=hash_api_key(raw_key), user__is_active=True)
        .first()
    )
    if key is None:
        return None
    now = timezone.now()
    if key.last_used_at is None or now - key.last_used_at >= LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key


@transaction.atomic
def user_register(*, email: str, password: str) -> tuple[User, str]:
    """Create an account and its first API key. The password is already validated."""
    email = User.objects.normalize_email(email).lower()
    if User.objects.filter(email__iexact=email).exists():
        raise EmailTaken(email)
    user = User.objects.create_user(email=email, password=password)
    _, raw = api_key_create(user=user, name="created at sign-up")
    return user, raw


def user_login(*, email: str, password: str, key_name: str = "") -> tuple[User, str]:
    """Check the password and issue a new API key."""
    user = authenticate(email=email.lower(), password=password)
    if user is None:
        raise InvalidCredentials()
    _, raw = api_key_create(user=user, name=key_name or "created at login")
    return user, raw
