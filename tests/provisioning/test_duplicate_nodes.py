"""One server, one live node: the same server (its SSH host key) or the same GPUs (their UUIDs) registered as two
nodes is listed once. The node that came first keeps its listing; the later one is rejected with a finding its
provider can act on, which names neither the other node nor its provider. Retiring the first frees the hardware.

The rule is two unique constraints on PostgreSQL (node_unique_live_host_key, gpu_unique_uuid), so the races are
tested with real concurrent transactions; the verifications run over real SSH against a simulated server."""
import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from django.apps import apps
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Gpu, Node, NodeState, Verdict
from marketplace.models.nodes import OFFERABLE
from marketplace.services.nodes import node_retire
from provisioning import sim
from provisioning.models import Job, NodeEvent, VerificationRun
from provisioning.services.nodes import (
    DuplicateHardware,
    _pin_host_key,
    node_apply_inventory,
    node_health_probe,
)
from provisioning.services.runner import job_begin
from provisioning.services.verification import node_accept_host_key, node_verify_request, node_verify_run
from provisioning.verification.identity import check_identity
from provisioning.verification.model import DeclaredModel, load_catalogue
from tests.factories import UserFactory, make_node
from tests.live import wait_until

FINGERPRINT = "SHA256:" + "K" * 43
NODES = "/api/v1/nodes/"


# ------------------------------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("duplicate-simnodes")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module")
def server(simbase):
    """One simulated server (two RTX A4000s)."""
    return sim.node_up("rtx-a4000-x2", simbase)


@pytest.fixture(scope="module")
def twin(simbase, server):
    """Another server (its own host key) with the first one's GPUs in it: the cards moved, or were faked."""
    info = sim.node_up("rtx-a4000-x2", simbase)
    shutil.copyfile(Path(server["node_dir"]) / "profile.json", Path(info["node_dir"]) / "profile.json")
    return info


def register(server, simbase, *, pin: bool = True, address: str | None = None, provider=None, **fields) -> Node:
    """A provider registers the sim server (at `address`, another name for it) and installs the key."""
    node = make_node(provider or UserFactory(), gpu_model="rtx-a4000", gpu_count=2,
                     address=address or server["address"], ssh_port=server["ssh_port"], ssh_user=server["ssh_user"],
                     host_key_fingerprint=server["host_key_fingerprint"] if pin else "", **fields)
    sim.node_authorize(server["ssh_port"], node.ssh_public_key, simbase)
    return node


def verify(node: Node) -> tuple[Node, Job]:
    job = job_begin(job_id=node_verify_request(node=node).pk)
    node_verify_run(job=job)
    node.refresh_from_db()
    job.refresh_from_db()
    return node, job


def uuids(node: Node) -> list[str]:
    return list(node.gpus.order_by("index").values_list("uuid", flat=True))


def assert_names_no_other_account(text: str, other: Node) -> None:
    """What the later node's provider is told names neither the first node nor its provider."""
    assert other.provider.email not in text
    assert other.name not in text
    assert not re.search(rf"(?i)\b(node|#|id)\W*{other.pk}\b", text), text


# ------------------------------------------------------------------------------- the same server, twice

@pytest.mark.django_db
def test_the_same_server_twice_the_second_is_rejected_by_its_host_key(server, simbase):
    first = register(server, simbase, pin=False, name="first-of-two-zz9")
    first, _ = verify(first)
    assert (first.state, first.verdict) == (NodeState.ACTIVE, Verdict.VERIFIED), first.last_error
    assert first.host_key_fingerprint == server["host_key_fingerprint"]
    # The same server under another name for its address, by another account, first contact unpinned.
    second = register(server, simbase, pin=False, address="localhost", name="second")
    second, job = verify(second)

    assert (second.state, second.verdict) == (NodeState.REJECTED, Verdict.REJECTED)
    assert second.host_key_fingerprint == ""  # nothing pinned
    assert uuids(second) == ["", ""]  # no GPU claimed
    assert job.status == "succeeded"  # the check ran and judged; it did not crash
    run = VerificationRun.objects.get(node=second)
    assert [f["code"] for f in run.findings] == ["duplicate_host_key"]
    assert run.findings[0]["severity"] == "reject"
    assert server["host_key_fingerprint"] in run.findings[0]["message"]
    assert "retire" in run.findings[0]["message"] and "ssh-keygen -A" in run.findings[0]["message"]
    assert second.last_error.startswith("Rejected: ") and "another live node" in second.last_error
    for text in (second.last_error, run.findings[0]["message"],
                 *NodeEvent.objects.filter(node=second).values_list("message", flat=True)):
        assert_names_no_other_account(text, first)
    # The first keeps its listing; the server is offered once.
    first.refresh_from_db()
    assert (first.state, first.verdict) == (NodeState.ACTIVE, Verdict.VERIFIED)
    assert list(Node.objects.filter(OFFERABLE).values_list("pk", flat=True)) == [first.pk]
    assert all(uuids(first))


