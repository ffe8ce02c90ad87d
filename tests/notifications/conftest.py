"""Notifications tests: a real local HTTP server as a user's webhook endpoint, and tasks run as the worker would."""
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from celery import current_app

import notifications.tasks  # noqa: F401 (registers the tasks run below)
from tests.factories import UserFactory, api_key_for


class Receiver:
    """An HTTP server on 127.0.0.1 that records each POST (headers, raw body) and answers with the next of
    `answers` (then 200)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.answers: list[int] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                code = receiver.answers.pop(0) if receiver.answers else 200
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/gpumarket"
        # stop() waits for serve_forever to see the shutdown: every poll_interval (0.5 s by default)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def queued(monkeypatch):
    """Tasks queued on commit, recorded (name, args) instead of sent to the broker."""
    sent: list[tuple[str, tuple]] = []
    monkeypatch.setattr("core.dispatch.send", lambda name, *args, task_id=None: sent.append((name, args)))
    return sent


def run_queued(sent) -> None:
    """Run the recorded tasks as the worker would (Celery's apply: retries run at once, in this process)."""
    while sent:
        name, args = sent.pop(0)
        current_app.tasks[name].apply(args=args)


@pytest.fixture
def owner(db):
    return UserFactory()


@pytest.fixture
def owner_api(owner):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(owner)}")
    client.user = owner
    return client
