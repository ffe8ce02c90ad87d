import pytest


@pytest.mark.django_db
def test_unknown_api_url_is_json_404(anon):
    r = anon.get("/api/v1/no-such-thing/")
    assert r.status_code == 404 and r.json() == {"detail": "Not found."}