@pytest.mark.django_db
def test_the_same_gpus_under_another_host_key_are_rejected_before_the_benchmark(server, twin, simbase):
    first, _ = verify(register(server, simbase, name="first-of-two-zz9"))
    assert first.verdict == Verdict.VERIFIED, first.last_error
    second, job = verify(register(twin, simbase, name="second"))

    assert (second.state, second.verdict) == (NodeState.REJECTED, Verdict.REJECTED)
    run = VerificationRun.objects.get(node=second)
    assert [f["code"] for f in run.findings] == ["duplicate_gpu"]
    message = run.findings[0]["message"]
    for index, uuid in enumerate(uuids(first)):
        assert f"GPU {index} ({uuid})" in message  # its own GPUs, as its nvidia-smi names them
    assert_names_no_other_account(message, first)
    assert_names_no_other_account(second.last_error, first)
    assert uuids(second) == ["", ""] and all(uuids(first))
    assert second.host_key_fingerprint == twin["host_key_fingerprint"]  # its own key: pinned, not shared
    assert "median" not in run.figures  # nothing was benchmarked on GPUs another node holds
    assert not any("benchmarking" in step["message"] for step in job.log)
    assert second.inventory["gpus"][0]["uuid"] == uuids(first)[0]  # what it read is kept


@pytest.mark.django_db
def test_once_the_first_is_retired_the_second_verifies(server, simbase):
    first, _ = verify(register(server, simbase, pin=False))
    second = register(server, simbase, pin=False, address="localhost")
    second, _ = verify(second)
    assert second.verdict == Verdict.REJECTED

    node_retire(node=first)
    assert uuids(first) == ["", ""]  # a retired node lets go of its GPUs (and, by the constraint, of its key)
    second, _ = verify(second)
    assert (second.state, second.verdict) == (NodeState.ACTIVE, Verdict.VERIFIED), second.last_error
    assert second.host_key_fingerprint == server["host_key_fingerprint"] and all(uuids(second))
    assert list(Node.objects.filter(OFFERABLE).values_list("pk", flat=True)) == [second.pk]


@pytest.mark.django_db
def test_a_health_check_does_not_pin_a_key_another_live_node_has(server, simbase):
    verify(register(server, simbase, pin=False))
    second = register(server, simbase, pin=False, address="localhost")
    result = node_health_probe(second)
    assert not result.ok and "another live node" in result.error
    second.refresh_from_db()
    assert second.host_key_fingerprint == ""


# --------------------------------------------------------------------------------------- registration

@pytest.mark.django_db
def test_registering_a_host_key_ones_own_live_node_has_is_a_400_on_that_field_and_writes_nothing(
        api, user, other_api):
    """Only the provider's own live nodes are looked at: another account's node with the key, proven or not, is
    not (registering tells nobody whether a server is on the platform; a node reserves its host key only once it
    proved it controls its server, and a later node is refused at its first contact: found by review)."""
    first = make_node(user, name="first-of-two-zz9", host_key_fingerprint=FINGERPRINT)
    Node.objects.filter(pk=first.pk).update(control_proven_at=timezone.now())
    body = {"name": "box", "address": "10.9.9.9", "ssh_port": 22, "ssh_user": "ubuntu", "country": "DE",
            "gpu_model": "a100-80gb-sxm", "gpu_count": 4, "price_per_gpu_hour": "1.00", "runtime": "docker",
            "host_key_fingerprint": FINGERPRINT}
    before = Node.objects.count(), Gpu.objects.count()
    r = api.post(NODES, body, format="json")
    assert r.status_code == 400, r.content
    assert list(r.json()) == ["host_key_fingerprint"]
    assert "another live node of yours" in r.json()["host_key_fingerprint"][0].lower()
    assert (Node.objects.count(), Gpu.objects.count()) == before
    r = other_api.post(NODES, body, format="json")
    assert r.status_code == 201, r.content
    assert_names_no_other_account(r.content.decode(), first)

    node_retire(node=first)
    assert api.post(NODES, body, format="json").status_code == 201


