"""Review r54 own MEDIUM-2 (on c9b210d): a VM whose record (vm.json) cannot be read was left out of every GPU, port
and volume check on the agent (records.all_records gave the readable records only), while its container ran on
(docker's unless-stopped). The next `vm create` was given its GPU and its SSH host port, and `volume delete` deleted
the volume it mounts. Now, while any record cannot be read, create, start and volume delete (and volume list, whose
"used_by" the platform's orphan sweep trusts) are refused with record_unreadable naming that record."""
import json

from tests.provisioning.test_agent_docker import node  # noqa: F401 - fixture


def _empty_record(tmp_path, vm_id):
    open(str(tmp_path / "state" / "vms" / vm_id / "vm.json"), "w").close()  # zero-length after a power loss


def _refused(answer):
    error = answer.get("error") or {}
    assert error.get("code") == "record_unreadable", answer
    assert "inst-1" in error["message"] and "cannot be read" in error["message"], answer


def test_gpus_of_a_vm_with_an_unreadable_record_are_not_given_to_another(node, tmp_path):  # noqa: F811
    assert node.create("inst-1", [0])["state"] == "running"
    _empty_record(tmp_path, "inst-1")
    _refused(node.create("inst-3", [0]))
    assert not (tmp_path / "state" / "vms" / "inst-3").exists()


def test_port_of_a_vm_with_an_unreadable_record_is_not_reused(node, tmp_path):  # noqa: F811
    first = node.create("inst-1", [0])
    assert first["ssh_port"] == 41000
    _empty_record(tmp_path, "inst-1")
    second = node.create("inst-3", [1])
    assert second.get("ssh_port") != first.get("ssh_port")
    _refused(second)


def test_start_and_volume_delete_wait_for_the_unreadable_record(node, tmp_path):  # noqa: F811
    assert node.call("volume create", {"name": "vol-abcdefgh", "size_gb": 5})["created"] is True
    assert node.create("inst-1", [0], volumes=[{"name": "vol-abcdefgh", "mount": "/data"}])["state"] == "running"
    assert node.create("inst-2", [1])["state"] == "running"
    assert node.call("vm stop", {"vm_id": "inst-2"})["state"] == "stopped"  # stop frees nothing: not refused
    _empty_record(tmp_path, "inst-1")
    _refused(node.call("vm start", {"vm_id": "inst-2", "gpu_indices": [0]}))
    _refused(node.call("vm start", {"vm_id": "inst-2"}))
    _refused(node.call("volume delete", {"name": "vol-abcdefgh"}))
    _refused(node.call("volume list", {}))
    assert (tmp_path / "state" / "volumes").exists() and node.states()["inst-2"] == "stopped"
    record = json.loads((tmp_path / "state" / "vms" / "inst-2" / "vm.json").read_text())
    assert record["spec"]["gpu_indices"] == [1]  # not moved onto the unknown VM's card
    # Destroying the unknown VM (or restoring its record) lets the node hand things out again.
    assert node.call("vm destroy", {"vm_id": "inst-1"})["existed"] is True
    assert node.call("vm start", {"vm_id": "inst-2"})["state"] == "running"
    assert node.call("volume delete", {"name": "vol-abcdefgh"})["deleted"] is True
