"""libvirt hands a running VM's cards to it (managed VFIO hostdevs): the host's nvidia-smi stops listing them and
numbers the rest anew, or finds no device at all once every card is handed out. The agent judges a libvirt VM's
cards by UUID: a card nvidia-smi lists (at any index) is there, one it does not list is held by one of our VMs
(another: gpu_busy; the same, running: a retried start or create answers its state) or gone (gpu_missing). Through
agent.handle, against stand-in virsh, nvidia-smi, qemu-img and genisoimage commands. (docker's cards:
test_agent_gpu_uuids.py.)"""
import json
import os
import sys
import xml.etree.ElementTree as ET

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.allocation import holds_gpus
from tests.provisioning.sshkit import new_keypair
from tests.provisioning.test_agent_docker import SAMPLES
from tests.provisioning.test_agent_gpu_uuids import A, B, C, D

KEY = new_keypair()[1]

# Domains in a JSON file: {name: {"state": ..., "hostdevs": [[domain, bus, slot, function], ...]}}; `start` hands the
# domain's hostdevs out of the host's view, as libvirt's managed hostdevs do.
FAKE_VIRSH = r'''#!PYTHON
import json, os, sys
import xml.etree.ElementTree as ET
path = os.environ["FAKE_VIRSH_STATE"]
doms = json.load(open(path)) if os.path.exists(path) else {}
verb, args = sys.argv[3], sys.argv[4:]
def fail(msg):
    sys.stderr.write(msg + "\n")
    sys.exit(1)
# A transient lookup failure (libvirtd or virtqemud restarting, a keepalive timeout, an ACL denial) while the file
# FAKE_VIRSH_GLITCH names exists: virsh prints the same words as for a domain that is not there, since it resets
# libvirt's own error first (tools/virsh-util.c, virshLookupDomainInternal). "list" in the file: the list fails too;
# "only=<name>": only that domain's lookups fail.
glitch = os.environ.get("FAKE_VIRSH_GLITCH", "")
if glitch and os.path.exists(glitch):
    how = open(glitch).read()
    if verb == "list" and "list" in how:
        fail("error: failed to connect to the hypervisor")
    if verb not in ("list", "version", "define") and (not how.startswith("only=") or args[0] == how[5:]):
        fail("error: failed to get domain '%s'" % args[0])
if verb == "define":
    dom = ET.parse(args[0]).getroot()
    devs = [[int(a.get(k), 16) for k in ("domain", "bus", "slot", "function")]
            for a in dom.findall("devices/hostdev/source/address")]
    name = dom.findtext("name")
    doms[name] = {"state": doms.get(name, {}).get("state", "shut off"), "hostdevs": devs,
                  "vcpu": dom.findtext("vcpu"), "memory": dom.findtext("memory")}
elif verb == "list":
    print("\n".join(sorted(doms)))
elif verb == "version":
    print("Running against daemon: 9.0.0")
elif args[0] not in doms:
    fail("error: failed to get domain '%s'" % args[0])
elif verb == "domstate":
    print(doms[args[0]]["state"])
elif verb == "start":
    if doms[args[0]]["state"] == "running":
        fail("error: Domain is already active")
    doms[args[0]]["state"] = "running"
elif verb in ("shutdown", "destroy"):
    doms[args[0]]["state"] = "shut off"
elif verb == "undefine":
    del doms[args[0]]
json.dump(doms, open(path, "w"))
'''

# The host's nvidia-smi: the node's cards less those a running domain holds, numbered anew from 0.
FAKE_NVIDIA_SMI = r'''#!PYTHON
import json, os, sys
if not sys.argv[1:] or not sys.argv[1].startswith("--query-gpu="):
    sys.stdout.write(open(os.environ["FAKE_SMI_TABLE"]).read())
    sys.exit(0)
path = os.environ["FAKE_VIRSH_STATE"]
doms = json.load(open(path)) if os.path.exists(path) else {}
held = {tuple(h) for d in doms.values() if d["state"] == "running" for h in d["hostdevs"]}
rows = []
for line in open(os.environ["FAKE_SMI_CSV"]).read().splitlines():
    cells = [c.strip() for c in line.split(",")]
    domain, bus, rest = cells[4].split(":")
    slot, function = rest.split(".")
    if (int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16)) not in held:
        rows.append(cells)
if not rows:
    print("No devices were found")
    sys.exit(6)
for n, cells in enumerate(rows):
    print(", ".join([str(n)] + cells[1:]))
'''

