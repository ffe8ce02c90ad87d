"""The worker-side instance services (called by the provisioning tasks) and the operators' admin actions."""
import pytest
from django.urls import reverse

from marketplace.models import Gpu, GpuAllocation, GpuStatus, Instance, InvalidTransition, Node
from marketplace.models.renting import INSTANCE_TRANSITIONS, InstanceStatus
from marketplace.services import instances as svc
from provisioning.models import Job, JobKind
from tests.factories import UserFactory, make_listed_node

from .renting_helpers import add_key, book, gpu_indices, run, sent_jobs_fixture, snapshot  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.fixture
def node():
    return make_listed_node(gpu_count=4)


@pytest.fixture
def inst(node, user):
    return book(user, node, num_gpus=2)


def free_count(node) -> int:
    return Gpu.objects.filter(node=node, status=GpuStatus.FREE).count()


def test_mark_provisioning_is_idempotent_and_none_when_not_expected(inst):
    first = svc.instance_mark_provisioning(instance_id=inst.pk)
    second = svc.instance_mark_provisioning(instance_id=inst.pk)
    assert first.status == second.status == "provisioning"
    assert second.status_message == "Creating the VM on the node"
    assert svc.instance_mark_provisioning(instance_id=999_999) is None
    svc.instance_destroy(instance=inst)
    assert svc.instance_mark_provisioning(instance_id=inst.pk) is None


def test_mark_running_sets_the_address_and_times_and_is_idempotent(inst):
    svc.instance_mark_provisioning(instance_id=inst.pk)
    a = svc.instance_mark_running(instance_id=inst.pk, ssh_host="h", ssh_port=2222, ssh_user="root",
                                  message="Running on GPUs 0, 1")
    b = svc.instance_mark_running(instance_id=inst.pk, ssh_host="h", ssh_port=2222, ssh_user="root")
    assert a.status == b.status == "running" and b.started_at == a.started_at and b.stopped_at is None
    assert (b.ssh_host, b.ssh_port, b.ssh_user) == ("h", 2222, "root")
    assert b.status_message == "Running on GPUs 0, 1"


def test_mark_running_refuses_an_instance_being_destroyed(inst):
    svc.instance_mark_provisioning(instance_id=inst.pk)
    svc.instance_destroy(instance=inst)
    with pytest.raises(InvalidTransition):
        svc.instance_mark_running(instance_id=inst.pk, ssh_host="h", ssh_port=1, ssh_user="u")
    assert Instance.objects.get(pk=inst.pk).status == "destroying"


def test_mark_stopped_frees_gpus_and_is_idempotent(inst, node):
    run(inst)
    svc.instance_stop(instance=inst)
    first = svc.instance_mark_stopped(instance_id=inst.pk, message="Stopped by you")
    second = svc.instance_mark_stopped(instance_id=inst.pk)
    assert first.status == second.status == "stopped" and second.stopped_at == first.stopped_at
    assert second.status_message == "Stopped by you"
    assert free_count(node) == 4 and gpu_indices(second) == []
    assert GpuAllocation.objects.filter(instance=inst, released_at__isnull=False).count() == 2


def test_a_failed_start_goes_back_to_stopped_and_frees_the_gpus(inst, node):
    run(inst)
    svc.instance_stop(instance=inst)
    svc.instance_mark_stopped(instance_id=inst.pk)
    svc.instance_start(instance=inst)
    assert free_count(node) == 2
    stopped = svc.instance_mark_stopped(instance_id=inst.pk, message="The VM did not start: no space left")
    assert stopped.status == "stopped" and free_count(node) == 4


@pytest.mark.parametrize("taken_by", ["lost", "out_of_service", "another_instance"])
def test_a_container_whose_card_is_not_free_is_refused_a_start_that_says_why(user, taken_by):
    """A container starts only on its own GPUs: the refusal names which of them is not free and why (it said "in
    use by another instance" for a card its health check lost, where waiting never helps)."""
    from django.utils import timezone

    from core.errors import Conflict

    node = make_listed_node(gpu_count=3, runtime="docker")
    inst = book(user, node, num_gpus=2)
    run(inst)
    svc.instance_stop(instance=inst)
    svc.instance_mark_stopped(instance_id=inst.pk)
    card = Gpu.objects.get(node=node, index=1)
    if taken_by == "another_instance":
        Gpu.objects.filter(node=node, index__in=[0, 2]).update(status=GpuStatus.UNAVAILABLE)  # it takes card 1
        book(UserFactory(), node, num_gpus=1)
        Gpu.objects.filter(node=node, index=0).update(status=GpuStatus.FREE)
        assert Gpu.objects.get(pk=card.pk).status == GpuStatus.RENTED
    else:
        Gpu.objects.filter(pk=card.pk).update(
            status=GpuStatus.UNAVAILABLE, lost_at=timezone.now() if taken_by == "lost" else None)
    with pytest.raises(Conflict) as refused:
        svc.instance_start(instance=Instance.objects.get(pk=inst.pk))
    message = str(refused.value.message)
    assert message.startswith("A container can only start on the GPUs it was created with, and GPU 1 is ")
    assert {"lost": "missing from its server (its health check lost it)",
            "out_of_service": "out of service (it failed a check, or its provider took it out)",
            "another_instance": "rented by another instance now"}[taken_by] in message
    assert ("Try again later" in message) == (taken_by == "another_instance")
    assert Instance.objects.get(pk=inst.pk).status == "stopped"
    assert Gpu.objects.get(node=node, index=0).status == GpuStatus.FREE  # nothing half-taken


