"""The marketplace's input rules, defined once for the API's serializers and the pages' forms: the limits of what
people type, and validators for what providers type (addresses, SSH users, host-key fingerprints).

The validators raise Django's ValidationError: a form shows its message, and DRF reports it as the field's error.
Rules that need the database or the state of something live in the services.
"""
import ipaddress
import re
from decimal import Decimal
from typing import cast

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator

# Limits of what people type (the API publishes them in its schema; the pages' forms use the same).
NAME_MAX_LENGTH = 100  # a node's, an SSH key's, an API key's name; an instance's label; a node's city, datacenter
EMAIL_MAX_LENGTH = 254  # RFC 5321's
PASSWORD_MAX_LENGTH = 128
SIGNUP_TOKEN_MAX_LENGTH = 2000
ADDRESS_MAX_LENGTH = 253  # a DNS name's
SSH_PORT_MIN, SSH_PORT_MAX = 1, 65535
SSH_USER_MAX_LENGTH = 32  # useradd's
FINGERPRINT_MAX_LENGTH = 60
MAX_GPUS_PER_NODE = 16
PRICE_LIMITS = {"min_value": Decimal("0.001"), "max_value": Decimal("100")}  # USD per GPU-hour
DISK_PRICE_LIMITS = {"min_value": Decimal("0"), "max_value": Decimal("10")}  # USD per GB-month
MAX_INSTANCE_KEYS = 32  # SSH keys put on one instance

# RFC 1123 hostname: dot-separated labels of letters, digits and inner hyphens. Matched whole (fullmatch): with
# `match`, "$" also matched before a newline, and "gpu1\n.example.com" passed.
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$", re.ASCII)
# A POSIX login name as useradd accepts it.
_SSH_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# What `ssh-keygen -lf` prints for a SHA-256 fingerprint: 32 bytes, unpadded base64.
_FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}$")
# A VM's mapped port as a node's agent names it: the renter's container port, "8888/tcp".
VM_PORT_NAME = re.compile(r"[1-9][0-9]{0,4}/tcp", re.ASCII)


def validate_address(value: str) -> None:
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if (
        len(value) > ADDRESS_MAX_LENGTH
        or not all(_HOST_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()  # "1.2.3.999" is a broken IP, not a hostname
    ):
        raise ValidationError(f"{value!r} is neither a hostname nor an IP address.")


def canonical_address(value: str) -> str:
    """A node's address as stored: an IP literal in its one spelling ("0:0:0:0:0:0:0:1", "::0.0.0.1" and "::1" are
    one address; an IPv4-mapped IPv6 address is its IPv4 one), a hostname lowercased and without its one trailing
    (root) dot, which names the same host ("gpu1.example.com." is "gpu1.example.com"). The rule of one live node per
    address and port (node_unique_own_live_endpoint, node_unique_live_endpoint) compares the stored text: before,
    another spelling of the same IP, or the same name with its root dot, registered the same server twice (found by
    review, r54)."""
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return value.removesuffix(".").lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def is_port_number(value: object) -> bool:
    """A TCP port: an int (not a bool) from 1 to 65535."""
    return isinstance(value, int) and not isinstance(value, bool) and SSH_PORT_MIN <= value <= SSH_PORT_MAX


class WholeValueValidator(RegexValidator):
    """A RegexValidator whose pattern must match the whole value: Django's searches, and its "$" also matches before
    a trailing newline ("root\n" was a valid user name where nothing stripped it). The pattern stays "^...$", as
    the API schema publishes it."""

    def __call__(self, value: object) -> None:
        pattern = cast(re.Pattern[str], self.regex)  # compiled by RegexValidator (lazily)
        if not isinstance(value, str) or pattern.fullmatch(value) is None:
            raise ValidationError(self.message, code=self.code, params={"value": value})


# RegexValidators, not functions: the API schema publishes their patterns (drf-spectacular reads them).
validate_ssh_user = WholeValueValidator(
    _SSH_USER, "Must be a POSIX user name: lower-case letters, digits, '_' or '-', starting with a letter or '_'."
)
validate_host_key_fingerprint = WholeValueValidator(
    _FINGERPRINT, "Must be a SHA-256 fingerprint as `ssh-keygen -lf` prints it: 'SHA256:' and 43 base64 characters."
)


# The nodes' agent's pattern for a libvirt image name (provisioning/agent/gpumarket_agent/validation.py,
# _LIBVIRT_IMAGE_RE): not imported from there, notifications reads this module and may import nothing of provisioning
# (.importlinter); tests/web/test_admin_images.py holds the two the same.
LIBVIRT_IMAGE_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
LIBVIRT_IMAGE_SUFFIX = ".qcow2"  # the agent appends it: <GPUMARKET_LIBVIRT_IMAGES>/<name>.qcow2 (runtimes/libvirt.py)


def validate_libvirt_image(value: str) -> None:
    """A catalogue image's name for `libvirt` nodes, as their agent takes it (validation.py, `vm create`): lower-case
    letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128, no '..'; and without the
    suffix the agent adds (ubuntu.qcow2 was looked for as ubuntu.qcow2.qcow2)."""
    if value.endswith(LIBVIRT_IMAGE_SUFFIX):
        raise ValidationError(f"Give the name without {LIBVIRT_IMAGE_SUFFIX}: the node adds it "
                              f"({value.removesuffix(LIBVIRT_IMAGE_SUFFIX)!r} is read as "
                              f"<images folder>/{value.removesuffix(LIBVIRT_IMAGE_SUFFIX)}{LIBVIRT_IMAGE_SUFFIX}).")
    if not LIBVIRT_IMAGE_RE.fullmatch(value) or ".." in value:
        raise ValidationError("A libvirt image name is 1 to 128 lower-case letters, digits, '.', '_' or '-', starting "
                              "with a letter or digit, without '..' (the nodes' agent refuses any other).")


def validate_instance_keys(keys: list) -> None:
    """At most MAX_INSTANCE_KEYS keys on one instance (a saved key or a pasted one each)."""
    if len(keys) > MAX_INSTANCE_KEYS:
        raise ValidationError(f"At most {MAX_INSTANCE_KEYS} keys.")
