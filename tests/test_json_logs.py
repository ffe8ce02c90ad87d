"""Log lines that carry the job, node, instance and task they are about (core/logging_context.py), as JSON in
production: in this process, in a production-configured process, and in a real Celery worker running a job."""
import io
import json
import logging
import socket
import uuid

import pytest
import redis
from celery import Celery
from django.conf import settings
from django.utils import timezone

from config.celery import SSH
from config.celery import app as celery_app
from core.logging_context import ContextFilter, JsonFormatter, PlainFormatter, current, log_context
from marketplace.models import Node, NodeState
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.jobs import job_create
from tests.factories import UserFactory, make_node
from tests.live import Worker, wait_until
from tests.test_settings import production_env, run_python


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(ContextFilter())
    logger = logging.getLogger(f"test-json-logs-{uuid.uuid4().hex}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return logger, stream


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_ids_bound_around_them_and_only_there():
    log, stream = _logger(JsonFormatter())
    log.info("before")
    with log_context(job_id=7, node_id=3):
        with log_context(instance_id=11):
            log.info("inner %s", "work")
        log.warning("outer")
    log.info("after")

    before, inner, outer, after = _lines(stream)
    assert inner["message"] == "inner work" and inner["level"] == "INFO" and inner["logger"] == log.name
    assert (inner["job_id"], inner["node_id"], inner["instance_id"]) == (7, 3, 11)
    assert (outer["job_id"], outer["node_id"], outer["instance_id"]) == (7, 3, None)
    for line in (before, after):
        assert (line["job_id"], line["node_id"], line["instance_id"], line["task_id"]) == (None,) * 4
    assert inner["time"].endswith("+00:00")  # UTC, ISO 8601
    assert current() == {}


def test_an_exception_goes_into_the_same_json_line():
    log, stream = _logger(JsonFormatter())
    with log_context(job_id=1):
        try:
            raise ValueError("the node said no")
        except ValueError:
            log.exception("job failed")
    (line,) = _lines(stream)
    assert line["job_id"] == 1 and "ValueError: the node said no" in line["exc_info"]


def test_the_plain_format_names_the_bound_ids_and_unknown_ids_are_refused():
    log, stream = _logger(PlainFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    with log_context(job_id=5, instance_id=9):
        log.info("hello")
    assert f" {log.name} [job=5 instance=9] hello" in stream.getvalue()
    with pytest.raises(TypeError, match="user_id"), log_context(user_id=1):
        pass


def test_production_logs_json_lines_with_the_ids(tmp_path):
    code = ("import django; django.setup(); import logging; from core.logging_context import log_context\n"
            "with log_context(job_id=4, node_id=2, instance_id=8):\n"
            "    logging.getLogger('provisioning.tasks').warning('job %s: retrying', 4)\n")
    result = run_python(["-c", code], {"DJANGO_SETTINGS_MODULE": "config.settings.production", **production_env()},
                        tmp_path)
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stderr.strip().splitlines()[-1])
    assert line["message"] == "job 4: retrying" and line["level"] == "WARNING"
    assert (line["job_id"], line["node_id"], line["instance_id"]) == (4, 2, 8)
    # LOG_FORMAT=plain turns it back into text; a value that is neither is refused by name.
    plain = run_python(["-c", code], {"DJANGO_SETTINGS_MODULE": "config.settings.production",
                                      **production_env(LOG_FORMAT="plain")}, tmp_path)
    assert "[job=4 node=2 instance=8] job 4: retrying" in plain.stderr
    wrong = run_python(["-c", code], {"DJANGO_SETTINGS_MODULE": "config.settings.production",
                                      **production_env(LOG_FORMAT="xml")}, tmp_path)
    assert wrong.returncode != 0 and "LOG_FORMAT" in wrong.stderr


@pytest.fixture
def json_worker(django_db_setup, django_db_blocker, tmp_path):
    prefix = f"test-json-logs-{uuid.uuid4().hex[:8]}:"
    worker = Worker(tmp_path / "worker.log", tmp_path, suffix="-json", queues=(SSH,), concurrency=1,
                    env={"LOG_FORMAT": "json", "CELERY_BROKER_KEY_PREFIX": prefix})
    with django_db_blocker.unblock():
        worker.start()
    # Not made current: services queue through `celery.current_app`, which must stay the project's app for the
    # tests after this one (else their tasks go to a queue the suite's worker never reads).
    sender = Celery("test-json-logs", broker=settings.CELERY_BROKER_URL, set_as_current=False)
    sender.conf.broker_transport_options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": prefix}
    sender.conf.task_queues = celery_app.conf.task_queues
    sender.conf.task_routes = celery_app.conf.task_routes
    yield worker, sender
    worker.kill()
    sender.close()
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)


def test_a_worker_running_a_job_logs_json_lines_with_the_job_node_and_task(json_worker, monkeypatch,
                                                                           transactional_db):
    worker, sender = json_worker
    monkeypatch.setattr("core.dispatch.send",
                        lambda name, *args, task_id=None, producer=None: sender.send_task(name, args=list(args),
                                                                                           task_id=task_id))
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens: the job's connection attempts fail, it retries, then fails
    # A node that proved control once: a never-contacted one's failed first contact is not retried (5141fb1).
    node = make_node(UserFactory(), address="127.0.0.1", ssh_port=port, state=NodeState.VERIFYING)
    Node.objects.filter(pk=node.pk).update(control_proven_at=timezone.now())
    job = job_create(kind=JobKind.NODE_VERIFY, node=node)
    wait_until(lambda: Job.objects.get(pk=job.pk).status == JobStatus.FAILED, 90, what="the job to fail")

    lines = [json.loads(line) for line in worker.log_path.read_text().splitlines() if line.startswith("{")]
    about_job = [line for line in lines if line.get("job_id") == job.pk]
    assert about_job, worker.tail()
    for line in about_job:
        assert line["node_id"] == node.pk and line["instance_id"] is None
        assert line["task"] == "provisioning.tasks.node_verify" and line["task_id"]
    assert any("retrying" in line["message"] for line in about_job)
    # Celery's own lines are JSON too, and carry the task while it runs.
    assert any(line["logger"] == "celery.app.trace" and line["task"] == "provisioning.tasks.node_verify"
               for line in lines)
