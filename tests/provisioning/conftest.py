"""Fixtures of the provisioning tests."""
import pytest
from kombu.exceptions import OperationalError

from provisioning.services import jobs as job_svc


class Broker:
    """What jobs.job_send hands to Celery, recorded; `down` makes it refuse as kombu does when Redis is gone."""

    def __init__(self):
        self.down = False
        self.messages = []

    def __call__(self, task_name, *, job_id, task_id, producer=None):
        if self.down:
            raise OperationalError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")
        self.messages.append((task_name, job_id, task_id))

    def job_ids(self):
        return [job_id for _, job_id, _ in self.messages]


@pytest.fixture
def broker(monkeypatch):
    fake = Broker()
    monkeypatch.setattr(job_svc, "_publish", fake)
    return fake
