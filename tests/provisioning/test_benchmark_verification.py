"""The benchmark check end to end through the services, against a simulated server over real SSH: every honest
and dishonest profile, nodes rented while they fail, the time bound, re-verification, reliability.

One sim node serves the whole module: its "hardware" is swapped by rewriting its profile.json (the agent reads it
on every call), and each test registers its own Node row for it. Celery is not involved here (the tests call the
services the worker calls); tests/e2e/test_benchmark_check.py goes through a real worker."""
import json
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.utils import timezone

from marketplace.models import Image, Node, NodeState
from marketplace.models.nodes import OFFERABLE
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_private_key
from provisioning import sim, tasks
from provisioning.models import HealthSample, Job, JobKind, JobStatus, NodeEvent, VerificationRun
from provisioning.services.fleet_record import node_record_health, nodes_reliability
from provisioning.services.maintenance import nodes_reverify_due
from provisioning.services.nodes import node_health_probe
from provisioning.services.runner import job_begin
from provisioning.services.verification import node_verify_request, node_verify_run
from provisioning.sim import PROFILES_DIR
from provisioning.ssh import Endpoint, NodeSession, Timeouts
from provisioning.ssh_errors import AgentTimeout
from provisioning.verification.profiles import fleet_figures, profile_expectation, profile_names
from tests.factories import UserFactory, make_listed_node, make_node

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench-simnodes")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module")
def simnode(simbase):
    return sim.node_up("rtx-a4000-x2", simbase)


def profile_data(name: str) -> dict:
    return json.loads((PROFILES_DIR / f"{name}.json").read_text())


def use_hardware(simnode, profile: str | dict) -> dict:
    """Swap what the sim server has in it (a profile name, or a profile's data)."""
    data = profile_data(profile) if isinstance(profile, str) else profile
    (Path(simnode["node_dir"]) / "profile.json").write_text(json.dumps(data))
    return data


def register(simnode, simbase, profile: str | dict, **fields) -> Node:
    """The provider registers the sim server, declaring what the profile says it declares, and installs the key."""
    data = use_hardware(simnode, profile)
    fields.setdefault("nvlink_declared", data["declared"].get("nvlink", False))
    layout = data["declared"].get("mig_layout")
    if layout:  # a price per slice-hour for each profile it declares
        fields.setdefault("mig_layout", layout)
        fields.setdefault("mig_prices", {p: Decimal("0.25") for entry in layout for p in entry["profiles"]})
    node = make_node(UserFactory(), gpu_model=data["declared"]["gpu_model"], gpu_count=data["declared"]["gpu_count"],
                     address=simnode["address"], ssh_port=simnode["ssh_port"], ssh_user=simnode["ssh_user"],
                     host_key_fingerprint=simnode["host_key_fingerprint"], **fields)
    sim.node_authorize(simnode["ssh_port"], node.ssh_public_key, simbase)
    return node


def verify(node: Node) -> tuple[Node, Job]:
    job = job_begin(job_id=node_verify_request(node=node).pk)
    node_verify_run(job=job)
    node.refresh_from_db()
    job.refresh_from_db()
    return node, job


def rent(node: Node, num_gpus: int = 1):
    key = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    instance, _ = instance_svc.instance_create(renter=UserFactory(), node_id=node.pk, num_gpus=num_gpus,
                                               image=Image.objects.filter(active=True).first(),
                                               ssh_public_keys=[key])
    instance_svc.instance_mark_provisioning(instance_id=instance.pk)
    return instance_svc.instance_mark_running(instance_id=instance.pk, ssh_host="127.0.0.1", ssh_port=40001,
                                              ssh_user="root")


