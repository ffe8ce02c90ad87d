"""Review r54 (ops, LOW-2): seed_demo made operator@example.com a superuser with the password in the repository
before anything else, outside the nodes' transactions; run in production (no simulated servers) it failed at the
first node with that superuser committed. Now it refuses to run unless SIM_NODES_ALLOWED (or --i-am-a-demo), and
seeds in one transaction that a failure rolls back."""
import pytest
from django.core.management import CommandError, call_command

from marketplace.models import User
from operations.management.commands import seed_demo

pytestmark = pytest.mark.django_db


def _no_sim(profile):
    raise RuntimeError("no simulated servers here")


def test_seed_demo_refuses_where_simulated_servers_are_not_allowed(settings):
    settings.SIM_NODES_ALLOWED = False  # production
    with pytest.raises(CommandError, match="SIM_NODES_ALLOWED"):
        call_command("seed_demo")
    assert not User.objects.filter(email="operator@example.com").exists()


def test_seed_demo_leaves_no_known_password_superuser_when_it_fails(monkeypatch):
    monkeypatch.setattr(seed_demo.sim, "nodes_list", lambda: [])
    monkeypatch.setattr(seed_demo.sim, "node_up", _no_sim)
    with pytest.raises(RuntimeError):
        call_command("seed_demo", i_am_a_demo=True)
    op = User.objects.filter(email="operator@example.com").first()
    assert op is None or not op.check_password("demo-operator-pass")
