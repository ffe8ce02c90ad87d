"""The libvirt runtime: a VM is a KVM domain with its GPUs as PCI hostdevs."""
import json
import os
import re
import shutil
import time
import xml.etree.ElementTree as ET

from ..allocation import cards_held, cards_out_of_view, remember_addresses, visible_gpus
from ..core import AgentError, StateUnknown, invalid, run, state_or_unknown, write_file
from ..records import all_records
from ..smi import host_facts
from ..validation import VM_ID_RE
from .base import Runtime, vm_name

LIBVIRT_SSH_USER = "user"


def pci_address(bus_id):
    """nvidia-smi's '00000000:07:00.0' -> libvirt's address attributes."""
    match = re.fullmatch(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])", bus_id or "")
    if not match:
        raise AgentError("bad_inventory", "unusable PCI bus id %r" % bus_id)
    domain, bus, slot, function = match.groups()
    return {"domain": "0x%04x" % int(domain, 16), "bus": "0x" + bus.lower(), "slot": "0x" + slot.lower(),
            "function": "0x" + function}


def libvirt_share(host_cores, host_ram_mib, n_gpus, total_gpus):
    """vCPUs and memory in proportion to the GPUs rented; 10 % of RAM stays with the host."""
    vcpus = max(1, host_cores * n_gpus // total_gpus)
    return vcpus, max(2048, int(host_ram_mib * 0.9) * n_gpus // total_gpus)


def libvirt_domain_xml(vm_id, vcpus, memory_mib, disk_path, seed_path, ssh_port, pci_bus_ids):
    dom = ET.Element("domain", type="kvm")
    ET.SubElement(dom, "name").text = vm_name(vm_id)
    ET.SubElement(dom, "memory", unit="MiB").text = str(memory_mib)
    ET.SubElement(dom, "vcpu").text = str(vcpus)
    os_el = ET.SubElement(dom, "os")
    ET.SubElement(os_el, "type", arch="x86_64", machine="q35").text = "hvm"
    ET.SubElement(os_el, "boot", dev="hd")
    features = ET.SubElement(dom, "features")
    ET.SubElement(features, "acpi")
    ET.SubElement(features, "apic")
    ET.SubElement(dom, "cpu", mode="host-passthrough")
    devices = ET.SubElement(dom, "devices")
    disk = ET.SubElement(devices, "disk", type="file", device="disk")
    ET.SubElement(disk, "driver", name="qemu", type="qcow2")
    ET.SubElement(disk, "source", file=disk_path)
    ET.SubElement(disk, "target", dev="vda", bus="virtio")
    seed = ET.SubElement(devices, "disk", type="file", device="cdrom")
    ET.SubElement(seed, "driver", name="qemu", type="raw")
    ET.SubElement(seed, "source", file=seed_path)
    ET.SubElement(seed, "target", dev="sda", bus="sata")
    ET.SubElement(seed, "readonly")
    # User-mode NAT through passt (libvirt >= 9.0): host port -> guest 22, no bridge or iptables needed.
    nic = ET.SubElement(devices, "interface", type="user")
    ET.SubElement(nic, "backend", type="passt")
    ET.SubElement(nic, "model", type="virtio")
    forward = ET.SubElement(nic, "portForward", proto="tcp")
    ET.SubElement(forward, "range", start=str(ssh_port), to="22")
    for bus_id in pci_bus_ids:  # managed="yes": libvirt binds the card to vfio-pci and back
        hostdev = ET.SubElement(devices, "hostdev", mode="subsystem", type="pci", managed="yes")
        ET.SubElement(ET.SubElement(hostdev, "source"), "address", **pci_address(bus_id))
    ET.SubElement(devices, "console", type="pty")
    return ET.tostring(dom, encoding="unicode")


def cloud_init_user_data(keys, user=LIBVIRT_SSH_USER):
    # JSON is valid YAML, so key comments can never inject YAML structure.
    config = {"users": [{"name": user, "shell": "/bin/bash", "sudo": "ALL=(ALL) NOPASSWD:ALL",
                         "ssh_authorized_keys": list(keys)}],
              "ssh_pwauth": False, "disable_root": True}
    return "#cloud-config\n" + json.dumps(config, indent=1, sort_keys=True) + "\n"


def cloud_init_meta_data(vm_id):
    return "instance-id: %s\nlocal-hostname: %s\n" % (vm_id, vm_id)


def qemu_img_overlay_argv(base_path, overlay_path, disk_gb):
    return ["qemu-img", "create", "-f", "qcow2", "-F", "qcow2", "-b", base_path, overlay_path, "%dG" % disk_gb]


def seed_iso_argv(iso_path, user_data_path, meta_data_path):
    # NoCloud looks for a volume labelled "cidata" holding files named user-data and meta-data.
    return ["genisoimage", "-output", iso_path, "-volid", "cidata", "-joliet", "-rock",
            user_data_path, meta_data_path]


def virsh_argv(uri, verb, *args):
    return ["virsh", "-c", uri, verb] + list(args)


class LibvirtRuntime(Runtime):
    name = "libvirt"
    ssh_user = LIBVIRT_SSH_USER
    hides_cards = True  # managed hostdevs: libvirt binds a running domain's cards to vfio-pci, out of nvidia-smi

    def check_spec(self, spec):
        for option in ("env", "onstart", "ports", "volumes", "mig_uuids"):  # MIG in KVM needs vGPU
            if option in spec:
                raise invalid(option, "the libvirt runtime does not support %s yet" % option)

    def provision(self, rec, registry_auth=None):
        self.provision_vm(rec)

    def disk_limit(self, rec):
        return "enforced"  # the qcow2 overlay has disk_gb as its virtual size

    def provision_vm(self, rec):
        vm_id, spec = rec["vm_id"], rec["spec"]
        base = os.path.join(self.cfg.libvirt_images, spec["image"]["libvirt"] + ".qcow2")
        if not os.path.isfile(base):
            raise AgentError("image_not_found", "no cloud image %s on this node" % base)
        work = os.path.join(self.cfg.libvirt_dir, vm_id)
        os.makedirs(work, exist_ok=True)
        paths = {n: os.path.join(work, n) for n in ("disk.qcow2", "seed.iso", "user-data", "meta-data",
                                                      "domain.xml")}
        if not os.path.exists(paths["disk.qcow2"]):
            run(qemu_img_overlay_argv(base, paths["disk.qcow2"], spec["disk_gb"]))
        write_file(paths["user-data"], cloud_init_user_data(spec["ssh_public_keys"]), 0o644)
        write_file(paths["meta-data"], cloud_init_meta_data(vm_id), 0o644)
        run(seed_iso_argv(paths["seed.iso"], paths["user-data"], paths["meta-data"]))
        if self.state(rec) != "running":  # a retried create of a VM that runs: its domain is defined, and in use
            self.rebind(rec)
        self.checked_start(rec)

    def rebind(self, rec):
        # (Re)define the domain with the spec's GPUs as hostdevs; the disk overlay is kept. A hostdev is the card's
        # PCI address, looked up now for the card the spec names (cards_held: by its UUID where recorded, wherever
        # nvidia-smi lists it, or as recorded while this VM runs on it), so the domain keeps its cards however
        # nvidia-smi numbers them later. The share counts the node's cards, those our running VMs hold too.
        vm_id = rec["vm_id"]
        work = os.path.join(self.cfg.libvirt_dir, vm_id)
        gpus = visible_gpus(self)
        records = all_records(self.cfg)
        cards = cards_held(self, rec, gpus, [r for r in records if r["vm_id"] != vm_id])
        unknown = [c["uuid"] for c in cards if c not in gpus and not c.get("pci_bus_id")]  # held, from before
        if unknown:
            raise AgentError("conflict", "VM %s runs on GPU %s, whose PCI address was not recorded; stop it before "
                                         "moving it" % (vm_id, unknown[0]))
        remember_addresses(self, rec, cards)
        facts = host_facts(self.cfg)
        vcpus, mem = libvirt_share(facts["cpu"]["cores"] or 1, facts["ram_mib"] or 4096,
                                   len(cards), max(len(cards), len(gpus) + cards_out_of_view(self, gpus, records)))
        domain = os.path.join(work, "domain.xml")
        write_file(domain, libvirt_domain_xml(
            vm_id, vcpus, mem, os.path.join(work, "disk.qcow2"), os.path.join(work, "seed.iso"), rec["ssh_port"],
            [g["pci_bus_id"] for g in cards]), 0o644)
        run(virsh_argv(self.cfg.libvirt_uri, "define", domain))

    def start(self, rec):
        if self.state(rec) != "running":
            run(virsh_argv(self.cfg.libvirt_uri, "start", vm_name(rec["vm_id"])), timeout=120)

    def stop(self, rec):
        name = vm_name(rec["vm_id"])
        if self.state(rec) != "running":
            return
        run(virsh_argv(self.cfg.libvirt_uri, "shutdown", name), check=False)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and self.state(rec) == "running":
            time.sleep(1)
        if self.state(rec) == "running":  # the guest ignored ACPI: pull the plug
            run(virsh_argv(self.cfg.libvirt_uri, "destroy", name), check=False)

    def destroy(self, rec):
        name = vm_name(rec["vm_id"])
        if self.state(rec) != "missing":
            run(virsh_argv(self.cfg.libvirt_uri, "destroy", name), check=False)
            run(virsh_argv(self.cfg.libvirt_uri, "undefine", name))
        self.remove_leftovers(rec)

    def remove_leftovers(self, rec):
        shutil.rmtree(os.path.join(self.cfg.libvirt_dir, rec["vm_id"]), ignore_errors=True)  # disk, seed, xml

    def destroy_unrecorded(self, vm_id):
        rec = {"vm_id": vm_id}
        found = self.state(rec) != "missing" or os.path.isdir(os.path.join(self.cfg.libvirt_dir, vm_id))
        self.destroy(rec)  # its domain and its work folder (disk, seed)
        return found

    def state(self, rec):
        name = vm_name(rec["vm_id"])
        proc = run(virsh_argv(self.cfg.libvirt_uri, "domstate", name), check=False)
        if proc.returncode == 0:
            return "running" if proc.stdout.strip() in ("running", "paused", "in shutdown") else "stopped"
        # Missing only when the domain list, whose failure raises, does not name it. virsh's words cannot tell:
        # it prints "error: failed to get domain '<name>'" for every lookup that fails (tools/virsh-util.c resets
        # libvirt's own error first), also for an RPC error while libvirtd or virtqemud restarts, a keepalive
        # timeout or an ACL denial. Read as missing, one such glitch failed a renter's running instance, freed its
        # GPUs and then had its VM stopped (found by review). A defined domain whose state virsh cannot read is
        # command_failed: its state is unknown, not missing.
        if name not in self.domain_names():
            return "missing"
        raise StateUnknown("virsh domstate %s failed, though the domain is defined (its state is unknown): %s"
                           % (name, proc.stderr.strip()[-800:]))

    def domain_names(self):
        """The names of every domain libvirt has, running or not; command_failed when virsh cannot list them."""
        return set(run(virsh_argv(self.cfg.libvirt_uri, "list", "--all", "--name")).stdout.split())

    def unrecorded(self, known):
        names = sorted(self.domain_names())
        found = []
        for name in names:
            vm_id = name[len("gpumarket-"):] if name.startswith("gpumarket-") else ""
            if VM_ID_RE.fullmatch(vm_id) and vm_id not in known:
                state, error = state_or_unknown(self, {"vm_id": vm_id})
                found.append({"vm_id": vm_id, "state": state, **({"error": error} if error else {})})
        return found

    def health(self):
        proc = run(virsh_argv(self.cfg.libvirt_uri, "version", "--daemon"), timeout=15, check=False)
        return proc.returncode == 0, (proc.stdout.strip() or proc.stderr.strip())[-300:]