@pytest.mark.django_db
def test_the_register_page_shows_a_taken_host_key_on_its_field():
    owner = UserFactory()
    make_node(owner, host_key_fingerprint=FINGERPRINT)
    client = Client()
    client.force_login(owner)
    form = {"name": "rack1", "address": "localhost", "ssh_port": "22", "ssh_user": "gpumarket",
            "host_key_fingerprint": FINGERPRINT, "country": "DE", "city": "", "datacenter": "",
            "gpu_model": "rtx-a6000", "gpu_count": "2", "price_per_gpu_hour": "0.79", "runtime": "docker"}
    r = client.post("/nodes/new/", form)
    assert r.status_code == 400 and Node.objects.count() == 1
    assert 'id="id_host_key_fingerprint_errors"' in r.content.decode()


@pytest.mark.django_db
def test_an_operator_cannot_accept_a_new_host_key_that_another_live_node_has():
    holder = make_node(host_key_fingerprint=FINGERPRINT)
    moved = make_node(host_key_fingerprint="SHA256:" + "M" * 43, state=NodeState.QUARANTINED)
    # Both proved control of their servers (first contact): the key is the holder's.
    Node.objects.filter(pk__in=(holder.pk, moved.pk)).update(control_proven_at=timezone.now())
    Node.objects.filter(pk=moved.pk).update(seen_host_key_fingerprint=FINGERPRINT)
    with pytest.raises(Conflict, match="pinned on live node"):
        node_accept_host_key(node=moved, operator_email="ops@example.com")
    moved.refresh_from_db()
    assert (moved.state, moved.host_key_fingerprint) == (NodeState.QUARANTINED, "SHA256:" + "M" * 43)


@pytest.mark.django_db
def test_an_operator_accepts_a_quarantined_nodes_new_key_from_the_admin(monkeypatch):
    """The admin's action was answered "A quarantined node cannot be verified" and rolled back: the accept asked
    for a verification a quarantined node may not have, so the node stayed quarantined for good."""
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    moved = make_node(host_key_fingerprint="SHA256:" + "M" * 43, state=NodeState.QUARANTINED)
    Node.objects.filter(pk=moved.pk).update(seen_host_key_fingerprint=FINGERPRINT)
    admin = Client()
    admin.force_login(UserFactory(is_staff=True, is_superuser=True))
    page = admin.post("/admin/marketplace/node/", {"action": "accept_new_host_key", "_selected_action": [moved.pk]},
                      follow=True).content.decode()
    assert "cannot be verified" not in page
    moved.refresh_from_db()
    assert (moved.state, moved.host_key_fingerprint, moved.seen_host_key_fingerprint) == (
        NodeState.VERIFYING, FINGERPRINT, "")
    assert Job.objects.filter(node=moved, kind="node_verify").exists()
    assert NodeEvent.objects.filter(node=moved, kind="host_key_accepted").exists()


# ------------------------------------------------------------------------------------- inventory rules

def inventory(*uuid_list: str) -> dict:
    return {"gpus": [{"index": i, "uuid": u, "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920,
                      "pci_bus_id": f"00000000:{i + 1:02x}:00.0"} for i, u in enumerate(uuid_list)]}


@pytest.mark.django_db
def test_a_gpu_moving_between_a_nodes_own_slots_is_not_a_duplicate():
    node = make_node(gpu_count=2)
    node_apply_inventory(node=node, inventory=inventory("GPU-a", "GPU-b"))
    node_apply_inventory(node=node, inventory=inventory("GPU-b", "GPU-a"))  # one UPDATE, swapped
    assert uuids(node) == ["GPU-b", "GPU-a"]
    node_apply_inventory(node=node, inventory=inventory("GPU-a"))  # GPU 1 gone: no longer claimed
    assert uuids(node) == ["GPU-a", ""]


