"""Production's SITE_URL, from which notification e-mails' one-click unsubscribe links are made: before, left unset (as
docker-compose.yml and the README's deployment leave it) it was empty, and no e-mail carried a List-Unsubscribe header
in production. Unset, it is now https://<the first of ALLOWED_HOSTS>/ (the site is HTTPS only); set, it must be an
absolute https:// address ending in / (urljoin drops a last path segment without it), else production refuses to
start naming it."""
import pytest

from tests.test_settings import production_env, run_python

SHOW = ["-c", "from django.conf import settings; import django; django.setup(); print(repr(settings.SITE_URL))"]
PRODUCTION = {"DJANGO_SETTINGS_MODULE": "config.settings.production"}


def _site_url(tmp_path, **overrides) -> str:
    result = run_python(SHOW, {**PRODUCTION, **production_env(**overrides)}, tmp_path)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(("overrides", "shown"), [
    ({"ALLOWED_HOSTS": "gpus.example.com,www.gpus.example.com"}, "'https://gpus.example.com/'"),
    ({"ALLOWED_HOSTS": "gpus.example.com", "SITE_URL": "https://market.example.org/gpus/"},
     "'https://market.example.org/gpus/'"),
    ({"ALLOWED_HOSTS": ".gpus.example.com"}, "''"),  # a wildcard names no host to link to
])
def test_production_site_url(tmp_path, overrides, shown):
    assert _site_url(tmp_path, **overrides) == shown


@pytest.mark.parametrize("value", ["http://gpus.example.com/", "https://gpus.example.com/gpus", "gpus.example.com/",
                                   "https:///", "https://gpus.example.com/?a=1"])
def test_production_refuses_a_site_url_that_is_no_https_address_ending_in_a_slash(tmp_path, value):
    result = run_python(SHOW, {**PRODUCTION, **production_env(SITE_URL=value)}, tmp_path)
    assert result.returncode != 0 and "ImproperlyConfigured" in result.stderr
    assert "SITE_URL must be this site's https:// address" in result.stderr
