"""A health answer passes only when it shows the node able to host its VMs (provisioning.verification.health_answer,
used by provisioning.services.nodes.health_result): before, any answer passed, and a node whose runtime was down,
whose agent could not list its VMs, or whose agent answered {"ok": true} alone kept its renters billed."""
import json
from pathlib import Path

import pytest
from django.utils import timezone

from provisioning import sim
from provisioning.services.nodes import health_result, node_health_probe
from provisioning.verification.health_answer import health_problem
from tests.factories import make_listed_node


def answer(**fields):
    base = {"runtime": "sim", "runtime_ok": True, "runtime_detail": "sim: ok", "gpu_count": 2, "gpu_error": None,
            "inventory_hash": "0123456789abcdef", "gpu_uuids": ["GPU-a", "GPU-b"], "vms": {"inst-1": "running"}}
    return {**base, **fields}


def test_a_whole_answer_passes():
    assert health_problem(answer(), runtime="sim") == ""
    assert health_problem(answer(vms={}), runtime="docker") == ""


@pytest.mark.parametrize("body, said", [
    ({"ok": True}, "runtime does not work (no detail)"),  # a tampered agent: no runtime word, no VM list
    (answer(vms=None), "could not list the sim runtime's VMs"),
    (answer(runtime_ok=False, runtime_detail="Cannot connect to the Docker daemon"), "Cannot connect to the Docker"),
    (answer(runtime_ok=None), "runtime does not work"),
    (answer(vms=["inst-1"]), "vms is not an object"),
    (answer(vms={"inst-1": 3}), "vms.inst-1 is not a state"),
    (answer(vms={"x" * 65: "running"}), "longer than 64"),
    (answer(gpu_uuids="GPU-a"), "gpu_uuids is not a list"),
    (answer(gpu_uuids=["GPU-a", 7]), "gpu_uuids[1] is not a GPU UUID"),
    (answer(inventory_hash=5), "inventory_hash is not a string"),
    (answer(runtime_ok="yes"), "runtime_ok is not true or false"),
    (answer(gpu_error="NVIDIA-SMI has failed", gpu_uuids=None), "nvidia-smi failed (NVIDIA-SMI has failed)"),
    (answer(gpu_uuids=None), "does not list the GPUs"),
    (answer(runtime_detail="a\x00b"), "NUL"),
    ([], "the answer is not an object"),
    ("healthy", "the answer is not an object"),
])
def test_an_answer_that_does_not_vouch_for_the_node_fails_the_check(body, said):
    problem = health_problem(body, runtime="sim")
    assert said in problem, problem


def test_where_the_vms_hold_the_cards_the_hosts_nvidia_smi_is_not_asked_for_them():
    """libvirt binds a rented card to vfio-pci: the host's nvidia-smi no longer lists it, or fails with none left."""
    assert health_problem(answer(gpu_error="No devices were found", gpu_uuids=None), runtime="libvirt") == ""
    assert "nvidia-smi failed" in health_problem(answer(gpu_error="No devices were found", gpu_uuids=None),
                                                 runtime="docker")


def test_health_result_turns_a_bad_answer_into_a_failed_check_naming_why(db):
    node = make_listed_node(runtime="docker")
    now = timezone.now()
    bad = health_result(node, answer(vms=None, runtime="docker"), seconds=0.1, probed_at=now)
    assert not bad.ok and bad.error.startswith("The node answers, but its agent could not list")
    good = health_result(node, answer(runtime="docker"), seconds=0.1, probed_at=now)
    assert good.ok and good.vms == {"inst-1": "running"} and good.gpu_uuids == ["GPU-a", "GPU-b"]
    libvirt = make_listed_node(runtime="libvirt")
    assert health_result(libvirt, answer(), seconds=0.1, probed_at=now).gpu_uuids is None  # not judged there


@pytest.mark.slow
def test_a_sim_server_whose_runtime_breaks_fails_its_health_check_over_ssh(db, tmp_path):
    """The agent's own answer, over SSH: the sim runtime cannot read its profile (what its VMs are made from)."""
    from tests.provisioning.test_duplicate_nodes import register

    info = sim.node_up("rtx-a4000-x2", tmp_path)
    try:
        node = register(info, tmp_path)
        healthy = node_health_probe(node)
        assert healthy.ok, healthy.error
        assert len(healthy.gpu_uuids) == 2 and healthy.vms == {}
        profile = Path(info["node_dir"]) / "profile.json"
        data = json.loads(profile.read_text())
        profile.write_text("{not json")
        broken = node_health_probe(node)
        assert not broken.ok and "runtime does not work" in broken.error, broken.error
        profile.write_text(json.dumps(data))
        assert node_health_probe(node).ok
    finally:
        sim.nodes_down(tmp_path)
