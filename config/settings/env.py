"""Typed readers of environment variables, each naming the variable in its error."""
import ipaddress
import os
from decimal import Decimal, InvalidOperation

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, not {raw!r}")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, not {raw!r}") from None


def env_decimal(name: str, default: Decimal) -> Decimal:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return Decimal(raw)
    except InvalidOperation:
        raise ImproperlyConfigured(f"{name} must be a decimal number, not {raw!r}") from None


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_networks(name: str, default: list[str]) -> list[str]:
    """A comma-separated list of IP addresses or CIDR networks."""
    values = env_list(name, default)
    for value in values:
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise ImproperlyConfigured(f"{name}: {value!r} is not an IP address or CIDR network") from None
    return values
