"""Renters' SSH public keys: strict parsing with paramiko, and the use cases that store them.

A key reaches a VM's authorized_keys, so anything that is not exactly one plain public key
is refused: authorized_keys options (`command="..."`, `no-pty`, ...), several keys in one
field, control characters, bad base64, a type prefix that disagrees with the key data,
certificates, DSA, security-key (FIDO) keys and RSA keys under 2048 bits. What is stored is
the normalised `<type> <base64>`; the comment only serves as the key's default name. A private key (OpenSSH, PEM,
SSH2, PuTTY's .ppk) is told apart first (PrivateKeyPasted), with how to get its public key instead.
"""
import base64
import binascii
import re
import struct
import unicodedata
from dataclasses import dataclass
from hashlib import sha256

import paramiko
from django.conf import settings
from django.db import IntegrityError, transaction

from core.errors import Conflict, ValidationFailed
from core.security_mail import security_change_notify
from core.sql import constraint_violated
from marketplace.models import SshKey, User
from marketplace.validators import MAX_INSTANCE_KEYS

# What a VM accepts: the types of `ssh-keygen -t ed25519|ecdsa|rsa`.
ACCEPTED_KEY_TYPES = (
    "ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa",
)
MIN_RSA_BITS = 2048
MAX_RSA_BITS = 16384
MAX_KEY_CHARS = 16384  # an RSA 16384 key is about 2,800 characters
MAX_SAVED_SSH_KEYS = MAX_INSTANCE_KEYS  # per account: the Vast API puts them all on an instance
_B64_RE = re.compile(r"[A-Za-z0-9+/]+={0,2}")
# Why a known but refused type is refused, in words a renter can act on.
_REFUSED_TYPES = {
    "ssh-dss": "DSA (ssh-dss) keys are not accepted: OpenSSH has retired them. Use an ed25519 key "
               "(ssh-keygen -t ed25519).",
    "sk-ssh-ed25519@openssh.com": "Security-key (FIDO) keys are not supported yet; use an ed25519 key.",
    "sk-ecdsa-sha2-nistp256@openssh.com": "Security-key (FIDO) keys are not supported yet; use an ed25519 key.",
    "rsa-sha2-256": "rsa-sha2-256 is a signature algorithm, not a key type; an RSA key starts with ssh-rsa.",
    "rsa-sha2-512": "rsa-sha2-512 is a signature algorithm, not a key type; an RSA key starts with ssh-rsa.",
}
_KNOWN_OPTIONS = {
    "agent-forwarding", "cert-authority", "command", "environment", "expiry-time", "from", "no-agent-forwarding",
    "no-port-forwarding", "no-pty", "no-user-rc", "no-x11-forwarding", "permitlisten", "permitopen",
    "port-forwarding", "principals", "pty", "no-touch-required", "verify-required", "restrict", "tunnel",
    "user-rc", "x11-forwarding",
}


class InvalidSshKey(ValidationFailed):
    """The text is not one acceptable OpenSSH public key; the message says why. Named apart because forms and
    serializers check a key with parse_public_key and show the message on their own field."""

    def __init__(self, message: str):
        super().__init__(message, field="public_key")


class PrivateKeyPasted(InvalidSshKey):
    """The text is a private key, not a public one: it says so and how to export the public key. The message never
    holds the text; a page that refused it must not show the text back either (looks_like_private_key)."""


# Where a private key shows itself, in the formats a renter may paste: PEM and OpenSSH ("-----BEGIN OPENSSH PRIVATE
# KEY-----", "RSA PRIVATE KEY", "ENCRYPTED PRIVATE KEY", ...) and SSH.com's ("---- BEGIN SSH2 ENCRYPTED PRIVATE KEY
# ----") all say PRIVATE KEY; PuTTY's .ppk says it in its header lines; an OpenSSH private key's body without its
# armour starts with the base64 of "openssh-key-v1".
_PUTTY_PRIVATE_RE = re.compile(r"^\s*(PuTTY-User-Key-File-[0-9]+:|Private-(Lines|MAC|Hash):)", re.MULTILINE)
_OPENSSH_PRIVATE_BODY = "b3BlbnNzaC1rZXktdjE"


def _private_key_kind(text: str) -> str | None:
    """'putty' for a PuTTY private key, 'other' for another private key, None when it does not look like one."""
    if _PUTTY_PRIVATE_RE.search(text):
        return "putty"
    if "PRIVATE KEY" in text or _OPENSSH_PRIVATE_BODY in text:
        return "other"
    return None