TOUCH_OVERLAY = "#!/bin/sh\nwhile [ $# -gt 2 ]; do shift; done\n: > \"$1\"\n"  # qemu-img create ... <overlay> <size>
TOUCH_OUTPUT = "#!/bin/sh\n: > \"$2\"\n"  # genisoimage -output <iso> ...


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A libvirt node with the four cards of SAMPLES/a100_sxm4_80gb_x4.csv (A, B, C, D at indices 0-3)."""
    fakebin, images = tmp_path / "bin", tmp_path / "images"
    fakebin.mkdir()
    images.mkdir()
    (images / "ubuntu-22.04.qcow2").write_text("")
    csv = tmp_path / "gpus.csv"
    csv.write_text((SAMPLES / "a100_sxm4_80gb_x4.csv").read_text())
    python = "#!" + sys.executable
    (fakebin / "virsh").write_text(FAKE_VIRSH.replace("#!PYTHON", python))
    (fakebin / "nvidia-smi").write_text(FAKE_NVIDIA_SMI.replace("#!PYTHON", python))
    (fakebin / "qemu-img").write_text(TOUCH_OVERLAY)
    (fakebin / "genisoimage").write_text(TOUCH_OUTPUT)
    for script in fakebin.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_VIRSH_STATE", str(tmp_path / "domains.json"))
    monkeypatch.setenv("FAKE_VIRSH_GLITCH", str(tmp_path / "virsh-glitch"))
    monkeypatch.setenv("FAKE_SMI_CSV", str(csv))
    monkeypatch.setenv("FAKE_SMI_TABLE", str(SAMPLES / "h100_sxm_x1_table.txt"))
    monkeypatch.setenv("GPUMARKET_DISK_TEST_MIB", "1")
    env = {"GPUMARKET_RUNTIME": "libvirt", "GPUMARKET_STATE_DIR": str(tmp_path / "state"),
           "GPUMARKET_PORT_RANGE": "42000-42999", "GPUMARKET_LIBVIRT_DIR": str(tmp_path / "domains"),
           "GPUMARKET_LIBVIRT_IMAGES": str(images)}

    class Node:
        state, cfg = tmp_path / "state", agent.Config(env)

        def call(self, command, req):
            return agent.handle(command.split(), json.dumps(req), env)[0]

        def create(self, vm_id, indices, uuids):
            return self.call("vm create", {"vm_id": vm_id, "gpu_indices": indices, "gpu_uuids": uuids,
                                           "ssh_public_keys": [KEY], "image": {"libvirt": "ubuntu-22.04"}})

        def listed(self):
            """The UUIDs the host's nvidia-smi lists now."""
            return [g["uuid"] for g in agent.read_gpus(agent.Config(env))[0]]

        def domains_running(self):
            return sum(len(d["hostdevs"]) for d in self.domains().values() if d["state"] == "running")

        def domains(self):
            return json.loads((tmp_path / "domains.json").read_text())

        def domain_xml(self, vm_id):
            return ET.parse(tmp_path / "domains" / vm_id / "domain.xml").getroot()  # noqa: S314 - our own

        def record(self, vm_id):
            return json.loads((tmp_path / "state" / "vms" / vm_id / "vm.json").read_text())

        def glitch(self, on=True, list_too=False):
            """virsh's lookups fail for a while, as while libvirtd restarts (FAKE_VIRSH_GLITCH above)."""
            flag = tmp_path / "virsh-glitch"
            if on:
                flag.write_text("list" if list_too else "")
            elif flag.exists():
                flag.unlink()

        def fall_off(self, uuid):
            csv.write_text("".join(line + "\n" for line in csv.read_text().splitlines() if uuid not in line))

    return Node()


