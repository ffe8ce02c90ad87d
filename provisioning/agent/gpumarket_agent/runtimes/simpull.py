"""The sim runtime's pull. No registry is contacted: a reference is answered as a registry would, by rule, so the
demo and the platform's tests can show a pull that works, one that needs credentials, and ones that fail.

- a registry host ending in ".invalid" does not resolve (RFC 2606): the pull fails as docker's does;
- the registry host SIM_PRIVATE_REGISTRY wants registry_auth SIM_PRIVATE_AUTH; without it, or with another
  password, the pull fails with the registry's reason;
- the tag "missing" exists in no registry: manifest unknown;
- the tag "nospace" fills the node's disk (no space left on device), and the tag "nodenet" meets a node whose DNS
  is down (the registry's name does not resolve): the first is pull_failed (a renter's image can fill a disk: the
  platform counts it against the node for a catalogue image only), the second the node's towards Docker Hub (or
  another public registry) and the renter's towards their own registry;
- every other reference is public and pulls.
Whose failure each is, and so the code answered (pull_failed or pull_node_failed), is decided as the docker
runtime decides it, by dockerpull.pull_fault on these words. A sim VM runs no image: its OS is the node's own,
whatever it pulled.
"""
from ..core import AgentError
from ..records import vm_log
from ..reference import parse_reference
from .dockerpull import pull_fault

SIM_PRIVATE_REGISTRY = "registry.sim.test"
SIM_PRIVATE_AUTH = {"username": "renter", "password": "sim-registry-secret"}


def sim_pull_failure(reference, registry_auth):
    """The registry's reason a pull of `reference` fails on a sim node, or None."""
    ref = parse_reference(reference)
    domain = ref["domain"] or "registry-1.docker.io"
    host = domain.rsplit(":", 1)[0] if not domain.startswith("[") else domain
    tag = ref["digest"] or ref["tag"] or "latest"
    manifest = 'Head "https://%s/v2/%s/manifests/%s"' % (domain, ref["remote"], tag)
    if host.endswith(".invalid"):
        return 'Get "https://%s/v2/": dial tcp: lookup %s: no such host' % (domain, host)
    if host == SIM_PRIVATE_REGISTRY:
        if registry_auth is None:
            return manifest + ": no basic auth credentials"
        if registry_auth != SIM_PRIVATE_AUTH:
            return "unauthorized: authentication required"  # what docker says for registry v2's 401
    if ref["tag"] == "nospace":
        return ("failed to register layer: write /var/lib/docker/overlay2/sim/diff/usr/lib/libsim.so: "
                "no space left on device")
    if ref["tag"] == "nodenet":
        return 'Get "https://%s/v2/": dial tcp: lookup %s on 127.0.0.53:53: server misbehaving' % (domain, host)
    if ref["tag"] == "missing":
        return "manifest for %s not found: manifest unknown: manifest unknown" % reference
    return None


def sim_pull(cfg, rec, registry_auth):
    reference = rec["spec"]["image"]["docker"]
    vm_log(cfg, rec["vm_id"], "pulling %s%s" % (reference, " with registry credentials" if registry_auth else ""))
    reason = sim_pull_failure(reference, registry_auth)
    if reason:
        vm_log(cfg, rec["vm_id"], "pull failed: " + reason)
        raise AgentError(pull_fault(reason, reference, registry_auth), reason)
    vm_log(cfg, rec["vm_id"], "pulled %s (sim: nothing is downloaded; the VM runs the node's own OS)" % reference)
