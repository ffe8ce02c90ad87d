"""What every runtime shares."""
from ..core import AgentError
from ..records import pick_host_port


class Runtime:
    """One runtime's operations on a VM record. Every operation is idempotent; state is running|stopped|missing."""
    ssh_user = "root"

    def __init__(self, cfg):
        self.cfg = cfg

    def host(self):
        return self.cfg.public_host  # None: renters use the node's own address

    def allocate(self, rec, records):
        rec["ssh_port"] = pick_host_port(self.cfg, records)

    def unrecorded(self, known):
        """VMs of ours that have no record (a crash between creating one and recording it)."""
        return []

    def rebind(self, rec):
        """Give a stopped VM the GPUs now in rec's spec (the platform may hand back other ones)."""
        raise AgentError("rebind_unsupported", "a %s VM keeps the GPUs it was created with" % rec["runtime"])


def vm_name(vm_id):
    return "gpumarket-" + vm_id  # container and libvirt domain name