def hostdev_buses(xml):
    return [a.get("bus") for a in xml.findall("devices/hostdev/source/address")]


def test_two_vms_run_on_one_libvirt_node_each_on_its_own_card(node, tmp_path):
    first = node.create("inst-1", [0], [A])
    assert first["state"] == "running", first
    assert (tmp_path / "domains" / "inst-1" / "disk.qcow2").exists()
    assert node.listed() == [B, C, D]  # A handed to inst-1: B is index 0 now
    second = node.create("inst-2", [1], [B])  # the reviewer's case: answered gpu_moved before
    assert second["state"] == "running", second
    assert hostdev_buses(node.domain_xml("inst-1")) == ["0x07"]
    assert hostdev_buses(node.domain_xml("inst-2")) == ["0x0f"]  # B's own address, not index 1's (C) now
    assert node.record("inst-2")["pci_bus_ids"] == {B: "00000000:0F:00.0"}
    assert node.listed() == [C, D]
    third = node.create("inst-3", [2, 3], [C, D])
    assert third["state"] == "running", third
    assert node.domains_running() == 4
    with pytest.raises(agent.AgentError, match="No devices were found"):
        node.listed()  # nvidia-smi finds no device now: not a failure to the libvirt runtime
    again = node.call("vm start", {"vm_id": "inst-3", "gpu_indices": [2, 3], "gpu_uuids": [C, D]})
    assert (again.get("error"), again["state"]) == (None, "running"), again
    assert [v["state"] for v in node.call("vm list", {})["vms"]] == ["running"] * 3


def test_a_retried_start_or_create_of_a_running_vm_answers_its_state(node):
    assert node.create("inst-1", [0], [A])["state"] == "running"
    assert node.create("inst-2", [1], [B])["state"] == "running"
    for start in ({"vm_id": "inst-2"}, {"vm_id": "inst-2", "gpu_indices": [1], "gpu_uuids": [B]}):
        again = node.call("vm start", start)  # the reviewer's case: answered gpu_missing before
        assert (again.get("error"), again["state"]) == (None, "running"), again
    again = node.create("inst-2", [1], [B])
    assert (again.get("error"), again["state"], again["created"]) == (None, "running", False), again
    assert node.record("inst-2")["pci_bus_ids"] == {B: "00000000:0F:00.0"}
    assert {n: d["state"] for n, d in node.domains().items()} == {
        "gpumarket-inst-1": "running", "gpumarket-inst-2": "running"}


def test_a_card_another_vm_of_ours_holds_is_busy_not_missing(node):
    assert node.create("inst-1", [0], [A])["state"] == "running"
    refused = node.create("inst-2", [0], [A])
    assert (refused["error"]["code"], refused["error"]["message"]) == (
        "gpu_busy", "GPU 0 is in use by another running VM"), refused
    assert not node.call("vm list", {})["vms"][1:]  # nothing recorded, no domain defined
    assert node.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    assert node.create("inst-2", [0], [A])["state"] == "running"  # a stopped VM holds no card
    refused = node.call("vm start", {"vm_id": "inst-1"})
    assert refused["error"]["code"] == "gpu_busy", refused
    assert node.call("vm status", {"vm_id": "inst-1"})["state"] == "stopped"


def test_a_card_that_is_gone_is_still_missing(node):
    assert node.create("inst-1", [0], [A])["state"] == "running"
    node.fall_off(C)
    refused = node.create("inst-3", [2], [C])
    assert refused["error"]["code"] == "gpu_missing", refused
    assert refused["error"]["message"] == f"GPU {C} (index 2 when it was allocated) is not on this node now " \
                                          "(fallen off the bus?)"
    assert node.create("inst-4", [3], [D])["state"] == "running"  # D is index 1 now: found by its UUID
    assert node.call("vm stop", {"vm_id": "inst-4"})["state"] == "stopped"
    node.fall_off(D)
    refused = node.call("vm start", {"vm_id": "inst-4"})  # a stopped VM's card is nobody's if not listed
    assert refused["error"]["code"] == "gpu_missing", refused
    assert node.call("vm status", {"vm_id": "inst-4"})["state"] == "stopped"


