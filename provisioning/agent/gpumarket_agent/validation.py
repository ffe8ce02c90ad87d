"""Checking requests: VM ids, SSH keys, image names, GPU indices, and the renter's options (options.py)."""
import base64
import re

from .core import invalid
from .options import validate_options
from .reference import internal_registry, parse_reference

VM_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
# The names the platform gives its VMs (inst-<instance id>: marketplace.models.renting.vm_id_of; the reconciler
# reads them with the same pattern). `vm destroy` removes a container or domain the agent has no record of only
# under such a name: anything else of ours on the node (a gpumarket-* a person made) is left alone.
PLATFORM_VM_ID_RE = re.compile(r"inst-[1-9][0-9]{0,18}")
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa",
             "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com")
_B64_RE = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_COMMENT_RE = re.compile(r"[\x21-\x7e]+( [\x21-\x7e]+)*")  # printable ASCII words, single spaces
_LIBVIRT_IMAGE_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
# A card's UUID as nvidia-smi prints it: it names the card wherever nvidia-smi numbers it (allocation.cards_now).
GPU_UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def reject_unknown(req, allowed):
    extra = sorted(set(req) - set(allowed) - {"runtime"})
    if extra:
        raise invalid(extra[0], "unknown field %r" % extra[0])


def validate_vm_id(value):
    if not isinstance(value, str) or not VM_ID_RE.fullmatch(value):
        raise invalid("vm_id", "vm_id must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'")
    return value


def validate_public_key(value):
    """One OpenSSH public key line: '<type> <base64 body> [comment]', no options, no second key."""
    if not isinstance(value, str) or not 0 < len(value) <= 16384:
        raise ValueError("must be a non-empty string of at most 16384 characters")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError("must be one line without control characters")
    parts = value.split(" ", 2)
    if parts[0] not in KEY_TYPES:
        raise ValueError("must start with a key type (%s); options are not allowed" % ", ".join(KEY_TYPES))
    if len(parts) < 2 or not _B64_RE.fullmatch(parts[1]):
        raise ValueError("key body must be base64")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except ValueError:
        raise ValueError("key body is not valid base64") from None
    # The blob starts with its own length-prefixed type name; a mismatch means a corrupt or forged key.
    n = int.from_bytes(blob[:4], "big")
    if len(blob) < 4 + n + 16 or blob[4:4 + n].decode("ascii", "replace") != parts[0]:
        raise ValueError("key body does not hold a %s key" % parts[0])
    if len(parts) == 3:
        if not _COMMENT_RE.fullmatch(parts[2]) or len(parts[2]) > 256:
            raise ValueError("comment must be printable words separated by single spaces")
        if any(word in KEY_TYPES or (word.startswith("AAAA") and len(word) > 40) for word in parts[2].split(" ")):
            raise ValueError("holds more than one key; send one key per list item")
    return value


CREATE_FIELDS = ("vm_id", "gpu_indices", "gpu_uuids", "ssh_public_keys", "image", "disk_gb", "registry_auth", "env",
                 "onstart", "ports", "volumes", "mig_uuids", "image_env")