def test_mark_stopped_from_running_is_refused(inst):
    run(inst)
    with pytest.raises(InvalidTransition):
        svc.instance_mark_stopped(instance_id=inst.pk)


def test_mark_destroyed_is_idempotent_and_refused_unless_destroying(inst, node):
    with pytest.raises(InvalidTransition):
        svc.instance_mark_destroyed(instance_id=inst.pk)
    run(inst)
    svc.instance_destroy(instance=inst)
    assert free_count(node) == 2  # held until the node confirms
    first = svc.instance_mark_destroyed(instance_id=inst.pk)
    second = svc.instance_mark_destroyed(instance_id=inst.pk)
    assert first.status == second.status == "destroyed" and second.destroyed_at == first.destroyed_at
    assert second.stopped_at is not None  # it was running: the clock stopped
    assert free_count(node) == 4


@pytest.mark.parametrize("reach", ["requested", "provisioning", "running", "stopping", "starting", "destroying",
                                   "stopped"])
def test_mark_failed_from_any_live_state_releases_gpus(inst, node, reach):
    steps = {
        "provisioning": [lambda: svc.instance_mark_provisioning(instance_id=inst.pk)],
        "running": [lambda: run(inst)],
        "stopping": [lambda: run(inst), lambda: svc.instance_stop(instance=inst)],
        "starting": [lambda: run(inst), lambda: svc.instance_restart(instance=inst)],
        "destroying": [lambda: svc.instance_destroy(instance=inst)],
        "stopped": [lambda: run(inst), lambda: svc.instance_stop(instance=inst),
                    lambda: svc.instance_mark_stopped(instance_id=inst.pk)],
    }.get(reach, [])
    for step in steps:
        step()
    assert Instance.objects.get(pk=inst.pk).status == reach
    failed = svc.instance_mark_failed(instance_id=inst.pk, message="Node unreachable")
    assert failed.status == "failed" and failed.status_message == "Node unreachable"
    assert free_count(node) == 4 and gpu_indices(failed) == []
    again = svc.instance_mark_failed(instance_id=inst.pk, message="second reason")
    assert again.status == "failed" and again.status_message == "Node unreachable"


def test_mark_failed_leaves_destroyed_alone(inst):
    svc.instance_destroy(instance=inst)
    svc.instance_mark_destroyed(instance_id=inst.pk)
    assert svc.instance_mark_failed(instance_id=inst.pk, message="x").status == "destroyed"


def test_status_message_changes_no_state_and_not_once_final(inst):
    svc.instance_set_status_message(instance_id=inst.pk, message="Pulling the image " + "x" * 600)
    got = Instance.objects.get(pk=inst.pk)
    assert got.status == "requested" and got.status_message.startswith("Pulling") and len(got.status_message) == 500
    svc.instance_mark_failed(instance_id=inst.pk, message="boom")
    svc.instance_set_status_message(instance_id=inst.pk, message="late progress")
    assert Instance.objects.get(pk=inst.pk).status_message == "boom"


def test_release_keeps_gpus_marked_unavailable(inst, node):
    Gpu.objects.filter(node=node, index=0).update(status=GpuStatus.UNAVAILABLE)
    svc.instance_mark_failed(instance_id=inst.pk, message="GPU 0 fell off the bus")
    assert list(Gpu.objects.filter(node=node).order_by("index").values_list("status", flat=True)) == [
        "unavailable", "free", "free", "free"]


def test_restart_keeps_the_gpus(inst):
    run(inst)
    svc.instance_restart(instance=inst)
    assert gpu_indices(inst) == [0, 1]
    assert Job.objects.filter(instance=inst, kind=JobKind.INSTANCE_RESTART).exists()


def test_every_status_is_in_the_transition_table():
    assert set(INSTANCE_TRANSITIONS) == set(InstanceStatus.values)
    assert INSTANCE_TRANSITIONS[InstanceStatus.DESTROYED] == set()


def test_gpu_indices_without_prefetch(inst):
    assert svc.instance_gpu_indices(instance=Instance.objects.get(pk=inst.pk)) == [0, 1]


def test_request_fingerprint_is_canonical():
    assert svc.request_fingerprint({"a": 1, "b": [1, 2]}) == svc.request_fingerprint({"b": [1, 2], "a": 1})
    assert svc.request_fingerprint({"a": 1}) != svc.request_fingerprint({"a": 2})


