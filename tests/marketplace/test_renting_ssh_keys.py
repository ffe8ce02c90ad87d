"""SSH keys: strict parsing with paramiko, the fingerprint ssh-keygen prints, ownership."""
import base64
import shutil
import struct
import subprocess

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from marketplace.models import SshKey
from marketplace.services.ssh_keys import InvalidSshKey, parse_public_key
from tests.factories import UserFactory

from .renting_helpers import ecdsa_key, ed25519_key, rsa_key, sent_jobs_fixture, snapshot  # noqa: F401

pytestmark = pytest.mark.django_db

URL = "/api/v1/ssh-keys/"


def _ssh_string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _blob(line: str) -> bytes:
    return base64.b64decode(line.split()[1])


def _line(key_type: str, blob: bytes) -> str:
    return f"{key_type} {base64.b64encode(blob).decode()}"


GOOD = {
    "ed25519": lambda: ed25519_key("me@laptop"),
    "ecdsa-256": lambda: ecdsa_key(ec.SECP256R1, "me@laptop"),
    "ecdsa-384": lambda: ecdsa_key(ec.SECP384R1),
    "ecdsa-521": lambda: ecdsa_key(ec.SECP521R1),
    "rsa-2048": lambda: rsa_key(2048) + " me@laptop",
    "rsa-3072": lambda: rsa_key(3072),
}


