"""The docker runtime's image: `docker pull` with a fresh, private DOCKER_CONFIG holding the renter's registry
credentials or none (never the node's), the registry's reason when it fails (the password masked), and the
image's own entrypoint + cmd, which the entry wrapper runs after its work, and the paths it declares as VOLUMEs.

A failed pull answers one of two codes (pull_fault): `pull_failed`, the registry's refusal of this reference
(manifest unknown, unauthorized, denied, an invalid reference, another 4xx; the renter's to fix), or
`pull_node_failed`, the node's own failure (its failing disk, its docker daemon gone, its network to a public
registry). A full disk and a layer that is not a valid tar are pull_failed: a renter's image can cause them (the
platform counts a full disk against the node for a catalogue image only). Before, every failure was `pull_failed`,
a node whose docker daemon was gone the renter's fault (review r54 #1)."""
import base64
import json
import os
import posixpath
import re
import shutil
import tempfile

from ..core import AgentError, run, write_file
from ..records import vm_log
from ..reference import DOCKER_HUB_NAMES, parse_reference, registry_key

PULL_REFUSED = "pull_failed"  # the registry refused the reference: the renter's to fix
PULL_NODE_FAILED = "pull_node_failed"  # the node could not pull it: the node's failure
# The node's own failures, wherever the image comes from: its failing or read-only disk, its memory, its docker
# daemon (the CLI cannot reach it).
NODE_LOCAL = re.compile(
    r"read-only file system|input/output error|cannot allocate memory|too many open files"
    r"|cannot connect to the docker daemon|is the docker daemon running|error during connect", re.IGNORECASE)
# The disk filled while the image was unpacked: a full node, or an image far bigger unpacked than downloaded (a
# decompression bomb on Docker Hub costs its renter nothing), which cannot be told apart here. Answered as
# pull_failed: the platform counts it against the node for a catalogue image only, and for a renter's own image
# records a node event instead (provisioning/services/vms.py _pull_failure; review r54 own MEDIUM-1).
NO_SPACE = re.compile(r"no space left on device|disk quota exceeded", re.IGNORECASE)
# What the image's layers hold (a blob that is not a tar, a bad gzip stream, a digest or diff id that does not
# match): registries do not check it, so it is the image's, whichever registry served it.
IMAGE_CONTENT = re.compile(
    r"failed to register layer|error processing tar file|archive/tar|invalid tar header|failed to extract layer"
    r"|failed to unpack|layer verification failed|wrong diff id|invalid diff ?id|gzip: invalid header"
    r"|unsupported media ?type|blob unknown|unknown blob", re.IGNORECASE)
# The registry's answer about this reference: the renter's (a rate limit, below, depends on the registry).
REGISTRY_REFUSAL = re.compile(
    r"manifest unknown|not found|unauthorized|denied|no basic auth credentials|invalid reference format"
    r"|name unknown|name invalid|no matching manifest|repository does not exist|docker login"
    r"|(?:unexpected |http )?status(?: code)?:? 4[0-9][0-9]\b|server gave http response to https client",
    re.IGNORECASE)
RATE_LIMITED = re.compile(r"toomanyrequests|too many requests|rate limit", re.IGNORECASE)
# Registries whose reachability no renter controls: the node's network to them is the node's. Any other host is
# a renter's own registry: a name that does not resolve, a refused connection, a reset or a timeout there is
# judged theirs (a renter naming an unreachable host must not cost the node reliability at will), though the
# node's own network may be the cause; its catalogue pulls (Docker Hub) still count against it.
PUBLIC_REGISTRIES = frozenset(DOCKER_HUB_NAMES + (
    "registry-1.docker.io", "ghcr.io", "quay.io", "nvcr.io", "gcr.io", "mcr.microsoft.com", "public.ecr.aws",
    "registry.k8s.io"))


def pull_fault(text, reference, registry_auth):
    """Whose failure a failed `docker pull` of `reference` is, by docker's words: PULL_NODE_FAILED or
    PULL_REFUSED. The node's local failures first (a failing disk, its daemon gone); a full disk and what the
    image's layers hold are PULL_REFUSED (NO_SPACE, IMAGE_CONTENT: a renter can cause either at will, so neither
    counts against the node unless the platform's own catalogue image did it); then the registry's refusal; a rate
    limit is the node's from a public registry without the renter's login (its per-IP anonymous limit) and the
    renter's otherwise (their account, their registry); a TLS or network failure, a cut stream (a bare
    "unexpected EOF": the CLI losing dockerd, or the registry cutting the blob), and anything else, is the node's
    towards a public registry and the renter's towards their own."""
    if NODE_LOCAL.search(text):
        return PULL_NODE_FAILED
    if NO_SPACE.search(text) or IMAGE_CONTENT.search(text):
        return PULL_REFUSED
    parsed = parse_reference(reference) or {}
    domain = (parsed.get("domain") or "docker.io").lower()
    public = domain in PUBLIC_REGISTRIES
    if RATE_LIMITED.search(text):
        return PULL_NODE_FAILED if public and not registry_auth else PULL_REFUSED
    if REGISTRY_REFUSAL.search(text):
        return PULL_REFUSED
    return PULL_NODE_FAILED if public else PULL_REFUSED