# ---------------------------------------------------------------------------------- admin


@pytest.fixture
def admin_client(client):
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client


def test_admin_pages_render(admin_client, inst):
    key = add_key(inst.renter)
    for url in (
        reverse("admin:marketplace_instance_changelist"),
        reverse("admin:marketplace_instance_change", args=[inst.pk]),
        reverse("admin:marketplace_sshkey_changelist"),
        reverse("admin:marketplace_sshkey_change", args=[key.pk]),
        reverse("admin:marketplace_image_changelist"),
    ):
        assert admin_client.get(url).status_code == 200, url
    page = admin_client.get(reverse("admin:marketplace_instance_change", args=[inst.pk])).content.decode()
    assert "GPU 0 of node" in page  # the allocations inline


def test_admin_force_stop_and_destroy_call_the_services(admin_client, inst, node):
    running = run(book(UserFactory(), node, num_gpus=1))
    url = reverse("admin:marketplace_instance_changelist")
    r = admin_client.post(url, {"action": "force_stop", "_selected_action": [inst.pk, running.pk]}, follow=True)
    assert r.status_code == 200
    assert Instance.objects.get(pk=running.pk).status == "stopping"
    assert Instance.objects.get(pk=inst.pk).status == "requested"  # refused, with the reason shown
    assert "still being provisioned" in r.content.decode()
    admin_client.post(url, {"action": "force_destroy", "_selected_action": [inst.pk, running.pk]})
    assert set(Instance.objects.filter(pk__in=[inst.pk, running.pk]).values_list("status", flat=True)) == {
        "destroying"}
    assert Job.objects.filter(kind=JobKind.INSTANCE_DESTROY).count() == 2


def test_operators_cannot_add_or_delete_instances_in_the_admin(admin_client, inst):
    assert admin_client.get(reverse("admin:marketplace_instance_add")).status_code == 403
    assert admin_client.get(reverse("admin:marketplace_instance_delete", args=[inst.pk])).status_code == 403


def test_snapshot_helper_sees_changes(inst):
    before = snapshot()
    svc.instance_set_status_message(instance_id=inst.pk, message="changed")
    assert snapshot() != before


@pytest.fixture
def ssh_banner():
    """A port that answers with an SSH banner, as a VM's sshd does (what the provisioning waits for)."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def on_loopback(instance: Instance) -> Instance:
    """The instance's node at 127.0.0.1, where the banner answers: a node may name loopback addresses for its VMs
    only when it is on loopback itself (provisioning.services.vms.vm_address)."""
    Node.objects.filter(pk=instance.node_id).update(address="127.0.0.1")
    return Instance.objects.select_related("node").get(pk=instance.pk)


@pytest.mark.parametrize("then", ["destroying", "destroyed"])
def test_a_destroy_asked_while_the_vm_comes_up_is_left_to_the_destroy_not_failed(inst, ssh_banner, then):
    """DELETE while provisioning (or starting, restarting): the VM comes up and its job cannot mark the
    instance running. Before, that InvalidTransition failed the instance (and stopped the VM), so the destroy
    job found it failed and did nothing; now the job ends quietly and the destroy goes on."""
    from provisioning.models import JobStatus
    from provisioning.services import vms

    svc.instance_mark_provisioning(instance_id=inst.pk)
    job = Job.objects.get(instance=inst, kind=JobKind.INSTANCE_PROVISION)
    svc.instance_destroy(instance=inst)
    if then == "destroyed":  # the destroy's job already ran
        svc.instance_mark_destroyed(instance_id=inst.pk)
    answer = {"ssh_host": "127.0.0.1", "ssh_port": ssh_banner, "ssh_user": "root"}
    vms._running(job, on_loopback(inst), answer, "Running")
    assert Instance.objects.get(pk=inst.pk).status == then
    job.refresh_from_db()
    assert job.status == JobStatus.SUCCEEDED
    said = [line["message"] for line in job.log]
    if then == "destroying":  # the destroy job, which waits for this one, removes the VM
        assert "a destroy was asked meanwhile: the VM is left to its job" in said
    else:  # its destroy is over: this job removes the VM it made (the node here never answers: the reconciler)
        assert "the instance was destroyed meanwhile: removing the VM" in said
        assert any(m.startswith("the VM could not be removed now") for m in said)
    assert Job.objects.filter(instance=inst, kind=JobKind.INSTANCE_DESTROY).exists()


def test_a_vm_that_comes_up_for_an_instance_in_another_wrong_state_still_fails_the_job(inst, ssh_banner):
    from provisioning.services import vms

    job = Job.objects.get(instance=inst, kind=JobKind.INSTANCE_PROVISION)  # never marked provisioning
    Instance.objects.filter(pk=inst.pk).update(status="stopped")
    with pytest.raises(InvalidTransition):
        vms._running(job, on_loopback(inst), {"ssh_host": "127.0.0.1", "ssh_port": ssh_banner, "ssh_user": "root"},
                     "Running")
