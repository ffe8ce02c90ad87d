"""Two-factor devices whose secrets are encrypted at rest (marketplace/encryption.py).

django-otp's own TOTPDevice keeps the TOTP secret in hex and its StaticToken keeps recovery codes as typed, both
readable by anyone who reads the database. These are django-otp devices (Device, ThrottlingMixin: the same
per-device delay after a wrong code, `django_otp.login` works with them) that keep only Fernet tokens; the TOTP
arithmetic is django_otp.oath.TOTP's.
"""
import hmac
import os
import time
from base64 import b32encode
from urllib.parse import quote, urlencode

from django.conf import settings
from django.db import models
from django.utils import timezone
from django_otp.models import Device, ThrottlingMixin
from django_otp.oath import TOTP

from marketplace.encryption import decrypt_secret, encrypt_secret

TOTP_KEY_BYTES = 20  # 160 bits, RFC 4226's recommended length, as django-otp's default


class AuthenticatorDevice(ThrottlingMixin, Device):
    """A TOTP authenticator app. `key_encrypted`: the secret (raw bytes) as a Fernet token."""

    key_encrypted = models.BinaryField()
    step = models.PositiveSmallIntegerField(default=30)
    t0 = models.BigIntegerField(default=0)
    digits = models.PositiveSmallIntegerField(default=6)
    tolerance = models.PositiveSmallIntegerField(default=1)
    drift = models.SmallIntegerField(default=0)
    last_t = models.BigIntegerField(default=-1, help_text="The time step of the last code accepted: a code works "
                                                         "once.")
    created_at = models.DateTimeField(default=timezone.now, help_text="When the secret was made: an unconfirmed one "
                                                                      "can be confirmed for 15 minutes.")

    class Meta(Device.Meta):
        verbose_name = "authenticator app"

    @classmethod
    def new(cls, *, user, name: str) -> "AuthenticatorDevice":
        return cls.objects.create(user=user, name=name, confirmed=False,
                                  key_encrypted=encrypt_secret(os.urandom(TOTP_KEY_BYTES)))

    @property
    def bin_key(self) -> bytes:
        return decrypt_secret(bytes(self.key_encrypted))

    def get_throttle_factor(self) -> int:
        return int(getattr(settings, "OTP_TOTP_THROTTLE_FACTOR", 1))

    def verify_token(self, token) -> bool:
        allowed, _ = self.verify_is_allowed()
        if not allowed:
            return False
        try:
            number = int(token)
        except (TypeError, ValueError):
            verified = False
        else:
            totp = TOTP(self.bin_key, self.step, self.t0, self.digits, self.drift)
            totp.time = time.time()
            verified = bool(totp.verify(number, self.tolerance, self.last_t + 1))
            if verified:
                self.last_t = totp.t()
                self.drift = totp.drift
                self.throttle_reset(commit=False)
                self.save()
        if not verified:
            self.throttle_increment(commit=True)
        return verified

    @property
    def config_url(self) -> str:
        """The otpauth:// URI authenticator apps read (Google's Key Uri Format)."""
        issuer = str(getattr(settings, "OTP_TOTP_ISSUER", "") or "").replace(":", "")
        label = f"{issuer}:{self.user.get_username()}" if issuer else str(self.user.get_username())
        params = {"secret": b32encode(self.bin_key).decode("ascii").rstrip("="), "algorithm": "SHA1",
                  "digits": self.digits, "period": self.step}
        query = urlencode(params) + (f"&issuer={quote(issuer)}" if issuer else "")
        return f"otpauth://totp/{quote(label)}?{query}"


class RecoveryCodeDevice(ThrottlingMixin, Device):
    """The user's one-time recovery codes (RecoveryCode rows)."""

    class Meta(Device.Meta):
        verbose_name = "recovery codes"

    def get_throttle_factor(self) -> int:
        return int(getattr(settings, "OTP_STATIC_THROTTLE_FACTOR", 1))

    def verify_token(self, token) -> bool:
        """A right code is used up (deleted). Each stored code is decrypted and compared in constant time: there
        are at most a dozen, and nothing of a code is kept in a form a lookup could use."""
        allowed, _ = self.verify_is_allowed()
        if not allowed:
            return False
        given = str(token or "").encode()
        match = None
        for code in self.codes.all():
            if hmac.compare_digest(decrypt_secret(code.code_encrypted), given):
                match = code
        if match is None:
            self.throttle_increment(commit=True)
            return False
        match.delete()
        self.throttle_reset(commit=True)
        return True


class RecoveryCode(models.Model):
    device = models.ForeignKey(RecoveryCodeDevice, on_delete=models.CASCADE, related_name="codes")
    code_encrypted = models.BinaryField()

    def __str__(self):
        return f"a recovery code of {self.device}"  # never the code

    @classmethod
    def make(cls, *, device: RecoveryCodeDevice, code: str) -> "RecoveryCode":
        return cls(device=device, code_encrypted=encrypt_secret(code.encode()))
