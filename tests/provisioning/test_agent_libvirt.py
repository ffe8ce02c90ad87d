"""The domain XML, cloud-init seed and commands the agent builds for the `libvirt` runtime."""
import json
import xml.etree.ElementTree as ET

import pytest

from provisioning.agent import gpumarket_agent as agent
from tests.provisioning.sshkit import new_keypair


@pytest.fixture
def domain():
    xml = agent.libvirt_domain_xml(
        "inst-42", 32, 257951, "/vm/inst-42/disk.qcow2", "/vm/inst-42/seed.iso", 40003,
        ["00000000:41:00.0", "00000000:C1:00.0"],
    )
    return ET.fromstring(xml)  # noqa: S314 - our own builder's output, not untrusted input


def test_domain_basics(domain):
    assert domain.tag == "domain" and domain.get("type") == "kvm"
    assert domain.findtext("name") == "gpumarket-inst-42"
    assert (domain.find("memory").get("unit"), domain.findtext("memory")) == ("MiB", "257951")
    assert domain.findtext("vcpu") == "32"
    os_type = domain.find("os/type")
    assert (os_type.text, os_type.get("arch"), os_type.get("machine")) == ("hvm", "x86_64", "q35")
    assert domain.find("cpu").get("mode") == "host-passthrough"


def test_disks_are_the_overlay_and_the_seed(domain):
    disk, cdrom = domain.findall("devices/disk")
    assert (disk.get("device"), disk.find("driver").get("type")) == ("disk", "qcow2")
    assert disk.find("source").get("file") == "/vm/inst-42/disk.qcow2"
    assert disk.find("target").attrib == {"dev": "vda", "bus": "virtio"}
    assert cdrom.get("device") == "cdrom"
    assert cdrom.find("source").get("file") == "/vm/inst-42/seed.iso"
    assert cdrom.find("readonly") is not None


def test_nat_interface_forwards_the_ssh_port(domain):
    (nic,) = domain.findall("devices/interface")
    assert nic.get("type") == "user"
    assert nic.find("backend").get("type") == "passt"
    assert nic.find("portForward").get("proto") == "tcp"
    assert nic.find("portForward/range").attrib == {"start": "40003", "to": "22"}


def test_each_gpu_is_a_pci_hostdev(domain):
    hostdevs = domain.findall("devices/hostdev")
    assert [h.attrib for h in hostdevs] == [{"mode": "subsystem", "type": "pci", "managed": "yes"}] * 2
    assert [h.find("source/address").attrib for h in hostdevs] == [
        {"domain": "0x0000", "bus": "0x41", "slot": "0x00", "function": "0x0"},
        {"domain": "0x0000", "bus": "0xc1", "slot": "0x00", "function": "0x0"},
    ]


@pytest.mark.parametrize("bus_id", [None, "", "41:00.0 ", "0000:41:00", "0000:41:00.8", "zz:41:00.0"])
def test_unusable_pci_ids_are_refused(bus_id):
    with pytest.raises(agent.AgentError):
        agent.pci_address(bus_id)


def test_cloud_init_user_data_carries_exactly_the_keys():
    keys = [new_keypair("renter: {laptop} #1")[1], new_keypair()[1]]
    text = agent.cloud_init_user_data(keys)
    header, body = text.split("\n", 1)
    assert header == "#cloud-config"
    # The body is JSON (a subset of YAML): comments with YAML syntax in them stay plain strings.
    config = json.loads(body)
    assert config["users"] == [{"name": "user", "shell": "/bin/bash", "sudo": "ALL=(ALL) NOPASSWD:ALL",
                                "ssh_authorized_keys": keys}]
    assert config["ssh_pwauth"] is False


def test_cloud_init_meta_data():
    assert agent.cloud_init_meta_data("inst-42") == "instance-id: inst-42\nlocal-hostname: inst-42\n"


def test_disk_and_seed_argvs():
    assert agent.qemu_img_overlay_argv("/img/ubuntu-22.04.qcow2", "/vm/a/disk.qcow2", 50) == [
        "qemu-img", "create", "-f", "qcow2", "-F", "qcow2", "-b", "/img/ubuntu-22.04.qcow2", "/vm/a/disk.qcow2", "50G"
    ]
    assert agent.seed_iso_argv("/vm/a/seed.iso", "/vm/a/user-data", "/vm/a/meta-data") == [
        "genisoimage", "-output", "/vm/a/seed.iso", "-volid", "cidata", "-joliet", "-rock",
        "/vm/a/user-data", "/vm/a/meta-data",
    ]


def test_virsh_argvs():
    uri = "qemu:///system"
    assert agent.virsh_argv(uri, "define", "/vm/a/domain.xml") == [
        "virsh", "-c", uri, "define", "/vm/a/domain.xml"
    ]
    for verb in ("start", "shutdown", "destroy", "undefine"):
        assert agent.virsh_argv(uri, verb, "gpumarket-a") == ["virsh", "-c", uri, verb, "gpumarket-a"]


def test_resources_follow_the_share_of_gpus():
    assert agent.libvirt_share(128, 515902, 2, 4) == (64, 232155)
    assert agent.libvirt_share(8, 16000, 1, 8) == (1, 2048)  # floors: one vCPU, 2 GiB