def looks_like_private_key(text: str) -> bool:
    """Does the pasted text look like a private key (any format parse_public_key tells apart)? A form that refused
    it wipes it rather than show it back."""
    return isinstance(text, str) and _private_key_kind(text) is not None


def _refuse_private_key(text: str) -> None:
    kind = _private_key_kind(text)
    if kind == "putty":
        # PuTTY is the usual tool on Windows; its .ppk holds the public half too, but only PuTTYgen exports it.
        raise PrivateKeyPasted(
            "This is a PuTTY private key (a .ppk file): never send it to anyone; it was not saved. Send its public "
            "key instead: load the .ppk in PuTTYgen and copy the box \"Public key for pasting into OpenSSH "
            "authorized_keys file\", or run `puttygen key.ppk -O public-openssh`. If you sent the private key "
            "anywhere else, make a new key pair.")
    if kind is not None:
        raise PrivateKeyPasted(
            "This is a private key: never send it to anyone; it was not saved. Send the public key instead: the "
            "contents of the .pub file next to it (e.g. ~/.ssh/id_ed25519.pub), or print it with "
            "`ssh-keygen -y -f <private key file>`. If you sent the private key anywhere else, make a new key pair.")


class SshKeyExists(Conflict):
    """The user saved this key already (a Conflict: the other is MAX_SAVED_SSH_KEYS reached)."""


@dataclass(frozen=True)
class ParsedKey:
    key_type: str
    public_key: str  # "<type> <base64>", normalised
    fingerprint: str  # "SHA256:..." as `ssh-keygen -lf` prints it
    comment: str
    bits: int


def _looks_like_options(token: str) -> bool:
    name = token.split("=", 1)[0].split(",", 1)[0].lower()
    return "=" in token or "," in token or '"' in token or name in _KNOWN_OPTIONS


def _blob_type(blob: bytes) -> str | None:
    """The type name the key data starts with (an SSH string), or None when it has none."""
    if len(blob) < 4:
        return None
    (n,) = struct.unpack(">I", blob[:4])
    if not 0 < n <= 64 or len(blob) < 4 + n:
        return None
    try:
        return blob[4:4 + n].decode("ascii")
    except UnicodeDecodeError:
        return None


