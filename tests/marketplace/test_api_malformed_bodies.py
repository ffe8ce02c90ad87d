"""Every write endpoint answers a body it cannot read with a 4xx and a JSON body, and writes nothing."""
from urllib.parse import urlencode

import pytest

from marketplace.models import ApiKey, Gpu, Node, User
from tests.factories import make_node

pytestmark = pytest.mark.django_db

WRITES = [
    ("post", "/api/v1/auth/register/", {"email": "new@example.com", "password": "a long enough pass 42"}),
    ("post", "/api/v1/auth/login/", {"email": "new@example.com", "password": "a long enough pass 42"}),
    ("post", "/api/v1/api-keys/", {"name": "ci"}),
    ("post", "/api/v1/nodes/", {"name": "n", "address": "10.1.1.1", "ssh_user": "gpu", "country": "DE",
                                "gpu_model": "l4", "gpu_count": 1, "price_per_gpu_hour": "1", "runtime": "sim"}),
    ("patch", "/api/v1/nodes/{node}/", {"name": "renamed"}),
]
IDS = [f"{method} {path}" for method, path, _ in WRITES]


@pytest.fixture
def target(api, user):
    node = make_node(user)

    def resolve(path):
        return path.format(node=node.pk)

    return resolve


def rows():
    return User.objects.count(), ApiKey.objects.count(), Node.objects.count(), Gpu.objects.count(), list(
        Node.objects.values_list("name", flat=True))


@pytest.mark.parametrize(("method", "path", "valid"), WRITES, ids=IDS)
def test_invalid_json_is_400(api, target, method, path, valid):
    before = rows()
    r = api.generic(method.upper(), target(path), '{"name": "unterminated', content_type="application/json")
    assert r.status_code == 400
    assert "JSON parse error" in r.json()["detail"]
    assert rows() == before


@pytest.mark.parametrize(("method", "path", "valid"), WRITES, ids=IDS)
@pytest.mark.parametrize("body", ["[]", '["a"]', '"a string"', "42", "true", "null"])
def test_a_body_that_is_not_an_object_is_400(api, target, method, path, valid, body):
    before = rows()
    r = api.generic(method.upper(), target(path), body, content_type="application/json")
    assert r.status_code == 400, r.content
    assert r.json()
    assert rows() == before


@pytest.mark.parametrize(("method", "path", "valid"), WRITES, ids=IDS)
def test_an_array_of_valid_objects_is_400(api, target, method, path, valid):
    before = rows()
    r = getattr(api, method)(target(path), [valid])
    assert r.status_code == 400
    assert rows() == before


@pytest.mark.parametrize(("method", "path", "valid"), WRITES, ids=IDS)
def test_an_unknown_field_is_named(api, target, method, path, valid):
    before = rows()
    r = getattr(api, method)(target(path), {**valid, "surprise": 1})
    assert r.status_code == 400
    assert r.json()["surprise"] == ["Unknown field."]
    assert rows() == before


@pytest.mark.parametrize(("method", "path", "valid"), WRITES, ids=IDS)
@pytest.mark.parametrize("fmt", ["multipart", "form"])
def test_only_json_is_accepted(api, target, method, path, valid, fmt):
    before = rows()
    if fmt == "form":
        r = api.generic(method.upper(), target(path), urlencode(valid),
                        content_type="application/x-www-form-urlencoded")
    else:
        r = getattr(api, method)(target(path), valid, format="multipart")
    assert r.status_code == 415
    assert "detail" in r.json()
    assert rows() == before


@pytest.mark.parametrize(("method", "path", "valid"), WRITES, ids=IDS)
@pytest.mark.parametrize("depth", [3000, 65])
def test_a_body_nested_too_deep_is_400(api, target, method, path, valid, depth):
    """Past Python's recursion limit json raises RecursionError, which DRF's JSONParser let through (a 500);
    past core.api.parsers.MAX_DEPTH the body parses but is refused all the same."""
    before = rows()
    r = api.generic(method.upper(), target(path), "[" * depth + "]" * depth, content_type="application/json")
    assert r.status_code == 400, r.content
    assert r.json() == {"detail": "JSON parse error - JSON nested deeper than 64 levels."}
    assert rows() == before


@pytest.mark.parametrize(("method", "path", "valid"), WRITES, ids=IDS)
def test_a_body_with_an_unpaired_surrogate_is_400_naming_where(api, target, method, path, valid):
    """JSON's "\\ud800" alone is no Unicode: DRF's CharField refused it, but a JSONField or a hand-read body
    took it to the database driver (a 500). core.api.parsers refuses it for every body, keys too, saying where."""
    before = rows()
    for body, where in (('{"name": "a\\ud800"}', "name"), ('{"env": {"A": ["x", "\\udfff"]}}', "env.A[1]"),
                        ('{"\\ud800": 1}', "'\\ud800'")):
        r = api.generic(method.upper(), target(path), body, content_type="application/json")
        assert r.status_code == 400, r.content
        assert r.json() == {"detail": "JSON parse error - JSON text holds an unpaired UTF-16 surrogate (an escape "
                                      f"such as \\ud800 alone), which is not Unicode, at `{where}`."}
    assert rows() == before
    # A pair is one character (U+1F600), as any JSON encoder writes it: read.
    r = api.post("/api/v1/api-keys/", '{"name": "ci \\ud83d\\ude00"}', content_type="application/json")
    assert r.status_code == 201 and r.json()["name"] == "ci \U0001f600"


def test_a_body_nested_too_deep_is_400_before_authentication(anon):
    body = '{"email": ' * 2000 + "1" + "}" * 2000
    r = anon.post("/api/v1/auth/login/", body, content_type="application/json")
    assert r.status_code == 400 and "nested deeper" in r.json()["detail"]


def test_a_body_nested_up_to_the_limit_is_read(api):
    # 64 levels: no longer refused as too deep, answered by the endpoint's own validation (not an object).
    r = api.post("/api/v1/api-keys/", "[" * 64 + "]" * 64, content_type="application/json")
    assert r.status_code == 400 and "nested" not in str(r.json())
