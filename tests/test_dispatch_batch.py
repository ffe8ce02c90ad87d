"""core.dispatch.batch: one Redis pipeline for many messages, sent without declaring and retrying per message (the
queues are declared once per batch): each message still reaches its task's queue, on a broker nothing has declared
a queue on yet."""
import json
import uuid

import pytest
import redis
from celery import Celery
from django.conf import settings

from config.celery import app as celery_app
from core import dispatch


@pytest.fixture
def fresh_broker():
    """The project's routes and queues on a key prefix nothing has used: no queue declared, no binding."""
    prefix = f"test-dispatch-{uuid.uuid4().hex[:8]}:"
    app = Celery("test-dispatch", broker=settings.CELERY_BROKER_URL, set_as_current=False)
    app.conf.broker_transport_options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": prefix}
    for name in ("task_queues", "task_routes", "task_default_queue"):
        app.conf[name] = celery_app.conf[name]
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    app.set_current()
    try:
        yield prefix, client
    finally:
        celery_app.set_current()
        app.close()
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)


def test_a_batch_reaches_each_tasks_queue_on_a_fresh_broker(fresh_broker):
    prefix, client = fresh_broker
    assert not list(client.scan_iter(match=f"{prefix}*"))
    sent = {"provisioning.tasks.instance_provision": "ssh", "provisioning.tasks.jobs_reap": "fleet",
            "billing.tasks.usage_meter_tick": "money"}
    with dispatch.batch(max_size=10) as producer:
        for number, name in enumerate(sent):
            dispatch.send(name, number, task_id=f"t-{number}", producer=producer)
        dispatch.send("provisioning.tasks.instance_provision", 9, task_id="t-9", producer=producer)
    assert not producer._gpumarket_batch  # a producer back in the pool publishes as usual
    got = {queue: [json.loads(m)["headers"]["task"] for m in client.lrange(f"{prefix}{queue}", 0, -1)]
           for queue in ("ssh", "fleet", "money")}
    assert got == {"ssh": ["provisioning.tasks.instance_provision"] * 2, "fleet": ["provisioning.tasks.jobs_reap"],
                   "money": ["billing.tasks.usage_meter_tick"]}