def seed_fleet(spec: dict) -> None:
    """`expect.fleet` of a profile: that many verified nodes of the honest profile's model, each with the run its
    hardware would record, so that the platform has a fleet reference to judge the profile's node against."""
    data = profile_data(spec["profile"])
    for figures in fleet_figures(spec["profile"], spec["nodes"]):
        fleet_node = make_node(UserFactory(), gpu_model=data["declared"]["gpu_model"],
                               gpu_count=data["declared"]["gpu_count"], state=NodeState.ACTIVE, verdict="verified")
        VerificationRun.objects.create(node=fleet_node, verdict="verified", figures=figures)


@pytest.mark.parametrize("name", profile_names())
def test_each_profile_gets_its_verdict_over_ssh(db, simnode, simbase, name, settings):
    expect = profile_expectation(name)
    if expect.get("fleet"):
        settings.FLEET_REFERENCE_MIN_NODES = expect["fleet"]["nodes"]
        seed_fleet(expect["fleet"])
    node, job = verify(register(simnode, simbase, name))
    assert job.status == JobStatus.SUCCEEDED, job.error
    run = VerificationRun.objects.get(node=node)
    codes = {f["code"] for f in run.findings}
    assert (node.verdict, run.verdict) == (expect["verdict"], expect["verdict"]), [f["message"] for f in run.findings]
    assert set(expect["findings"]) <= codes
    state = {"verified": NodeState.ACTIVE, "degraded": NodeState.ACTIVE, "rejected": NodeState.REJECTED}
    assert node.state == state[expect["verdict"]]
    split = {entry["gpu"]: entry["profiles"] for entry in profile_data(name)["declared"].get("mig_layout") or []}
    # a card split into MIG slices is measured per slice, never whole
    assert run.figures["mode"] == "simulated" and len(run.figures["gpus"]) == node.gpu_count - len(split)
    if split and expect["verdict"] != "rejected":
        assert sorted(s["profile"] for s in run.figures["mig_slices"]) == sorted(p for ps in split.values() for p in ps)
        assert node.mig_slices.filter(status="free").count() == sum(map(len, split.values()))
    if expect.get("fleet"):  # judged against the seeded fleet, which the run records
        assert run.figures["fleet"]["nodes"] == expect["fleet"]["nodes"]
        assert any(m["message"].startswith("comparing with") for m in job.log)
    assert run.score == node.score
    if expect["verdict"] == "rejected":
        assert node.score == 0 and node.last_error.startswith("Rejected: ")
        assert not Node.objects.filter(OFFERABLE, pk=node.pk).exists()
    else:
        assert node.score > 0 and Node.objects.filter(OFFERABLE, pk=node.pk).exists()
    assert [m["message"] for m in job.log if m["message"].startswith("benchmarking")]
    assert NodeEvent.objects.filter(node=node, kind=f"verified_{expect['verdict']}").exists()


def test_a_node_that_fails_while_rented_stays_up_for_its_renters(db, simnode, simbase):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    assert (node.state, node.verdict) == ("active", "verified")
    instance = rent(node)  # takes GPU 0
    broken = profile_data("rtx-a4000-x2")
    broken["performance"]["gpus"][1]["matmul_correct"] = False  # GPU 1, the free one, starts computing garbage
    use_hardware(simnode, broken)
    node, job = verify(node)
    run = node.verifications.first()
    assert (node.state, node.verdict, node.score) == ("active", "rejected", 0)  # not yanked, but not offered
    assert not Node.objects.filter(OFFERABLE, pk=node.pk).exists()
    assert run.figures["rented_gpus"] == [0] and [g["index"] for g in run.figures["gpus"]] == [1]  # renter untouched
    # caught by the node's own check and by the platform's challenge, both on GPU 1 only
    assert {(f["code"], f["gpu_index"]) for f in run.findings} == {("wrong_results", 1), ("challenge_wrong_result", 1)}
    assert list(run.figures["challenge"]["gpus"]) == ["1"]
    event = NodeEvent.objects.get(node=node, kind="failed_while_rented")
    assert event.level == NodeEvent.Level.CRITICAL
    instance.refresh_from_db()
    assert instance.status == "running"
    assert "failed its latest benchmark check (challenge_wrong_result, wrong_results)" in instance.status_message
    # Its renter leaves; the schedule re-verifies the node, which now leaves the active state.
    instance_svc.instance_mark_failed(instance_id=instance.pk, message="gone")
    assert nodes_reverify_due()["queued"] == 1
    job = job_begin(job_id=Job.objects.get(node=node, kind=JobKind.NODE_VERIFY, status=JobStatus.QUEUED).pk)
    node_verify_run(job=job)
    node.refresh_from_db()
    assert (node.state, node.verdict) == ("rejected", "rejected")


