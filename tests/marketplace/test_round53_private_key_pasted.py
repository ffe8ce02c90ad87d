"""A pasted private key, in any format a renter may hold (PuTTY's .ppk, SSH.com's SSH2, OpenSSH, PEM), is answered as
a private key, with how to get the public key: a .ppk and an SSH2 private key were answered "Holds several lines; send
exactly one key per request", which sent people to paste again (review r53)."""
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from marketplace.models import SshKey
from marketplace.services import ssh_keys
from marketplace.services.ssh_keys import InvalidSshKey, parse_public_key

from .renting_helpers import ed25519_key

SECRET = "AAAAIFSECRETSECRETSECRETSECRETSECRETSECRETSECRET0000"

PPK_V3 = f"""PuTTY-User-Key-File-3: ssh-ed25519
Encryption: none
Comment: eddsa-key-20240101
Public-Lines: 2
AAAAC3NzaC1lZDI1NTE5AAAAIDCgjUi5tZWZ1E2u7rHq1wJ0d3BBXo9r8JmYv1y1
cI8r
Private-Lines: 1
{SECRET}
Private-MAC: 8e2b7f1c0f2f0c6f7b5d6f6a3a0d2e1b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f
"""

PPK_V2_ENCRYPTED = f"""PuTTY-User-Key-File-2: ssh-rsa
Encryption: aes256-cbc
Comment: rsa-key-20240101
Public-Lines: 1
AAAAB3NzaC1yc2EAAAADAQABAAAAgQC7
Private-Lines: 1
{SECRET}
Private-MAC: 0f2f0c6f7b5d6f6a3a0d2e1b9c8d7e6f5a4b3c2d
"""

SSH2_ENCRYPTED = f"""---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----
Comment: "2048-bit rsa, me@laptop"
P2/56wAAA+gAAAA3aWYtbW9kbntzaWdue3JzYS1wa2NzMS1zaGExfSxlbmNyeXB0e3JzYS
{SECRET}
---- END SSH2 ENCRYPTED PRIVATE KEY ----
"""


def _openssh_private() -> str:
    return ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()


def _pem_encrypted() -> str:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase")).decode()


def _openssh_body_only() -> str:
    """An OpenSSH private key's base64 without its BEGIN/END lines (copied from the middle of the file)."""
    return "\n".join(_openssh_private().splitlines()[1:-1])


PRIVATE = {
    "ppk v3": lambda: PPK_V3,
    "ppk v2 encrypted": lambda: PPK_V2_ENCRYPTED,
    "ppk from its Private-Lines on": lambda: PPK_V3[PPK_V3.index("Private-Lines"):],
    "ssh2 encrypted": lambda: SSH2_ENCRYPTED,
    "openssh": _openssh_private,
    "pem pkcs8 encrypted": _pem_encrypted,
    "openssh body only": _openssh_body_only,
}


@pytest.mark.parametrize("case", PRIVATE)
def test_a_private_key_is_named_as_such_with_the_way_to_its_public_key(case):
    text = PRIVATE[case]()
    with pytest.raises(InvalidSshKey) as caught:
        parse_public_key(text)
    message = str(caught.value)
    assert "private key" in message and "never send it" in message, message
    assert "several lines" not in message
    if case.startswith("ppk"):
        assert "PuTTYgen" in message and "Public key for pasting" in message and "public-openssh" in message
    else:
        assert "ssh-keygen -y" in message
    assert SECRET not in message and text.strip().splitlines()[-1] not in message  # never the key itself


@pytest.mark.parametrize("case", PRIVATE)
def test_forms_can_tell_a_private_key_to_wipe_it(case):
    assert ssh_keys.looks_like_private_key(PRIVATE[case]())


# Named ids: a fresh key in an id differs in each xdist worker, which then refuse the run (different collections).
@pytest.mark.parametrize("text", [ed25519_key(), ed25519_key("PuTTY key from my laptop"), "ssh-ed25519 notbase64!",
                                  "---- BEGIN SSH2 PUBLIC KEY ----"],
                         ids=["public key", "public key with PuTTY in its comment", "bad base64", "SSH2 public header"])
def test_a_public_key_or_other_mistake_is_not_taken_for_a_private_one(text):
    assert not ssh_keys.looks_like_private_key(text)


def test_a_public_key_still_parses():
    assert parse_public_key(ed25519_key("me@laptop")).comment == "me@laptop"


@pytest.mark.django_db
@pytest.mark.parametrize("case", ["ppk v3", "ssh2 encrypted"])
def test_the_api_answers_a_pasted_private_key_clearly_and_stores_nothing(api, case):
    r = api.post("/api/v1/ssh-keys/", {"name": "laptop", "public_key": PRIVATE[case]()}, format="json")
    assert r.status_code == 400
    (message,) = r.json()["public_key"]
    assert "private key" in message and "several lines" not in message
    assert SECRET not in r.content.decode()
    assert not SshKey.objects.exists()


@pytest.mark.django_db
def test_the_vast_api_answers_a_pasted_ppk_clearly(api):
    r = api.post("/compat/vast/api/v0/ssh/", {"ssh_key": PPK_V3}, format="json")
    assert r.status_code == 400
    assert "PuTTY private key" in r.content.decode() and SECRET not in r.content.decode()
    assert not SshKey.objects.exists()
