"""docker-compose.yml cannot run here (no Docker engine), so check its shape and that its
services run the very scripts that `make demo` runs."""
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _demo_scripts():
    return set(re.findall(r"^(scripts/[\w-]+)", (ROOT / "scripts" / "demo").read_text(), re.M))


def test_compose_has_the_services_with_health_checks():
    services = _compose()["services"]
    assert {"postgres", "redis", "web", "worker", "beat"} <= set(services)
    for name in ("postgres", "redis", "web", "worker", "beat"):
        assert "healthcheck" in services[name], f"{name} has no health check"


def test_app_services_run_the_same_scripts_as_make_demo():
    services = _compose()["services"]
    demo = _demo_scripts()
    expected = {"web": "scripts/run-web", "worker": "scripts/run-worker", "beat": "scripts/run-beat",
                "release": "scripts/release"}
    for service, script in expected.items():
        assert services[service]["command"] == [script]
        assert script in demo, f"make demo does not run {script}"
        assert (ROOT / script).is_file()


def test_app_services_share_one_image_built_from_the_dockerfile():
    services = _compose()["services"]
    images = {services[s]["image"] for s in ("web", "worker", "beat", "release")}
    assert len(images) == 1
    assert all(services[s]["build"] == "." for s in ("web", "worker", "beat"))
    assert (ROOT / "Dockerfile").is_file()


def test_production_settings_and_real_services_are_used():
    env = _compose()["services"]["web"]["environment"]
    assert env["DJANGO_SETTINGS_MODULE"] == "config.settings.production"
    assert env["DATABASE_URL"].startswith("postgres://")
    assert env["CELERY_BROKER_URL"].startswith("redis://")
    assert env["DEBUG"] == "false"


def test_makefile_demo_runs_scripts_demo():
    assert re.search(r"^demo:.*\n\tscripts/demo$", (ROOT / "Makefile").read_text(), re.M)