def test_with_every_gpu_rented_only_identity_is_checked(db, simnode, simbase):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    score = node.score
    rent(node, num_gpus=2)
    node, job = verify(node)
    run = node.verifications.first()
    assert (node.verdict, run.figures["rented_gpus"], node.score, run.score) == ("verified", [0, 1], score, None)
    assert "every GPU is rented" in " ".join(m["message"] for m in job.log)


def test_a_node_without_pytorch_is_rejected_with_a_reason_it_can_act_on(db, simnode, simbase, settings):
    # A sim node measures for real with device=cpu; its python3 (/usr/bin/python3 over SSH) has no PyTorch.
    node = register(simnode, simbase, "rtx-a4000-x2")
    key = node_private_key(node=node)
    with NodeSession(Endpoint(node.address, node.ssh_port, node.ssh_user, key, node.host_key_fingerprint)) as s:
        try:
            s.agent("benchmark", request={"device": "cpu", "quick": True}, timeout=60)
        except Exception as exc:  # noqa: BLE001
            error = exc
        else:
            pytest.skip("the sim node's python3 has PyTorch")
    assert error.code == "no_torch" and "pip install torch" in error.message


def hanging_profile() -> dict:
    data = profile_data("rtx-a4000-x2")
    data["performance"]["hang_s"] = 120
    return data


def test_a_hung_benchmark_fails_the_job_within_its_bound(db, simnode, simbase, settings):
    settings.BENCHMARK_TIME_LIMIT_S = 2
    node = register(simnode, simbase, hanging_profile())
    job = node_verify_request(node=node)
    started = time.monotonic()
    tasks.run_job(SimpleNamespace(request=SimpleNamespace(retries=0), max_retries=3), job.pk)
    elapsed = time.monotonic() - started
    job.refresh_from_db()
    node.refresh_from_db()
    assert elapsed < 2 + 5, elapsed
    assert job.status == JobStatus.FAILED and job.attempts == 1  # not retried
    assert "did not finish within 2 s" in job.error and "nvidia-smi" in job.error
    assert (node.state, node.verdict) == ("pending", "unverified") and "did not finish" in node.last_error
    assert NodeEvent.objects.filter(node=node, kind="verification_failed").exists()


def test_the_ssh_command_timeout_bounds_the_benchmark_even_if_the_agent_does_not(db, simnode, simbase):
    node = register(simnode, simbase, hanging_profile())
    endpoint = Endpoint(node.address, node.ssh_port, node.ssh_user, node_private_key(node=node),
                        node.host_key_fingerprint)
    started = time.monotonic()
    with NodeSession(endpoint, Timeouts(connect=5, command=60, attempts=1)) as session:
        with pytest.raises(AgentTimeout):
            session.agent("benchmark", request={"time_limit_s": 60}, timeout=1.5)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("step", ["command", "network test"])
