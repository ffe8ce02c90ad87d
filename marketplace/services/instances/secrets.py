"""The renter's secrets on an instance, at rest: its env values and registry login are Fernet tokens
(marketplace.encryption), decrypted only for the node's `vm create` request; the API and the pages show the env's
names alone."""
import json

from marketplace.encryption import decrypt_secret, encrypt_secret
from marketplace.models import Instance

# What the API and the Vast-compatible API show in place of every env value.
ENV_VALUE_MASK = "********"


def env_encrypt(env: dict[str, str]) -> bytes | None:
    """A Fernet token of the env as JSON, or None for no env (nothing to keep)."""
    return encrypt_secret(json.dumps(env).encode()) if env else None


def instance_env(*, instance: Instance) -> dict[str, str]:
    """The env given at booking, decrypted for the node (in memory only); {} when none or once forgotten."""
    if not instance.env_encrypted:
        return {}
    env: dict[str, str] = json.loads(decrypt_secret(bytes(instance.env_encrypted)))
    return env


def env_masked(instance: Instance) -> dict[str, str]:
    """The env as the renter may see it after booking: its names, every value masked."""
    return {name: ENV_VALUE_MASK for name in instance.env_names}


def instance_registry_auth(*, instance: Instance) -> dict[str, str] | None:
    """The registry login given at booking, decrypted for the node's pull (in memory only), or None."""
    if not instance.registry_auth_encrypted:
        return None
    auth: dict[str, str] = json.loads(decrypt_secret(bytes(instance.registry_auth_encrypted)))
    return auth


def instance_forget_secrets(instance: Instance) -> list[str]:
    """A failed or destroyed instance pulls and creates nothing again: its registry password and env values go
    (the flag and the env's names stay). Returns the fields to save."""
    instance.registry_auth_encrypted = None
    instance.env_encrypted = None
    return ["registry_auth_encrypted", "env_encrypted"]
