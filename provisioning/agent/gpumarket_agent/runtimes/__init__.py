"""The runtimes a node runs VMs with: sim, docker, libvirt. Each VM operation is idempotent."""
import importlib

from .base import Runtime, vm_name


class _RuntimeClasses(dict):
    """{name: class}, each runtime's module imported when first asked for: a command on a sim node loads no
    docker or libvirt code."""

    _MODULES = {"sim": ("sim", "SimRuntime"), "docker": ("docker", "DockerRuntime"),
                "libvirt": ("libvirt", "LibvirtRuntime")}

    def __missing__(self, name):
        module, cls = self._MODULES[name]
        self[name] = getattr(importlib.import_module("." + module, __name__), cls)
        return self[name]


RUNTIME_CLASSES = _RuntimeClasses()


def __getattr__(name):
    for module, cls in _RuntimeClasses._MODULES.values():
        if cls == name:
            return getattr(importlib.import_module("." + module, __name__), cls)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


__all__ = ["RUNTIME_CLASSES", "DockerRuntime", "LibvirtRuntime", "Runtime", "SimRuntime", "vm_name"]
