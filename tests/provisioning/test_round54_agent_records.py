"""Review r54 #3: the agent's VM records. core.write_file neither synced the file before its rename nor the folder
after it, so a vm.json written shortly before a power loss could come back empty; and an unreadable vm.json was
taken as no VM: `vm list` and the health answer left it out (the platform interrupted and failed its instance as a
VM gone, while docker's unless-stopped restarted the container on its GPUs), and its container was listed as an
unrecorded one. Now write_file syncs both, and an unreadable record is a VM in state "unknown" with the reason
(which the platform leaves unjudged, its GPUs held), refused by start/stop, removed only by a destroy."""
import os

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent import core, records
from provisioning.services.nodes import VM_UNKNOWN
from tests.provisioning.test_agent_docker import node  # noqa: F401 - fixture


def test_write_file_syncs_the_file_before_its_rename_and_then_the_folder(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(core.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                      real_fsync(fd))[1])
    monkeypatch.setattr(core.os, "replace", lambda a, b: (events.append(("replace", a, b)), real_replace(a, b))[1])
    path = str(tmp_path / "vm.json")
    core.write_file(path, '{"a": 1}')
    assert events == [("fsync", path + ".tmp"), ("replace", path + ".tmp", path), ("fsync", str(tmp_path))]
    assert open(path).read() == '{"a": 1}'


@pytest.mark.parametrize("content", ["", '{"vm_id": "inst-1", "spe', "null", '{"vm_id": "inst-2", "spec": {}}'],
                         ids=["empty", "cut-short", "null", "another-vms"])
def test_an_unreadable_record_is_no_vm_not_taken_as_none(tmp_path, content):
    cfg = agent.Config({"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path)})
    (tmp_path / "vms" / "inst-1").mkdir(parents=True)
    assert records.load_record(cfg, "inst-1") is None  # a folder without vm.json: no record
    (tmp_path / "vms" / "inst-1" / "vm.json").write_text(content)
    with pytest.raises(agent.AgentError) as raised:
        records.load_record(cfg, "inst-1")
    assert raised.value.code == "record_unreadable" and "inst-1" in raised.value.message
    assert records.scan_records(cfg)[0] == [] and list(records.scan_records(cfg)[1]) == ["inst-1"]


def test_a_vm_whose_record_was_emptied_is_unknown_everywhere_until_destroyed(node, tmp_path):  # noqa: F811
    assert node.create("inst-1", [0])["state"] == "running"
    assert node.create("inst-2", [1])["state"] == "running"
    record = str(tmp_path / "state" / "vms" / "inst-1" / "vm.json")  # the node fixture's state folder
    open(record, "w").close()  # zero-length after a power loss

    listed = node.call("vm list", {})["vms"]
    assert [(v["vm_id"], v["state"]) for v in listed] == [("inst-2", "running"), ("inst-1", VM_UNKNOWN)]
    assert "cannot be read" in listed[1]["error"]  # and not also listed as an unrecorded container to remove
    health = node.call("health", {})
    assert health["vms"] == {"inst-1": VM_UNKNOWN, "inst-2": "running"}
    assert "cannot be read" in health["vm_errors"]["inst-1"]
    status = node.call("vm status", {"vm_id": "inst-1"})
    assert (status["ok"], status["state"]) == (True, VM_UNKNOWN), status
    for verb in ("vm start", "vm stop", "vm logs"):
        answer = node.call(verb, {"vm_id": "inst-1"})
        assert answer["error"]["code"] == "record_unreadable", (verb, answer)
    kept = node.call("vm destroy", {"vm_id": "inst-1", "only_if_missing": True})
    assert kept["error"]["code"] == "record_unreadable"
    create = node.create("inst-1", [0])
    assert create["error"]["code"] == "record_unreadable"  # never written over
    assert ["rm", "-f", "-v", "gpumarket-inst-1"] not in node.docker_calls()

    assert node.call("vm destroy", {"vm_id": "inst-1"})["existed"] is True
    assert ["rm", "-f", "-v", "gpumarket-inst-1"] in node.docker_calls()
    assert not os.path.exists(os.path.dirname(record))
    assert node.states() == {"inst-2": "running"}