def validate_create(req, runtime, gpu_indices_present, internal_registries=()):
    """(vm_id, spec): the spec is what the VM record keeps. registry_auth is checked here and never kept: the
    caller takes it with options.validate_registry_auth. `internal_registries`: the node's own registries a
    renter's image may come from (Config.internal_registries)."""
    reject_unknown(req, CREATE_FIELDS)
    vm_id = validate_vm_id(req.get("vm_id"))
    indices, uuids = validate_gpus(req, gpu_indices_present)
    keys = req.get("ssh_public_keys")
    if not isinstance(keys, list) or not 0 < len(keys) <= 32:
        raise invalid("ssh_public_keys", "ssh_public_keys must be a list of 1 to 32 keys")
    for n, key in enumerate(keys):
        try:
            validate_public_key(key)
        except ValueError as exc:
            raise invalid("ssh_public_keys", "key %d %s" % (n, exc)) from None
    image = req.get("image", {})
    if not isinstance(image, dict) or set(image) - {"docker", "libvirt"}:
        raise invalid("image", "image must be an object with 'docker' and/or 'libvirt' names")
    for kind, name in image.items():
        if kind == "docker" and parse_reference(name) is None:
            raise invalid("image", "image.docker is not a valid image reference "
                                   "([registry[:port]/]name[:tag][@sha256:<64 hex>], lower-case name)")
        if kind == "libvirt" and (not isinstance(name, str) or not _LIBVIRT_IMAGE_RE.fullmatch(name) or ".." in name):
            raise invalid("image", "image.libvirt is not an allowed image name")
    if runtime in ("docker", "libvirt") and runtime not in image:
        raise invalid("image", "image.%s is required for the %s runtime" % (runtime, runtime))
    disk_gb = req.get("disk_gb", 50)
    if type(disk_gb) is not int or not 1 <= disk_gb <= 65536:
        raise invalid("disk_gb", "disk_gb must be an integer from 1 to 65536")
    spec = {"gpu_indices": indices, "ssh_public_keys": list(keys),
            "image": {k: image[k] for k in sorted(image)}, "disk_gb": disk_gb}
    if uuids is not None:
        spec["gpu_uuids"] = uuids
    if req.get("mig_uuids") is not None:  # MIG slices of those GPUs: the VM sees only these (mig.py checks them)
        if not isinstance(req["mig_uuids"], list) or not req["mig_uuids"]:
            raise invalid("mig_uuids", "mig_uuids must be a non-empty list of MIG-... UUIDs")
        spec["mig_uuids"] = list(req["mig_uuids"])
    spec.update(validate_options(req)[0])
    # A renter's own image (or one pulled with the renter's login) never from a registry inside the node's network:
    # refused before anything is recorded or pulled. Catalogue images are the platform's and may be.
    if "docker" in image and (spec.get("image_env") or req.get("registry_auth")):
        why = internal_registry(parse_reference(image["docker"])["domain"], internal_registries)
        if why:
            raise invalid("image", "image.docker cannot be pulled from a registry inside the node's network: "
                                   "%s. Use a public registry." % why)
    return vm_id, spec


def validate_gpu_indices(value, present):
    """The indices, sorted; `present` None: their shape only (the cards are checked when the VM starts)."""
    if not isinstance(value, list) or not 0 < len(value) <= 64 or \
            not all(type(i) is int for i in value) or len(set(value)) != len(value):
        raise invalid("gpu_indices", "gpu_indices must be a non-empty list of distinct integers")
    missing = sorted(set(value) - set(present if present is not None else value))
    if missing:
        raise invalid("gpu_indices", "no GPU with index %s on this node" % missing[0])
    return sorted(value)


def validate_gpu_uuids(value, indices):
    """The allocated cards' UUIDs, one per entry of `indices` (the request's gpu_indices, in its order), null for
    a card the platform knows no UUID of (that one is judged by its index alone). None when none were sent."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("gpu_uuids", "gpu_uuids must be a list of GPU-... UUIDs (or null), one per entry of gpu_indices")
    if len(value) != len(indices):
        raise invalid("gpu_uuids", "gpu_uuids must have one entry per entry of gpu_indices (%d), not %d" % (
            len(indices), len(value)))
    for n, uuid in enumerate(value):
        if uuid is not None and not (isinstance(uuid, str) and GPU_UUID_RE.fullmatch(uuid)):
            raise invalid("gpu_uuids", "gpu_uuids entry %d is not a GPU UUID "
                                       "(GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, hexadecimal) or null" % n)
    known = [u for u in value if u is not None]
    if len(set(known)) != len(known):
        twice = next(u for u in known if known.count(u) > 1)
        raise invalid("gpu_uuids", "gpu_uuids names %s more than once" % twice)
    return value


def validate_gpus(req, present):
    """(gpu_indices sorted, gpu_uuids in that order or None) of a create or start request. Without UUIDs an index
    must be on the node; with them the VM's start checks each card (allocation.cards_now), naming one that is gone."""
    value, uuids = req.get("gpu_indices"), req.get("gpu_uuids")
    indices = validate_gpu_indices(value, present if uuids is None else None)
    uuids = validate_gpu_uuids(uuids, value)
    if uuids is None:
        return indices, None
    by_index = dict(zip(value, uuids))  # noqa: B905 - python3.8
    return indices, [by_index[i] for i in indices]