def test_the_share_counts_the_cards_our_vms_hold(node, tmp_path):
    """vCPUs and memory are shared by the node's four cards, not by the ones nvidia-smi still lists."""
    facts = agent.host_facts(agent.Config({"GPUMARKET_RUNTIME": "libvirt", "GPUMARKET_STATE_DIR": str(tmp_path)}))
    cores, ram = facts["cpu"]["cores"] or 1, facts["ram_mib"] or 4096
    one_of_four = agent.libvirt_share(cores, ram, 1, 4)
    assert one_of_four != agent.libvirt_share(cores, ram, 1, 3)  # so the test tells them apart
    assert node.create("inst-1", [0], [A])["state"] == "running"
    assert node.create("inst-2", [1], [B])["state"] == "running"
    assert node.create("inst-3", [3], [D])["state"] == "running"
    for vm_id in ("inst-1", "inst-2", "inst-3"):
        domain = node.domains()["gpumarket-" + vm_id]
        assert (int(domain["vcpu"]), int(domain["memory"])) == one_of_four, vm_id


def old_vm(node, vm_id, indices, addresses=True):
    """A VM created without gpu_uuids (as before the platform sent them), running; `addresses` False: its record
    from before pci_bus_ids too."""
    made = node.call("vm create", {"vm_id": vm_id, "gpu_indices": indices, "ssh_public_keys": [KEY],
                                   "image": {"libvirt": "ubuntu-22.04"}})
    assert made["state"] == "running", made
    if not addresses:
        path = node.state / "vms" / vm_id / "vm.json"
        rec = json.loads(path.read_text())
        del rec["pci_bus_ids"]
        path.write_text(json.dumps(rec))


@pytest.mark.parametrize("addresses", [True, False])
def test_a_running_vm_without_uuids_claims_no_card_nvidia_smi_lists(node, addresses):
    """Its cards are out of the host's view: the free card now at its old index is not its."""
    old_vm(node, "inst-1", [0], addresses)
    assert node.listed() == [B, C, D]  # B is index 0 now
    second = node.create("inst-2", [1], [B])  # the reviewer's case: answered gpu_busy (GPU 1) before
    assert (second.get("error"), second.get("state")) == (None, "running"), second
    assert hostdev_buses(node.domain_xml("inst-2")) == ["0x0f"]
    third = node.call("vm create", {"vm_id": "inst-3", "gpu_indices": [0], "ssh_public_keys": [KEY],
                                    "image": {"libvirt": "ubuntu-22.04"}})  # no UUIDs either: C, index 0 now
    assert (third.get("error"), third.get("state")) == (None, "running"), third
    assert hostdev_buses(node.domain_xml("inst-3")) == ["0x47"]
    assert node.listed() == [D]


def test_a_running_vm_without_uuids_still_holds_the_card_it_was_bound_to(node):
    old_vm(node, "inst-1", [0])
    assert node.record("inst-1")["pci_bus_ids"] == {A: "00000000:07:00.0"}
    again = node.call("vm start", {"vm_id": "inst-1"})  # a retried start: B at index 0 now is not its card
    assert (again.get("error"), again.get("state")) == (None, "running"), again
    assert node.record("inst-1")["pci_bus_ids"] == {A: "00000000:07:00.0"}
    refused = node.create("inst-2", [0], [A])  # answered gpu_missing before: A is held, not gone
    assert (refused["error"]["code"], refused["error"]["message"]) == (
        "gpu_busy", "GPU 0 is in use by another running VM"), refused
    assert node.create("inst-2", [1], [B])["state"] == "running"


def test_the_gpu_check_matches_a_running_vm_without_uuids_by_its_recorded_addresses(node):
    """check_gpus_free itself, with the node's cards as nvidia-smi lists them while inst-1 runs on A."""
    old_vm(node, "inst-1", [0])
    rt = agent.LibvirtRuntime(node.cfg)
    gpus = agent.read_gpus(node.cfg)[0]
    others = agent.all_records(node.cfg)
    with pytest.raises(agent.AgentError, match="GPU 0 is in use by another running VM"):
        agent.check_gpus_free(rt, others, [0], uuids=[A], gpus=gpus)
    agent.check_gpus_free(rt, others, [1], uuids=[B], gpus=gpus)  # B, listed at index 0: free
    agent.check_gpus_free(rt, others, [0], gpus=gpus)  # index 0 now (B): free