def docker_config_json(reference, registry_auth):
    """A DOCKER_CONFIG's config.json: credentials for the reference's registry only, or none at all."""
    auths = {}
    if registry_auth:
        token = "%s:%s" % (registry_auth["username"], registry_auth["password"])
        auths[registry_key(reference)] = {"auth": base64.b64encode(token.encode()).decode()}
    return json.dumps({"auths": auths})


def pull_reason(text, registry_auth):
    """The registry's reason from docker's stderr, without docker's prefix and never with the password."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    reason = (lines[-1] if lines else "docker pull failed").replace("Error response from daemon: ", "")
    if registry_auth:
        reason = reason.replace(registry_auth["password"], "***")
    return reason[-800:]


def docker_pull(cfg, rec, registry_auth):
    """docker pull with a fresh, private DOCKER_CONFIG: the renter's credentials or none (never the node's).
    With GPUMARKET_DOCKER_PULL=missing a catalogue image already on the node is not pulled. A renter's own image
    (image_env) or one pulled with registry credentials always is, so that its registry decides whether this renter
    may read it: skipped, a renter without credentials started another renter's private image, cached by that
    renter's pull (found by review)."""
    image, vm_id = rec["spec"]["image"]["docker"], rec["vm_id"]
    own = bool(registry_auth) or bool(rec["spec"].get("image_env"))
    present = cfg.docker_pull == "missing" and not own and \
        run(["docker", "image", "inspect", image], check=False).returncode == 0
    if present:
        vm_log(cfg, vm_id, "image %s is present; not pulled (GPUMARKET_DOCKER_PULL=missing)" % image)
        return
    vm_log(cfg, vm_id, "pulling %s%s" % (image, " with registry credentials" if registry_auth else ""))
    config_dir = tempfile.mkdtemp(prefix="gpumarket-pull-")  # mode 0700
    try:
        write_file(os.path.join(config_dir, "config.json"), docker_config_json(image, registry_auth), 0o600)
        proc = run(["docker", "--config", config_dir, "pull", image], timeout=900, check=False)
    finally:
        shutil.rmtree(config_dir, ignore_errors=True)
    if proc.returncode != 0:
        text = proc.stderr or proc.stdout
        reason = pull_reason(text, registry_auth)
        code = pull_fault(text, image, registry_auth)
        vm_log(cfg, vm_id, "pull failed%s: %s" % (" (the node's failure)" if code == PULL_NODE_FAILED else "",
                                                  reason))
        raise AgentError(code, reason)
    done = [ln for ln in proc.stdout.splitlines() if ln.startswith(("Digest:", "Status:"))]
    vm_log(cfg, vm_id, "pulled %s%s" % (image, (": " + "; ".join(done)) if done else ""))


def image_command(image):
    """The image's own entrypoint + cmd, which the entry wrapper runs after its work."""
    proc = run(["docker", "image", "inspect", "--format", "{{json .Config}}", image])
    config = json.loads(proc.stdout) or {}
    return list(config.get("Entrypoint") or []) + list(config.get("Cmd") or [])


def image_volumes(image):
    """The paths the image declares as VOLUMEs (Config.Volumes), normalised and sorted. docker gives each one an
    anonymous volume under its data root, which no `--storage-opt size` bounds: only the writable layer is limited
    (review r53 #1). What the image says is the renter's: anything but an object of absolute paths counts as none."""
    proc = run(["docker", "image", "inspect", "--format", "{{json .Config}}", image])
    try:
        config = json.loads(proc.stdout) or {}
    except ValueError:
        config = {}
    volumes = config.get("Volumes") if isinstance(config, dict) else None
    if not isinstance(volumes, dict):
        return []
    return sorted({"/" + posixpath.normpath(path).lstrip("/") for path in volumes
                   if isinstance(path, str) and path.startswith("/")})
