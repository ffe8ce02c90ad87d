"""Validators for what providers type: addresses, SSH users, host-key fingerprints."""
import ipaddress
import re

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator

# RFC 1123 hostname: dot-separated labels of letters, digits and inner hyphens.
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
# A POSIX login name as useradd accepts it.
_SSH_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# What `ssh-keygen -lf` prints for a SHA-256 fingerprint: 32 bytes, unpadded base64.
_FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}$")


def validate_address(value: str) -> None:
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if (
        len(value) > 253
        or not all(_HOST_LABEL.match(label) for label in labels)
        or labels[-1].isdigit()  # "1.2.3.999" is a broken IP, not a hostname
    ):
        raise ValidationError(f"{value!r} is neither a hostname nor an IP address.")


# RegexValidators, not functions: the API schema publishes their patterns (drf-spectacular reads them).
validate_ssh_user = RegexValidator(
    _SSH_USER, "Must be a POSIX user name: lower-case letters, digits, '_' or '-', starting with a letter or '_'."
)
validate_host_key_fingerprint = RegexValidator(
    _FINGERPRINT, "Must be a SHA-256 fingerprint as `ssh-keygen -lf` prints it: 'SHA256:' and 43 base64 characters."
)
