"""The real `vastai` CLI (and then its Python SDK) against a live server with a real Celery worker and a simulated
GPU server: host commands, search, create, SSH in with what `ssh-url` prints, stop, start, label, destroy, the
user and SSH keys. Only --url and --api-key point it here; nothing of it is patched.

It runs from its own venv, .venv-vastai (requirements-vastai.txt: it pins another cryptography than the platform),
made by `make test` or, when missing, by the `vastai_venv` fixture; the SDK runs there too, one call per process."""
import json
import os
import subprocess

import pytest

from marketplace.models import Instance, Node
from tests.e2e.test_instances import _renter_key, _status, _verified_node
from tests.factories import UserFactory, api_key_for
from tests.live import ROOT

pytestmark = pytest.mark.slow

VASTAI_VENV = ROOT / ".venv-vastai"


@pytest.fixture(scope="session")
def vastai_venv():
    if not (VASTAI_VENV / ".installed").exists():
        subprocess.run(["make", "-s", ".venv-vastai/.installed"], cwd=ROOT, check=True, timeout=600)
    return VASTAI_VENV / "bin"


@pytest.fixture
def vast_home(tmp_path, monkeypatch):
    """A HOME of its own: the CLI keeps caches and its role there; no update check."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "VASTAI_NO_UPDATE_CHECK": "1", "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
           "XDG_DATA_HOME": str(home / ".local/share")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("VAST_API_KEY", raising=False)
    monkeypatch.delenv("VAST_URL", raising=False)
    return home


def _vastai(url: str, key: str, *args: str, ok: bool = True, raw: bool = True) -> subprocess.CompletedProcess:
    argv = [str(VASTAI_VENV / "bin" / "vastai"), "--url", url, "--api-key", key, *(["--raw"] if raw else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=os.environ.copy())
    if ok:
        assert done.returncode == 0 and "error" not in done.stderr.lower(), (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, (args, done.stderr)
    return done


def _json(done: subprocess.CompletedProcess):
    return json.loads(done.stdout)


def _ssh_with(url_line: str, key_path, command: str) -> subprocess.CompletedProcess:
    """`ssh` with the URL `vastai ssh-url` printed (ssh://root@host:port), as a renter would."""
    argv = ["ssh", url_line, "-i", str(key_path), "-o", "StrictHostKeyChecking=no", "-o",
            "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_the_vastai_cli_end_to_end(worker, live_server, sim_node_factory, client_for, vastai_venv, vast_home,
                                   tmp_path):
    url = live_server.url + "/compat/vast"
    provider, renter = UserFactory(), UserFactory()
    host_key, renter_key = api_key_for(provider), api_key_for(renter)
    node, _ = _verified_node(client_for(provider), sim_node_factory)
    host = lambda *args, **kw: _vastai(url, host_key, *args, **kw)  # noqa: E731
    cli = lambda *args, **kw: _vastai(url, renter_key, *args, **kw)  # noqa: E731

    # The host's commands.
    machines = _json(host("show", "machines"))["machines"]
    assert [(m["id"], m["num_gpus"], m["gpu_name"], m["listed"]) for m in machines] == [
        (node.pk, 2, "RTX A4000", True)]
    host("unlist", "machine", str(node.pk))
    assert Node.objects.get(pk=node.pk).listed is False
    assert _json(cli("search", "offers", "gpu_name=RTX_A4000")) == []
    assert _json(host("list", "machine", str(node.pk), "-g", "0.45"))["success"] is True
    assert (Node.objects.get(pk=node.pk).listed, Node.objects.get(pk=node.pk).price_per_gpu_hour_micros) == (
        True, 450_000)

    # The renter's account: the user, an SSH key.
    user = _json(cli("show", "user"))
    assert (user["id"], user["email"], user["balance"]) == (renter.pk, renter.email, 0.0)
    key_path, public = _renter_key(tmp_path / "keys")
    cli("create", "ssh-key", public)
    assert [k["public_key"] for k in _json(cli("show", "ssh-keys"))] == [public.rsplit(" ", 1)[0]]

    # Search with a filter and an ordering (most expensive first), then book the two-GPU offer.
    assert "RTX_A4000" in cli("search", "offers", "gpu_name=RTX_A4000", raw=False).stdout  # the table
    offers = _json(cli("search", "offers", "gpu_name=RTX_A4000 num_gpus>=1 reliability>=0", "-o", "dph-"))
    assert [(o["id"], o["num_gpus"]) for o in offers] == [(node.pk * 100 + 2, 2), (node.pk * 100 + 1, 1)]
    assert offers[0]["dph_total"] == pytest.approx(0.9)
    # parse_query sends a dotted driver_version as numeric_version(...), 535104005 (a 400 when it was text here).
    Node.objects.filter(pk=node.pk).update(driver_version="550.54.15")
    assert {o["machine_id"] for o in _json(cli("search", "offers", "driver_version>=535.104.05"))} == {node.pk}
    assert _json(cli("search", "offers", "driver_version>=560.28.03")) == []
    created = _json(cli("create", "instance", str(offers[0]["id"]), "--image", "cuda-12-4", "--disk", "20",
                        "--ssh", "--label", "from-cli"))
    assert created["success"] is True
    instance_id = created["new_contract"]
    instance = _status(instance_id, "running", "failed", timeout=90)
    assert instance.status == "running", (instance.status_message, worker.tail())

    shown = _json(cli("show", "instance", str(instance_id)))
    assert (shown["actual_status"], shown["num_gpus"], shown["label"]) == ("running", 2, "from-cli")
    assert (shown["ssh_host"], shown["ssh_port"]) == (instance.ssh_host, instance.ssh_port)
    ssh_url = cli("ssh-url", str(instance_id)).stdout.strip()
    assert ssh_url == f"ssh://root@{shown['ssh_host']}:{shown['ssh_port']}"
    seen = _ssh_with(ssh_url, key_path, "echo CVD=$CUDA_VISIBLE_DEVICES")
    assert seen.returncode == 0 and seen.stdout.strip() == "CVD=0,1", seen.stderr
    # The tables (not --raw) format every field they find.
    assert f"{shown['ssh_port']}" in cli("show", "instance", str(instance_id), raw=False).stdout
    assert "from-cli" in cli("show", "instances", raw=False).stdout
    # --gpu-name as typed (underscores, as search offers takes it): the row says "RTX A4000".
    assert [i["id"] for i in _json(cli("show", "instances", "--gpu-name", "RTX_A4000"))] == [instance_id]
    assert renter.email in cli("show", "user", raw=False).stdout
    assert "RTX_A4000" in host("show", "machines", raw=False).stdout

    # Stop, start, label, destroy.
    cli("stop", "instance", str(instance_id))
    _status(instance_id, "stopped")
    assert [i["actual_status"] for i in _json(cli("show", "instances"))] == ["exited"]
    cli("start", "instance", str(instance_id))
    _status(instance_id, "running")
    cli("label", "instance", str(instance_id), "renamed")
    assert Instance.objects.get(pk=instance_id).label == "renamed"
    cli("destroy", "instance", str(instance_id), "-y")
    _status(instance_id, "destroyed")
    assert _json(cli("show", "instances")) == []

    # Bad queries come back as the CLI's JSON error with our msg, never a 500.
    for query, words in [("num_gpus>=two", "`num_gpus` takes a whole number"),
                         ("inet_up>=100", "does not measure or offer"), ("colour=red", "Unknown field `colour`")]:
        done = cli("search", "offers", query, ok=False)
        error = json.loads(done.stderr.strip().splitlines()[-1])
        assert error["status_code"] == 400 and words in error["msg"], done.stderr
    done = _vastai(url, "not-a-key", "show", "instances", ok=False)
    assert json.loads(done.stderr.strip().splitlines()[0])["status_code"] == 401


SDK_CALL = """
import json, sys
from vastai import VastAI
url, key, method, args, kwargs = sys.argv[1:]
print(json.dumps(getattr(VastAI(api_key=key, server_url=url), method)(*json.loads(args), **json.loads(kwargs))))
"""


class Sdk:
    """`VastAI(api_key=key, server_url=url).method(*args, **kwargs)`, run by the SDK's venv, its answer back."""

    def __init__(self, url: str, key: str):
        self.url, self.key = url, key

    def __getattr__(self, method: str):
        def call(*args, **kwargs):
            done = subprocess.run([str(VASTAI_VENV / "bin" / "python"), "-c", SDK_CALL, self.url, self.key, method,
                                   json.dumps(args), json.dumps(kwargs)], capture_output=True, text=True, timeout=60,
                                  env=os.environ.copy())
            assert done.returncode == 0, (method, done.stderr)
            return json.loads(done.stdout.strip().splitlines()[-1])

        return call


def test_the_vastai_sdk_end_to_end(worker, live_server, sim_node_factory, client_for, vastai_venv, vast_home,
                                   tmp_path):
    url = live_server.url + "/compat/vast"
    provider, renter = UserFactory(), UserFactory()
    node, _ = _verified_node(client_for(provider), sim_node_factory)
    host, vast = Sdk(url, api_key_for(provider)), Sdk(url, api_key_for(renter))
    assert [m["id"] for m in host.show_machines()] == [node.pk]
    assert host.unlist_machine(node.pk)["success"] is True
    assert host.list_machine(node.pk, price_gpu=0.3)["success"] is True

    assert vast.show_user()["email"] == renter.email
    key_path, public = _renter_key(tmp_path / "keys")
    vast.create_ssh_key(public)
    assert len(vast.show_ssh_keys()) == 1

    offers = vast.search_offers("gpu_name=RTX_A4000 num_gpus=1", order="dph")
    assert [o["id"] for o in offers] == [node.pk * 100 + 1]
    instance_id = vast.create_instance(offers[0]["id"], image="cuda-12-4", disk=20, ssh=True)["new_contract"]
    assert _status(instance_id, "running", "failed", timeout=90).status == "running"
    row = vast.show_instance(instance_id)
    assert row["actual_status"] == "running" and row["ssh_user"] == "root"
    seen = _ssh_with(f"ssh://root@{row['ssh_host']}:{row['ssh_port']}", key_path, "echo $CUDA_VISIBLE_DEVICES")
    assert seen.returncode == 0 and seen.stdout.strip() == "0", seen.stderr

    assert vast.stop_instance(instance_id)["success"] is True
    _status(instance_id, "stopped")
    assert vast.start_instance(instance_id)["success"] is True
    _status(instance_id, "running")
    assert vast.label_instance(instance_id, "sdk")["success"] is True
    assert [i["label"] for i in vast.show_instances()] == ["sdk"]
    assert vast.destroy_instance(instance_id)["success"] is True
    _status(instance_id, "destroyed")


def test_show_instances_pages_through_every_instance_with_the_cli_and_sdk(live_server, vastai_venv, vast_home):
    """More instances than one page (25): the CLI and the SDK send next_token back as after_token, as is, until it
    is empty (the token is a keyset cursor, urlsafe base64)."""
    from tests.factories import make_listed_node
    from tests.marketplace.renting_helpers import book

    url = live_server.url + "/compat/vast"
    renter = UserFactory()
    key = api_key_for(renter)
    made = [book(renter, node, label=f"n{n}").pk
            for n, node in enumerate(make_listed_node(gpu_count=14) for _ in range(2)) for _ in range(14)]
    assert len(made) == 28
    assert [i["id"] for i in _json(_vastai(url, key, "show", "instances"))] == made  # --raw: every page
    ids = _vastai(url, key, "show", "instances", "-q", raw=False).stdout.split()
    assert [int(i) for i in ids] == made
    first = _json(_vastai(url, key, "show", "instances", "--limit", "25"))
    assert [i["id"] for i in first["instances"]] == made[:25] and first["next_token"]
    rest = _json(_vastai(url, key, "show", "instances", "--next-token", first["next_token"]))
    assert [i["id"] for i in rest["instances"]] == made[25:] and rest["next_token"] is None
    assert [i["id"] for i in Sdk(url, key).show_instances()] == made
