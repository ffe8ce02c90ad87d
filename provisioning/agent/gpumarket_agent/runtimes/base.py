"""What every runtime shares."""
import contextlib
import os
import shutil

from ..allocation import checked_start
from ..core import AgentError
from ..records import log_path, pick_host_port, tail_lines


class Runtime:
    """One runtime's operations on a VM record. Every operation is idempotent; state is running|stopped|missing
    (docker: restarting too, a container whose command exited and is run again: not running, holding its GPUs)."""
    name = "base"
    ssh_user = "root"
    # Whether a running VM's cards leave the host's nvidia-smi (libvirt hands them to the VM as VFIO devices): the
    # cards are then judged by UUID, and one not listed may be held by one of our VMs (allocation.cards_held).
    hides_cards = False

    def __init__(self, cfg):
        self.cfg = cfg

    def host(self):
        return self.cfg.public_host  # None: renters use the node's own address

    def allocate(self, rec, records):
        """Host ports from GPUMARKET_PORT_RANGE: SSH, then one per container port in the spec."""
        rec["ssh_port"] = pick_host_port(self.cfg, records)
        taken = {rec["ssh_port"]}
        rec["ports"] = {}
        for port in rec["spec"].get("ports", ()):
            rec["ports"]["%d/tcp" % port] = pick_host_port(self.cfg, records, taken)
            taken.add(rec["ports"]["%d/tcp" % port])

    def check_spec(self, spec):
        """Refuse, before anything is recorded, options this runtime cannot honour."""

    def unrecorded(self, known):
        """VMs of ours that have no record (a crash between creating one and recording it)."""
        return []

    def destroy_unrecorded(self, vm_id):
        """Remove what this runtime has of VM `vm_id` (a validated id), which has no record: what unrecorded()
        lists, so that `vm destroy` removes it. Idempotent; True when something was removed."""
        return False

    def remove_leftovers(self, rec):
        """Remove what this runtime keeps of a VM beside its container or domain, never through the engine."""

    def ssh_answers(self, rec):
        """Whether the running VM's SSH server answers its banner on the node itself (`vm status` with probe_ssh):
        True where the platform cannot reach it from outside puts the silence on the node's network, False on the
        VM (a renter's own image whose sshd never started). None: this runtime cannot tell."""
        return None

    def disk_limit(self, rec):
        """Whether the VM's disk_gb is "enforced" on the node or "not_enforced" (then only recorded and billed)."""
        return "not_enforced"

    def checked_start(self, rec):
        """start(), after checking under the allocate lock that no other VM holds the GPUs (allocation.py)."""
        checked_start(self, rec)

    def rebind(self, rec):
        """Give a stopped VM the GPUs now in rec's spec (the platform may hand back other ones)."""
        raise AgentError("rebind_unsupported", "a %s VM keeps the GPUs it was created with" % rec["runtime"])

    def logs(self, rec, tail):
        return tail_lines(log_path(self.cfg, rec["vm_id"]), tail)

    # Volumes: by default a directory under the agent's state folder (volumes.py keeps the record beside it).
    def volume_path(self, name):
        return os.path.join(self.cfg.state_dir, "volumes", name, "data")

    def volume_create(self, name, size_gb):
        """Make the volume; answer whether its size is "enforced" or "not_enforced" (a plain folder: not)."""
        os.makedirs(self.volume_path(name), mode=0o755, exist_ok=True)
        return "not_enforced"

    def volume_delete(self, name):
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.volume_path(name))


def vm_name(vm_id):
    return "gpumarket-" + vm_id  # container and libvirt domain name


def os_release_pretty_name(text):
    """PRETTY_NAME from an os-release file's text (shell-style KEY=value, maybe quoted), or None. Printable
    characters only: the image's author wrote that file, and one NUL in it made every answer about the VM refused,
    the node blamed for the renter's image (found by review)."""
    for line in text.splitlines():
        key, _, value = line.strip().partition("=")
        if key == "PRETTY_NAME":
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            value = "".join(ch for ch in value.replace('\\"', '"') if ch.isprintable())
            return value[:200] or None
    return None
