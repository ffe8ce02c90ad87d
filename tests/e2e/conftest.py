"""End-to-end tests use the live fixtures of tests/live.py (the worker, simulated servers), registered for the
whole suite by tests/conftest.py; the helpers stay importable from here."""
from tests.live import ROOT, Worker, wait_until

__all__ = ["ROOT", "Worker", "wait_until"]