@pytest.mark.django_db
def test_one_uuid_on_two_gpus_of_a_node_is_claimed_by_none_and_rejected_by_the_policy():
    node = make_node(gpu_count=2)
    node_apply_inventory(node=node, inventory=inventory("GPU-same", "GPU-same"))
    assert uuids(node) == ["", ""]
    declared = DeclaredModel.from_catalogue(load_catalogue()["a100-80gb-sxm"])
    findings = check_identity(declared, 2, inventory("GPU-same", "GPU-same")["gpus"])
    assert [(f.code, f.severity, f.gpu_index) for f in findings] == [("gpu_uuid_repeated", "reject", 0),
                                                                     ("gpu_uuid_repeated", "reject", 1)]


@pytest.mark.django_db
def test_a_duplicate_gpu_claims_nothing_and_says_which():
    first = make_node(gpu_count=2)
    node_apply_inventory(node=first, inventory=inventory("GPU-a", "GPU-b"))
    second = make_node(gpu_count=2)
    node_apply_inventory(node=second, inventory=inventory("GPU-x", "GPU-y"))
    with pytest.raises(DuplicateHardware) as raised:
        node_apply_inventory(node=second, inventory=inventory("GPU-z", "GPU-b"))
    assert raised.value.code == "duplicate_gpu" and not raised.value.transient
    assert "GPU 1 (GPU-b) already belongs to another live node" in raised.value.message
    assert "GPU-z" not in raised.value.message
    assert uuids(second) == ["", ""] and uuids(first) == ["GPU-a", "GPU-b"]
    second.refresh_from_db()
    assert second.inventory == inventory("GPU-z", "GPU-b")


# ------------------------------------------------------------------------------------ races (committed)

def _hold_then_second(claim_first, claim_second):
    """The first claim commits only after the second has started (and must be waiting on it)."""
    claimed, release = threading.Event(), threading.Event()
    outcome = {}

    def first():
        try:
            with transaction.atomic():
                claim_first()
                claimed.set()
                release.wait(10)
        finally:
            connection.close()

    def second():
        claimed.wait(10)
        try:
            claim_second()
            outcome["second"] = "claimed"
        except Exception as exc:  # noqa: BLE001 - the assertion below says what it was
            outcome["second"] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    assert claimed.wait(10)
    time.sleep(0.5)
    assert threads[1].is_alive(), "the second claim did not wait for the first"
    release.set()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    return outcome["second"]


@pytest.mark.django_db(transaction=True)
def test_two_nodes_claiming_the_same_gpus_at_once_only_one_wins():
    a, b = make_node(gpu_count=2), make_node(gpu_count=2)
    same = inventory("GPU-race-0", "GPU-race-1")
    result = _hold_then_second(lambda: node_apply_inventory(node=a, inventory=same),
                               lambda: node_apply_inventory(node=b, inventory=same))
    assert isinstance(result, DuplicateHardware) and result.code == "duplicate_gpu", result
    assert uuids(a) == ["GPU-race-0", "GPU-race-1"] and uuids(b) == ["", ""]


@pytest.mark.django_db(transaction=True)
def test_two_first_contacts_with_the_same_host_key_at_once_only_one_pins():
    a, b = make_node(), make_node()
    result = _hold_then_second(lambda: _pin_host_key(a, FINGERPRINT), lambda: _pin_host_key(b, FINGERPRINT))
    assert isinstance(result, DuplicateHardware) and result.code == "duplicate_host_key", result
    a.refresh_from_db()
    b.refresh_from_db()
    assert (a.host_key_fingerprint, b.host_key_fingerprint) == (FINGERPRINT, "")


# ----------------------------------------------------------------------------------- existing rows (0008)