def test_a_node_that_closes_its_output_but_never_exits_is_ended_by_the_step_bound(db, simnode, simbase, monkeypatch,
                                                                                   step):
    """paramiko's recv_exit_status() waits with no bound: a node whose command read its input (or closed its
    output) and then never exited held the check until Celery's hard limit (found by review). Real sshd: the
    command closes its stdout and stderr (the channel's EOF) and sleeps on."""
    from provisioning import ssh

    node = register(simnode, simbase, "rtx-a4000-x2")
    endpoint = Endpoint(node.address, node.ssh_port, node.ssh_user, node_private_key(node=node),
                        node.host_key_fingerprint)
    linger = "exec >&- 2>&-; sleep 20"
    started = time.monotonic()
    with NodeSession(endpoint, Timeouts(connect=5, command=60, attempts=1)) as session:
        with pytest.raises(AgentTimeout):
            if step == "command":
                session._exec(f"sh -c 'echo {{}}; {linger}'", b"", 1.5)
            else:
                monkeypatch.setattr(ssh, "NET_TEST_COMMAND", f"sh -c 'cat > /dev/null; {linger}'")
                session.upload_throughput(1 << 16, timeout=1.5)
    assert time.monotonic() - started < 10


def test_a_changed_inventory_queues_a_verification(db, simnode, simbase, settings):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    # Verified longer ago than its provider's verify cooldown: the change is checked at once (within it, at the
    # cooldown's end: tests/provisioning/test_verify_cooldown.py).
    Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY).update(
        finished_at=timezone.now() - timedelta(seconds=settings.NODE_VERIFY_COOLDOWN_S + 1))
    probe = node_health_probe(node)
    node_record_health(node_id=node.pk, ok=True, inventory_hash=probe.inventory_hash)
    assert not Job.objects.filter(node=node, status=JobStatus.QUEUED).exists()  # same GPUs: nothing to do
    capped = profile_data("rtx-a4000-x2")
    capped["nvidia_smi"][1] = capped["nvidia_smi"][1].replace("140.00, 140.00", "100.00, 140.00")
    use_hardware(simnode, capped)
    probe = node_health_probe(node)
    node_record_health(node_id=node.pk, ok=True, inventory_hash=probe.inventory_hash)
    job = Job.objects.get(node=node, status=JobStatus.QUEUED)
    assert job.kind == JobKind.NODE_VERIFY and "inventory changed" in job.step
    assert NodeEvent.objects.filter(node=node, kind="inventory_changed").exists()
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE  # re-verified in place: renters and offers are not disturbed meanwhile
    node, _ = verify(node)
    assert node.verdict == "degraded" and "power_capped" in {f["code"] for f in node.verifications.first().findings}


# ------------------------------------------------------------------------------ schedule and reliability

# The schedule of re-verifications (random times, spot checks): test_random_rechecks.py.