# ------------------------------------------------------------------------------ domains removed on the node

def test_a_vm_whose_domain_was_undefined_holds_no_card_and_cannot_start(node, tmp_path):
    """A finished VM whose domain the provider removed (`virsh undefine`): its record held its card for good
    (every later create on it: gpu_busy) and `vm start` failed with command_failed, so its instance was stopped
    again at every start. Start and stop answer not_found now (the platform fails the instance); the card is
    free for the next VM, and a destroy removes the record and the work folder."""
    assert node.create("inst-1", [0], [A])["state"] == "running"
    domains = node.domains()
    del domains["gpumarket-inst-1"]  # the card goes back to the host with it
    (tmp_path / "domains.json").write_text(json.dumps(domains))
    assert [(v["vm_id"], v["state"]) for v in node.call("vm list", {})["vms"]] == [("inst-1", "missing")]
    for verb in ("vm start", "vm stop"):
        answer = node.call(verb, {"vm_id": "inst-1"})
        assert answer["error"]["code"] == "not_found", answer
        assert "domain is gone" in answer["error"]["message"]
    assert "gpumarket-inst-1" not in node.domains()  # not defined again by the start
    assert node.create("inst-2", [0], [A])["state"] == "running"
    assert node.call("vm destroy", {"vm_id": "inst-1"})["existed"] is True
    assert not (tmp_path / "domains" / "inst-1").exists()
    assert [v["vm_id"] for v in node.call("vm list", {})["vms"]] == ["inst-2"]


def test_destroy_removes_a_domain_of_ours_that_has_no_record(node, tmp_path):
    """unrecorded() lists it so that the reconciler destroys it; `vm destroy` left it (existed: false)."""
    (tmp_path / "domains.json").write_text(json.dumps({"gpumarket-inst-41": {"state": "running", "hostdevs": []}}))
    (tmp_path / "domains" / "inst-41").mkdir(parents=True)
    (tmp_path / "domains" / "inst-41" / "disk.qcow2").write_text("")
    assert [(v["vm_id"], v["state"]) for v in node.call("vm list", {})["vms"]] == [("inst-41", "running")]
    answer = node.call("vm destroy", {"vm_id": "inst-41"})
    assert (answer.get("error"), answer["existed"]) == (None, True), answer
    assert node.domains() == {} and not (tmp_path / "domains" / "inst-41").exists()
    assert node.call("vm list", {})["vms"] == []
    assert node.call("vm destroy", {"vm_id": "inst-41"})["existed"] is False


def test_destroy_leaves_an_unrecorded_domain_under_a_name_the_platform_never_gives(node, tmp_path):
    """A gpumarket-* domain that is not inst-<instance id> (one a person defined on the node) is listed, but `vm
    destroy` of it undefined it and deleted its work folder, disk and all (found by review): it is left alone."""
    (tmp_path / "domains.json").write_text(json.dumps({"gpumarket-ghost": {"state": "running", "hostdevs": []}}))
    (tmp_path / "domains" / "ghost").mkdir(parents=True)
    (tmp_path / "domains" / "ghost" / "disk.qcow2").write_text("theirs")
    assert [(v["vm_id"], v["state"]) for v in node.call("vm list", {})["vms"]] == [("ghost", "running")]
    answer = node.call("vm destroy", {"vm_id": "ghost"})
    assert (answer.get("error"), answer["existed"]) == (None, False), answer
    assert node.domains()["gpumarket-ghost"]["state"] == "running"
    assert (tmp_path / "domains" / "ghost" / "disk.qcow2").read_text() == "theirs"


