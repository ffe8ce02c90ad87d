"""The runtimes a node runs VMs with: sim, docker, libvirt. Each VM operation is idempotent."""
from .base import Runtime, vm_name
from .docker import DockerRuntime
from .libvirt import LibvirtRuntime
from .sim import SimRuntime

RUNTIME_CLASSES = {"sim": SimRuntime, "docker": DockerRuntime, "libvirt": LibvirtRuntime}

__all__ = ["RUNTIME_CLASSES", "DockerRuntime", "LibvirtRuntime", "Runtime", "SimRuntime", "vm_name"]