def test_the_beat_schedule_runs_the_reverification_task(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["nodes-reverify-due"]
    assert entry["task"] == "provisioning.tasks.nodes_reverify_due" and tasks.nodes_reverify_due.name == entry["task"]


def test_reliability_is_uptime_over_30_days_minus_failed_jobs(db):
    node = make_node(state=NodeState.ACTIVE, verdict="verified")
    now = timezone.now()
    assert nodes_reliability(node_ids=[node.pk], now=now) == {node.pk: 0.0}  # never checked
    for _ in range(95):
        node_record_health(node_id=node.pk, ok=True)
    for _ in range(5):
        node_record_health(node_id=node.pk, ok=False, error="timeout")
    assert HealthSample.objects.get(node=node).ok == 95  # one row per day, counted up
    node.refresh_from_db()
    assert node.reliability == pytest.approx(0.95)
    # Old days fall out of the window; failed instance jobs cost 0.02 each.
    HealthSample.objects.create(node=node, day=(now - timedelta(days=40)).date(), ok=0, failed=1000)
    for kind in (JobKind.INSTANCE_PROVISION, JobKind.INSTANCE_START, JobKind.NODE_VERIFY):
        Job.objects.create(kind=kind, node=node, status=JobStatus.FAILED, fault="node", deadline=now, finished_at=now)
    Job.objects.create(kind=JobKind.INSTANCE_START, node=node, status=JobStatus.FAILED, fault="node", deadline=now,
                       finished_at=now - timedelta(days=31))
    for fault in ("platform", "renter"):  # failures that are not the node's do not count (Job.fault)
        Job.objects.create(kind=JobKind.INSTANCE_PROVISION, node=node, status=JobStatus.FAILED, fault=fault,
                           deadline=now, finished_at=now)
    assert nodes_reliability(node_ids=[node.pk], now=timezone.now())[node.pk] == pytest.approx(0.95 - 2 * 0.02)


def test_the_check_records_bf16_per_watt_drawn_under_load_and_offers_show_it(db, simnode, simbase):
    from rest_framework.test import APIClient
    node, job = verify(register(simnode, simbase, "rtx-a4000-x2"))
    assert node.verdict == "verified", job.error
    run = VerificationRun.objects.get(node=node)
    drawn = {g["index"]: g["telemetry"]["power_draw_w"] for g in profile_data("rtx-a4000-x2")["performance"]["gpus"]}
    for gpu in run.figures["gpus"]:  # the benchmark's own BF16 figure over the sim's power under load
        assert gpu["power_draw_w"] == drawn[gpu["index"]]
        assert gpu["bf16_tflops_per_w"] == pytest.approx(gpu["bf16_tflops"] / drawn[gpu["index"]], rel=1e-4)
    per_w = run.figures["median"]["bf16_tflops_per_w"]
    assert per_w and node.benchmark_summary["median_per_gpu"]["bf16_tflops_per_w"] == per_w
    node.price_per_gpu_hour_micros = 300_000
    node.save(update_fields=["price_per_gpu_hour_micros"])
    offers = APIClient().get("/api/v1/offers/", {"gpu_model": "rtx-a4000"}).json()["results"]
    offer = next(o for o in offers if o["id"] == node.pk)
    assert offer["benchmark"]["median_per_gpu"]["bf16_tflops_per_w"] == per_w


def test_the_check_reads_nvlink_islands_measures_p2p_and_offers_show_and_filter_it(db, simnode, simbase):
    from rest_framework.test import APIClient
    node, job = verify(register(simnode, simbase, "a100-80gb-sxm-x8-nvlink-islands"))
    assert node.verdict == "verified", job.error
    run = VerificationRun.objects.get(node=node)
    assert run.inventory["topology"]["nvlink_islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(run.figures["p2p"]) == 28  # every pair of the eight GPUs copied
    across = [p["gbs"] for p in run.figures["p2p"] if (p["a"] < 4) != (p["b"] < 4)]
    within = [p["gbs"] for p in run.figures["p2p"] if (p["a"] < 4) == (p["b"] < 4)]
    assert max(across) < 30 < 150 < min(within)  # PCIe between the boards, NVLink on each
    summary = node.benchmark_summary["nvlink"]
    assert summary["connected"] and summary["links_per_gpu"] == 12 and summary["p2p_gbs"] > 150
    node.price_per_gpu_hour_micros = 1_000_000
    node.save(update_fields=["price_per_gpu_hour_micros"])
    plain = make_listed_node(gpu_model="rtx-a4000", gpu_count=2)  # one sim server per module: a listed PCIe node
    plain.benchmark_summary = {"verdict": "verified", "findings": [], "median_per_gpu": {},
                               "nvlink": {"connected": False, "islands": [], "links_per_gpu": None, "p2p_gbs": 19.6,
                                          "pcie_p2p_gbs": 19.6}}
    plain.save(update_fields=["benchmark_summary"])
    client = APIClient()
    offers = {o["id"]: o for o in client.get("/api/v1/offers/").json()["results"]}
    assert offers[node.pk]["nvlink"] is True and offers[node.pk]["benchmark"]["nvlink"]["islands"] == [
        [0, 1, 2, 3], [4, 5, 6, 7]]
    assert offers[plain.pk]["nvlink"] is False
    assert [o["id"] for o in client.get("/api/v1/offers/", {"nvlink": "true"}).json()["results"]] == [node.pk]
    assert plain.pk in [o["id"] for o in client.get("/api/v1/offers/", {"nvlink": "false"}).json()["results"]]
