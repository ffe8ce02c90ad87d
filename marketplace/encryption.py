"""Secrets at rest: Fernet tokens under settings.FIELD_ENCRYPTION_KEYS.

The first key encrypts; every key decrypts, so a key is rotated by putting the
new one first and re-encrypting at leisure.
"""
from functools import lru_cache

from cryptography.fernet import Fernet, MultiFernet
from django.conf import settings


@lru_cache(maxsize=4)
def _cipher(keys: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(key.encode()) for key in keys])


def encrypt_secret(plaintext: bytes) -> bytes:
    return _cipher(tuple(settings.FIELD_ENCRYPTION_KEYS)).encrypt(plaintext)


def decrypt_secret(token: bytes) -> bytes:
    return _cipher(tuple(settings.FIELD_ENCRYPTION_KEYS)).decrypt(bytes(token))