@pytest.mark.parametrize("list_too", [False, True])
def test_a_failed_lookup_of_a_defined_domain_is_no_missing_vm(node, list_too):
    """virsh prints "error: failed to get domain '<name>'" for every lookup that fails, whatever the reason (an RPC
    error while libvirtd restarts, a keepalive timeout, an ACL denial): the agent took each as the domain gone, so
    one glitch answered `vm stop` not_found (the platform failed the renter's running instance), listed the VM
    `missing` (the health check and reconciler failed it, freed its card, and then stopped its VM as a failed
    instance's) and counted its card free (found by review). A domain is missing only when the domain list, whose
    failure raises, does not name it; while virsh cannot say, every answer about it is command_failed."""
    assert node.create("inst-1", [0], [A])["state"] == "running"
    node.glitch(list_too=list_too)
    listed = node.call("vm list", {})
    health = node.call("health", {})
    if list_too:  # no domain list: no VM's state, rather than a wrong one
        assert listed["error"]["code"] == "command_failed", listed  # before: [("inst-1", "missing")]
        assert health["vms"] is None
    else:  # the VM alone is "unknown", with virsh's words (before: the whole list and health answer failed)
        assert [(v["vm_id"], v["state"]) for v in listed["vms"]] == [("inst-1", "unknown")], listed
        assert "failed to get domain" in listed["vms"][0]["error"]
        assert health["vms"] == {"inst-1": "unknown"} and "failed to get domain" in health["vm_errors"]["inst-1"]
    for verb in ("vm stop", "vm start", "vm status"):
        answer = node.call(verb, {"vm_id": "inst-1"})
        assert answer["error"]["code"] == "command_failed", (verb, answer)  # before: not_found, or "missing"
    rt = agent.LibvirtRuntime(node.cfg)
    with pytest.raises(agent.AgentError) as raised:
        holds_gpus(rt, node.record("inst-1"))  # before: False, its card free for the next VM
    assert raised.value.code == "command_failed"
    refused = node.create("inst-2", [1], [B])  # whether inst-1 holds A cannot be told: nothing is made
    assert refused["error"]["code"] == "command_failed", refused
    assert node.domains()["gpumarket-inst-1"]["state"] == "running" and "gpumarket-inst-2" not in node.domains()
    node.glitch(on=False)
    assert [(v["vm_id"], v["state"]) for v in node.call("vm list", {})["vms"]] == [("inst-1", "running")]
    assert node.call("health", {})["vms"] == {"inst-1": "running"}
    assert holds_gpus(rt, node.record("inst-1")) is True
    assert node.create("inst-2", [1], [B])["state"] == "running"


def test_destroy_only_if_missing_leaves_a_domain_whose_lookup_fails(node, tmp_path):
    """The platform's `vm destroy` with only_if_missing removes the record of a VM whose domain is gone, never a
    domain libvirt still has: one whose lookup fails for a while is command_failed. Only the record: the work
    folder's disk.qcow2 stays (it deleted the renter's disk; found by review) until the instance's destroy."""
    assert node.create("inst-1", [0], [A])["state"] == "running"
    node.glitch()
    answer = node.call("vm destroy", {"vm_id": "inst-1", "only_if_missing": True})
    assert answer["error"]["code"] == "command_failed", answer
    node.glitch(on=False)
    assert node.call("vm destroy", {"vm_id": "inst-1", "only_if_missing": True})["error"]["code"] == "conflict"
    assert node.domains()["gpumarket-inst-1"]["state"] == "running" and node.record("inst-1")
    domains = node.domains()
    del domains["gpumarket-inst-1"]  # undefined on the node
    (tmp_path / "domains.json").write_text(json.dumps(domains))
    answer = node.call("vm destroy", {"vm_id": "inst-1", "only_if_missing": True})
    assert (answer.get("error"), answer["existed"]) == (None, True), answer
    assert not (node.state / "vms" / "inst-1").exists()
    assert (tmp_path / "domains" / "inst-1" / "disk.qcow2").exists()  # before: deleted with the record
    assert node.call("vm destroy", {"vm_id": "inst-1"})["existed"] is True  # the instance's destroy
    assert not (tmp_path / "domains" / "inst-1").exists()