@pytest.mark.parametrize("kind", GOOD)
def test_accepts_each_key_type_and_shows_the_ssh_keygen_fingerprint(api, kind, tmp_path):
    text = GOOD[kind]()
    r = api.post(URL, {"public_key": text + "\n"}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    key_type, b64 = text.split()[:2]
    assert body["public_key"] == f"{key_type} {b64}"  # normalised: no comment
    assert body["key_type"] == key_type
    assert body["name"] == (text.split(" ", 2)[2] if text.count(" ") >= 2 else "")
    assert body["fingerprint"].startswith("SHA256:")
    if shutil.which("ssh-keygen"):
        path = tmp_path / "k.pub"
        path.write_text(text + "\n")
        out = subprocess.run(["ssh-keygen", "-lf", str(path)], capture_output=True, text=True, check=True).stdout
        assert out.split()[1] == body["fingerprint"]
    assert SshKey.objects.get(pk=body["id"]).public_key == body["public_key"]


def test_explicit_name_wins_over_comment(api):
    r = api.post(URL, {"public_key": ed25519_key("comment"), "name": "work laptop"}, format="json")
    assert r.status_code == 201 and r.json()["name"] == "work laptop"


def test_duplicate_key_for_the_same_user_is_409_and_another_user_may_add_it(api, other_api):
    text = ed25519_key("first")
    assert api.post(URL, {"public_key": text}, format="json").status_code == 201
    again = text.rsplit(" ", 1)[0] + " another-comment"
    r = api.post(URL, {"public_key": again}, format="json")
    assert r.status_code == 409
    assert "already added this key" in r.json()["detail"]
    assert SshKey.objects.count() == 1
    assert other_api.post(URL, {"public_key": text}, format="json").status_code == 201


def _bad_keys() -> dict[str, str]:
    ed = ed25519_key()
    ed_type, ed_b64 = ed.split()
    ed_blob = base64.b64decode(ed_b64)
    dss_blob = b"".join(_ssh_string(x) for x in (b"ssh-dss", b"\x00" + b"\x11" * 128, b"\x22" * 20,
                                                 b"\x33" * 128, b"\x44" * 128))
    ecdsa256 = _blob(ecdsa_key(ec.SECP256R1))
    # An nistp256 header around a nistp384 point: the curve inside disagrees with the type.
    p384_point = _blob(ecdsa_key(ec.SECP384R1))
    p384_point = p384_point[-(97 + 4):]  # the last SSH string: the point
    wrong_curve = _ssh_string(b"ecdsa-sha2-nistp256") + _ssh_string(b"nistp256") + p384_point
    return {
        "dss": _line("ssh-dss", dss_blob),
        "rsa-1024": rsa_key(1024),
        "option command": f'command="/bin/sh" {ed}',
        "option no-pty": f"no-pty {ed}",
        "options restrict,from": f'restrict,from="10.0.0.1" {ed}',
        "two keys one line": f"{ed} {ed25519_key()}",
        "two keys two lines": f"{ed}\n{ed25519_key()}",
        "control character": f"{ed_type}\t{ed_b64}",
        "bell in comment": f"{ed} me\x07",
        "zero-width space": f"{ed_type} {ed_b64}\u200b",
        "bad base64": f"{ed_type} {ed_b64[:-3]}!!=",
        "base64 bad padding": f"{ed_type} {ed_b64[:-1]}",
        "prefix disagrees with blob": _line("ssh-rsa", ed_blob),
        "ecdsa prefix on ed25519 blob": _line("ecdsa-sha2-nistp384", ed_blob),
        "ecdsa curve mismatch": _line("ecdsa-sha2-nistp256", wrong_curve),
        "truncated blob": _line(ed_type, ed_blob[:-5]),
        "trailing bytes": _line(ed_type, ed_blob + b"\x00\x00\x00\x01x"),
        "ecdsa point off the curve": _line("ecdsa-sha2-nistp256", ecdsa256[:-1] + bytes([ecdsa256[-1] ^ 1])),
        "certificate": _line("ssh-ed25519-cert-v01@openssh.com", _ssh_string(b"ssh-ed25519-cert-v01@openssh.com")),
        "security key": _line("sk-ssh-ed25519@openssh.com", _ssh_string(b"sk-ssh-ed25519@openssh.com") + b"x" * 40),
        "unknown type": f"ssh-foo {ed_b64}",
        "type only": "ssh-ed25519",
        "private key": "-----BEGIN OPENSSH PRIVATE KEY-----",
        "rfc4716": "---- BEGIN SSH2 PUBLIC KEY ----",
        "blank": "   ",
    }


BAD = _bad_keys()


@pytest.mark.parametrize("case", BAD)
def test_bad_keys_are_400_naming_the_field_and_store_nothing(api, case):
    before = snapshot()
    r = api.post(URL, {"public_key": BAD[case]}, format="json")
    assert r.status_code == 400, (case, r.content)
    assert r.json()["public_key"], r.json()
    assert snapshot() == before


@pytest.mark.parametrize("case", BAD)
def test_parser_refuses_bad_keys(case):
    with pytest.raises(InvalidSshKey):
        parse_public_key(BAD[case])


@pytest.mark.parametrize(("case", "words"), [
    ("dss", "DSA"), ("rsa-1024", "2048"), ("option command", "options"), ("option no-pty", "options"),
    ("two keys one line", "more than one key"), ("two keys two lines", "several lines"),
    ("prefix disagrees with blob", "ssh-ed25519"), ("bad base64", "base64"), ("control character", "Control"),
    ("private key", "private key"), ("certificate", "Certificates"),
])
def test_refusals_say_why(case, words):
    with pytest.raises(InvalidSshKey, match=words):
        parse_public_key(BAD[case])


def test_list_retrieve_delete_only_own_keys(api, other_api):
    mine = api.post(URL, {"public_key": ed25519_key(), "name": "mine"}, format="json").json()
    theirs = other_api.post(URL, {"public_key": ed25519_key(), "name": "theirs"}, format="json").json()
    listed = api.get(URL).json()
    assert [k["id"] for k in listed["results"]] == [mine["id"]]
    assert api.get(f"{URL}{mine['id']}/").status_code == 200
    assert api.get(f"{URL}{theirs['id']}/").status_code == 404
    assert api.delete(f"{URL}{theirs['id']}/").status_code == 404
    assert SshKey.objects.filter(pk=theirs["id"]).exists()
    assert api.delete(f"{URL}{mine['id']}/").status_code == 204
    assert not SshKey.objects.filter(pk=mine["id"]).exists()
    assert api.delete(f"{URL}{mine['id']}/").status_code == 404


def test_anonymous_is_401(anon):
    assert anon.get(URL).status_code == 401
    assert anon.post(URL, {"public_key": ed25519_key()}, format="json").status_code == 401


@pytest.mark.parametrize("body", [
    {"public_key": ed25519_key(), "fingerprint": "SHA256:x"},  # read-only field
    {"public_key": ed25519_key(), "nmae": "typo"},
    {"public_key": 12},
    {"public_key": ed25519_key(), "name": "a\x00b"},
    {"public_key": ed25519_key(), "name": "x" * 101},
    {},
])
def test_malformed_bodies_are_400(api, body):
    assert api.post(URL, body, format="json").status_code == 400
    assert SshKey.objects.count() == 0


def test_other_users_keys_are_untouched_by_deletes(api):
    user2 = UserFactory()
    from marketplace.services.ssh_keys import ssh_key_create

    key = ssh_key_create(user=user2, public_key=ed25519_key())
    assert api.delete(f"{URL}{key.pk}/").status_code == 404
    assert SshKey.objects.filter(pk=key.pk).exists()