def parse_public_key(text: str) -> ParsedKey:
    """Parse one OpenSSH public key line ("<type> <base64> [comment]"). Raises InvalidSshKey."""
    if not isinstance(text, str):
        raise InvalidSshKey("Must be a string holding one OpenSSH public key.")
    value = text.strip()  # a trailing newline from `cat key.pub` is harmless
    if not value:
        raise InvalidSshKey("Paste one public key, e.g. the contents of ~/.ssh/id_ed25519.pub.")
    _refuse_private_key(value)  # first: a .ppk or SSH2 private key was answered "Holds several lines"
    if value.startswith("---- BEGIN SSH2 PUBLIC KEY"):
        raise InvalidSshKey("This is an RFC 4716 (PuTTY) key; convert it with `ssh-keygen -i -f key.pub` first.")
    if value.startswith("-----BEGIN"):
        raise InvalidSshKey("This looks like a private key or a PEM file: never share a private key. "
                            "Send the public key, the contents of the .pub file.")
    if len(value) > MAX_KEY_CHARS:
        raise InvalidSshKey(f"Too long for a public key (at most {MAX_KEY_CHARS} characters).")
    if "\n" in value or "\r" in value:
        raise InvalidSshKey("Holds several lines; send exactly one key per request.")
    if any(unicodedata.category(ch).startswith("C") for ch in value):
        raise InvalidSshKey("Control or invisible characters are not allowed; paste the key as one plain line.")
    tokens = value.split()
    key_type = tokens[0]
    if key_type not in ACCEPTED_KEY_TYPES:
        if key_type in _REFUSED_TYPES:
            raise InvalidSshKey(_REFUSED_TYPES[key_type])
        if key_type.endswith("-cert-v01@openssh.com"):
            raise InvalidSshKey("Certificates are not accepted; send the plain public key.")
        if _looks_like_options(key_type) or any(t in ACCEPTED_KEY_TYPES for t in tokens[1:]):
            raise InvalidSshKey("authorized_keys options (such as command=, from=, no-pty) are not allowed; "
                                "send only '<type> <key> [comment]'.")
        raise InvalidSshKey(f"Unknown key type; accepted: {', '.join(ACCEPTED_KEY_TYPES)}.")
    if len(tokens) < 2:
        raise InvalidSshKey("The key data (base64) after the type is missing.")
    body, comment_words = tokens[1], tokens[2:]
    if any(w in ACCEPTED_KEY_TYPES or w in _REFUSED_TYPES or w.startswith("AAAA") for w in comment_words):
        raise InvalidSshKey("Holds more than one key; send exactly one key per request.")
    if not _B64_RE.fullmatch(body) or len(body) % 4:
        raise InvalidSshKey("The key data is not valid base64.")
    try:
        blob = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidSshKey("The key data is not valid base64.") from None
    inner = _blob_type(blob)
    if inner != key_type:
        shown = f" holds a {inner} key" if inner else " is not an SSH public key"
        raise InvalidSshKey(f"The type prefix says {key_type} but the key data{shown}.")
    try:
        key = paramiko.PKey.from_type_string(key_type, blob)
        canonical = bytes(key)
    except Exception:  # noqa: BLE001 - paramiko, cryptography and nacl raise many kinds on bad data
        raise InvalidSshKey(f"The key data is not a valid {key_type} key.") from None
    if canonical != blob:
        raise InvalidSshKey(f"The key data is not a valid {key_type} key (extra or malformed bytes).")
    bits = key.get_bits()
    if key_type == "ssh-rsa" and not MIN_RSA_BITS <= bits <= MAX_RSA_BITS:
        raise InvalidSshKey(f"RSA keys must have {MIN_RSA_BITS} to {MAX_RSA_BITS} bits; this one has {bits}. "
                            "Use an ed25519 key (ssh-keygen -t ed25519).")
    digest = base64.b64encode(sha256(blob).digest()).decode().rstrip("=")
    return ParsedKey(
        key_type=key_type,
        public_key=f"{key_type} {base64.b64encode(blob).decode()}",
        fingerprint=f"SHA256:{digest}",
        comment=" ".join(comment_words),
        bits=bits,
    )


def ssh_key_create(*, user: User, public_key: str, name: str = "") -> SshKey:
    """Store a key for `user`, and tell the account's address: a saved key goes on the instances its owner rents
    later (every saved key, through the Vast-compatible API), so one added by whoever holds a session (a copied
    cookie) must not go unseen. Raises InvalidSshKey (400) or Conflict (409: the same key twice, or
    MAX_SAVED_SSH_KEYS saved already)."""
    parsed = parse_public_key(public_key)
    key = SshKey(user=user, name=(name or parsed.comment)[:100], public_key=parsed.public_key,
                 fingerprint=parsed.fingerprint)
    try:
        with transaction.atomic():
            # The user's row locked: two keys added at once cannot both pass the count.
            User.objects.select_for_update().filter(pk=user.pk).exists()
            if SshKey.objects.filter(user=user).count() >= MAX_SAVED_SSH_KEYS:
                raise Conflict(f"You have {MAX_SAVED_SSH_KEYS} saved SSH keys, the most an account keeps (the Vast "
                               "API puts every saved key on an instance, and one instance takes at most "
                               f"{MAX_INSTANCE_KEYS}); delete one you no longer use first.")
            key.save()
            security_change_notify(
                user=user, subject="An SSH key was added to your account",
                change=(f"An SSH key was just added to your {settings.PLATFORM_NAME} account: "
                        f"{key.name or 'no name'} ({key.fingerprint}). Saved keys are put on the instances you "
                        "rent with them; delete it on the SSH keys page if you do not know it."))
    except IntegrityError as exc:
        if constraint_violated(exc) != "sshkey_unique_per_user":  # by name, never in the text (core.sql)
            raise
        existing = SshKey.objects.filter(user=user, fingerprint=parsed.fingerprint).first()
        label = f" as '{existing.name}' (id {existing.pk})" if existing and existing.name else (
            f" (id {existing.pk})" if existing else "")
        raise SshKeyExists(f"You already added this key{label}; fingerprint {parsed.fingerprint}.") from None
    return key


def ssh_key_delete(*, ssh_key: SshKey) -> None:
    """Forget a key. Instances created with it keep it: their keys were copied at creation."""
    ssh_key.delete()
