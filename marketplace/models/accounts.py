"""Users (email + password), their API keys (stored hashed, shown once), and who turned an account off or on."""
from typing import Any

from django.contrib.auth.models import AbstractUser, BaseUserManager
from django.db import models
from django.utils import timezone
from django.utils.crypto import salted_hmac

from core.api.scopes import ALL_SCOPES
from core.email_address import CANONICAL_MAX_LENGTH, email_canonical
from core.errors import ValidationFailed


class UserManager(BaseUserManager):
    use_in_migrations = True

    def _create(self, email, password, **extra):
        if not email:
            raise ValueError("email is required")
        email = self.normalize_email(email).lower()
        # Lower case can be longer than what was typed ('\u0130' is two characters then): refused here rather
        # than by the database (marketplace.services.accounts.email_normalize says it to people).
        if len(email) > self.model._meta.get_field("email").max_length:
            raise ValueError("email is too long once in lower case")
        user = self.model(email=email, **extra)
        user.set_password(password)
        user.save(using=self._db)
        return user

    def get_by_natural_key(self, username):
        """The log-in's look-up (django.contrib.auth's ModelBackend): by the canonical address, so that every
        spelling that reaches the account's mailbox finds the account, and none that reaches another mailbox does."""
        try:
            canonical = email_canonical(username or "")
        except ValidationFailed:
            raise self.model.DoesNotExist() from None
        return self.get(email_canonical=canonical)

    def create_user(self, email, password=None, **extra):
        # Accounts made here (createsuperuser, the demo seed) are made by people who hold the server: verified.
        extra.setdefault("email_verified_at", timezone.now())
        extra.setdefault("is_staff", False)
        extra.setdefault("is_superuser", False)
        return self._create(email, password, **extra)

    def create_superuser(self, email, password=None, **extra):
        extra.setdefault("email_verified_at", timezone.now())
        extra["is_staff"] = True
        extra["is_superuser"] = True
        return self._create(email, password, **extra)


# django-stubs cannot type the reverse managers of django-otp's untyped Device.user (marketplace/models/two_factor.py).
class User(AbstractUser):  # type: ignore[django-manager-missing]
    """Anyone can rent and list hardware; operators are staff."""

    username = None  # type: ignore[assignment]  # no user names: the e-mail address is the login
    email = models.EmailField("email address", unique=True)
    email_verified_at = models.DateTimeField(
        null=True, blank=True, help_text="When the owner proved they hold the address (the sign-up link, a password "
                                         "reset, a verification link); empty: may not rent or list until then.")
    email_changed_at = models.DateTimeField(
        null=True, blank=True, help_text="When an operator last changed the address; empty: never. Every e-mailed link "
                                         "made before it (verification, password reset) stops working, even where "
                                         "the address is changed back.")
    email_canonical = models.CharField(
        max_length=CANONICAL_MAX_LENGTH, unique=True, editable=False,
        help_text="The mailbox the address reaches (core.email_address.email_canonical): accounts are looked up and "
                  "kept unique by it. Set from the address on every save that changes it.")
    sessions_epoch = models.PositiveIntegerField(
        default=0, help_text="Raised to end every other session of the user without a new password (turning "
                             "two-factor log-in on).")

    USERNAME_FIELD = "email"
    REQUIRED_FIELDS = []

    objects = UserManager()  # type: ignore[assignment,misc]  # ours (e-mail logins), not AbstractUser's

    class Meta:
        ordering = ["id"]
        indexes = [
            # The few deactivated accounts, read by every offers search (models.nodes.provider_active).
            models.Index(fields=["id"], condition=models.Q(is_active=False), name="user_inactive_idx"),
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The address as loaded (not read when deferred): save() sets email_canonical again when it changed.
        self._loaded_email = self.__dict__.get("email")

    def __str__(self):
        return self.email

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Keep email_canonical the address's (ValidationFailed on `email` for one no e-mail can reach). Only when
        the address changed, or none is set yet: an account that the migration found sharing its mailbox with an
        older one keeps its marker (marketplace/migrations/0042_user_email_canonical.py) until its address is
        changed."""
        if "email" in self.__dict__ and (not self.email_canonical or self.email != self._loaded_email):
            self.email_canonical = email_canonical(self.email)
            update_fields = kwargs.get("update_fields")
            if update_fields is not None and "email" in update_fields:
                kwargs["update_fields"] = {*update_fields, "email_canonical"}
        super().save(*args, **kwargs)
        self._loaded_email = self.__dict__.get("email")

    def _get_session_auth_hash(self, secret=None):
        """Django's session hash (an HMAC of the password's hash), with the epoch in it once raised: a session
        checks it on every request, so raising the epoch ends the sessions that were not updated. Epoch 0 hashes
        as Django does, so the sessions open before the epoch existed stay valid."""
        if not self.sessions_epoch:
            return super()._get_session_auth_hash(secret=secret)
        key_salt = "marketplace.models.accounts.User.get_session_auth_hash"
        return salted_hmac(key_salt, f"{self.password}\n{self.sessions_epoch}", secret=secret,
                           algorithm="sha256").hexdigest()

    def end_other_sessions(self) -> None:
        """Every session of this user fails its hash check from now on; the caller re-hashes its own session
        (django.contrib.auth.update_session_auth_hash) to keep it."""
        User.objects.filter(pk=self.pk).update(sessions_epoch=models.F("sessions_epoch") + 1)
        self.refresh_from_db(fields=["sessions_epoch"])


class AccountStatusChange(models.Model):
    """An operator deactivated or reactivated an account (marketplace.services.account_status): who, when, why.
    `reason` is told to the account's owner in the notice."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="status_changes")
    active = models.BooleanField(help_text="The account's state after the change: on (reactivated) or off.")
    by = models.ForeignKey(User, on_delete=models.SET_NULL, null=True, blank=True, related_name="+",
                           help_text="The operator; empty when no operator was named (a script).")
    reason = models.CharField(max_length=500, blank=True, help_text="Told to the account's owner.")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name = "account status change"

    def __str__(self):
        return f"{self.user} {'reactivated' if self.active else 'deactivated'} at {self.at:%Y-%m-%d %H:%M}"


def all_scopes() -> list[str]:
    """Keys made without naming scopes (and every key made before scopes existed) may do everything."""
    return list(ALL_SCOPES)


class ApiKeyQuerySet(models.QuerySet):
    def active(self) -> "ApiKeyQuerySet":
        """Not revoked (an expired key is still listed, marked expired, until its owner revokes it)."""
        return self.filter(revoked_at__isnull=True)


class ApiKey(models.Model):
    """A bearer token. Only its SHA-256 digest is stored; `prefix` lets people tell keys apart."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, help_text="First characters of the key, for display.")
    key_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the whole key.")
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    scopes = models.JSONField(default=all_scopes, help_text="What the key may do: read, renter, provider "
                                                            "(core/api/scopes.py).")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Refused (401) from then on; empty: never.")

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "API key"

    def __str__(self):
        return f"{self.prefix}… ({self.user})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()
