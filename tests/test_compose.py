"""docker-compose.yml cannot run here (no Docker engine), so check its shape and that its
services run the very scripts that `make demo` runs."""
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _demo_scripts():
    return set(re.findall(r"^\s*(scripts/[\w-]+)", (ROOT / "scripts" / "demo").read_text(), re.M))


WORKERS = {"worker-ssh": "ssh", "worker-fleet": "fleet", "worker-money": "money"}


def test_compose_has_the_services_with_health_checks():
    services = _compose()["services"]
    assert {"postgres", "redis", "web", "beat", "flower", *WORKERS} <= set(services)
    for name in ("postgres", "redis", "web", "beat", "flower", *WORKERS):
        assert "healthcheck" in services[name], f"{name} has no health check"


def test_compose_runs_a_worker_per_queue_group_as_make_demo_does():
    from config.celery import QUEUES

    services = _compose()["services"]
    assert set(WORKERS.values()) == set(QUEUES)
    demo = (ROOT / "scripts" / "demo").read_text()
    for service, queue in WORKERS.items():
        assert services[service]["command"] == ["scripts/run-worker", queue]
        # its health check pings the worker by the node name scripts/run-worker gives it
        assert f"-d {queue}@$$HOSTNAME" in services[service]["healthcheck"]["test"][1]
        assert re.search(rf"^[^#\n]*scripts/run-worker {queue} ", demo, re.M), f"make demo runs no {queue} worker"


def test_web_and_workers_share_the_prometheus_multiprocess_directory():
    services = _compose()["services"]
    for name in ("web", *WORKERS):
        env = services[name]["environment"]
        assert env["PROMETHEUS_MULTIPROC_DIR"] == "/app/var/metrics"
        assert "metrics:/app/var/metrics" in services[name]["volumes"]


def test_app_services_run_the_same_scripts_as_make_demo():
    services = _compose()["services"]
    demo = _demo_scripts()
    expected = {"web": "scripts/run-web", "beat": "scripts/run-beat", "release": "scripts/release",
                "job-relay": "scripts/run-relay"}
    for service, script in expected.items():
        assert services[service]["command"] == [script]
        assert script in demo, f"make demo does not run {script}"
        assert (ROOT / script).is_file()


def test_app_services_share_one_image_built_from_the_dockerfile():
    services = _compose()["services"]
    images = {services[s]["image"] for s in ("web", "beat", "release", "flower", "job-relay", *WORKERS)}
    assert len(images) == 1
    assert all(services[s]["build"] == "." for s in ("web", "beat", "flower", "job-relay", *WORKERS))
    assert (ROOT / "Dockerfile").is_file()


def test_production_settings_and_real_services_are_used():
    env = _compose()["services"]["web"]["environment"]
    assert env["DJANGO_SETTINGS_MODULE"] == "config.settings.production"
    assert env["DATABASE_URL"].startswith("postgres://")
    assert env["CELERY_BROKER_URL"].startswith("redis://")
    assert env["DEBUG"] == "false"


def test_makefile_demo_runs_scripts_demo():
    assert re.search(r"^demo:.*\n\tscripts/demo$", (ROOT / "Makefile").read_text(), re.M)