@pytest.mark.django_db
def test_the_migration_keeps_the_listed_node_and_rejects_the_later_duplicates():
    """Rows from before the constraints: the migration's data step makes them fit."""
    migration = __import__("marketplace.migrations.0008_node_unique_hardware", fromlist=["resolve_duplicates"])
    with connection.cursor() as cur:  # rolled back with the test's transaction
        cur.execute("DROP INDEX node_unique_live_host_key; DROP INDEX gpu_unique_uuid")
    older = make_node(name="older", host_key_fingerprint=FINGERPRINT)  # the older row, never verified
    listed = make_node(name="listed", state=NodeState.ACTIVE, verdict=Verdict.VERIFIED,
                       host_key_fingerprint=FINGERPRINT)
    assert older.pk < listed.pk
    gpu_twin = make_node(name="gpu-twin", state=NodeState.ACTIVE, verdict=Verdict.VERIFIED)
    retired = make_node(name="retired", state=NodeState.RETIRED)
    for node in (listed, gpu_twin, retired):
        Gpu.objects.filter(node=node, index=0).update(uuid="GPU-shared")

    migration.resolve_duplicates(apps, None)

    rows = {n.name: n for n in Node.objects.all()}
    assert (rows["listed"].state, rows["listed"].verdict) == (NodeState.ACTIVE, Verdict.VERIFIED)
    assert rows["listed"].host_key_fingerprint == FINGERPRINT and uuids(rows["listed"])[0] == "GPU-shared"
    for loser in ("older", "gpu-twin"):
        assert (rows[loser].state, rows[loser].verdict) == (NodeState.REJECTED, Verdict.REJECTED), loser
        assert "another live node" in rows[loser].last_error
        assert not any(uuids(rows[loser]))
    assert rows["older"].host_key_fingerprint == ""
    assert not any(uuids(rows["retired"]))
    with connection.cursor() as cur:  # check the rows' foreign keys now: PostgreSQL indexes no table with checks due
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
    with connection.schema_editor() as editor:  # the constraints fit the rows now
        for model in (Node, Gpu):
            for constraint in model._meta.constraints:
                if constraint.name in ("node_unique_live_host_key", "gpu_unique_uuid"):
                    editor.add_constraint(model, constraint)


# ----------------------------------------------------------------------------- end to end (real worker)

@pytest.mark.slow
def test_two_registrations_of_one_server_verified_at_once_are_offered_once(
        worker, sim_node_factory, simnodes_dir, api, other_api, anon):
    first, info = sim_node_factory(api, pin=False)
    body = {"name": "the-same-box", "address": "localhost", "ssh_port": info["ssh_port"],
            "ssh_user": info["ssh_user"], "country": "DE", "gpu_model": "rtx-a4000", "gpu_count": 2,
            "price_per_gpu_hour": "0.400000", "runtime": "sim"}
    r = other_api.post(NODES, body, format="json")
    assert r.status_code == 201, r.content
    second = r.json()
    sim.node_authorize(info["ssh_port"], second["public_key"], simnodes_dir)

    # Both verified at once (the worker runs two tasks at a time): exactly one may win.
    assert api.post(f"{NODES}{first.pk}/verify/").status_code == 202
    assert other_api.post(f"{NODES}{second['id']}/verify/").status_code == 202
    ids = (first.pk, second["id"])
    nodes = wait_until(lambda: (lambda ns: ns if all(n.state != NodeState.VERIFYING for n in ns) else None)(
        list(Node.objects.filter(pk__in=ids).order_by("state"))), 90, what="both verifications to end")
    assert [(n.state, n.verdict) for n in nodes] == [("active", "verified"), ("rejected", "rejected")], (
        [n.last_error for n in nodes], worker.tail())
    winner, loser = nodes
    assert loser.host_key_fingerprint == "" and winner.host_key_fingerprint == info["host_key_fingerprint"]

    offers = anon.get("/api/v1/offers/?gpu_model=rtx-a4000").json()["results"]
    assert [(o["id"], o["num_gpus_total"]) for o in offers] == [(winner.pk, 2)]
    # The loser's provider reads why, and nothing about the other account.
    owner = api if loser.pk == first.pk else other_api
    seen = owner.get(f"{NODES}{loser.pk}/").json()
    assert seen["state"] == "rejected" and "another live node" in seen["last_error"]
    assert_names_no_other_account(seen["last_error"], winner)
    assert winner.provider.email not in json.dumps(seen) and winner.name not in json.dumps(seen)
