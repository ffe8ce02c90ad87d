"""The docker runtime's image: `docker pull` with a fresh, private DOCKER_CONFIG holding the renter's registry
credentials or none (never the node's), the registry's reason when it fails (the password masked), and the
image's own entrypoint + cmd, which the entry wrapper runs after its work, and the paths it declares as VOLUMEs."""
import base64
import json
import os
import posixpath
import shutil
import tempfile

from ..core import AgentError, run, write_file
from ..records import vm_log
from ..reference import registry_key


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
        reason = pull_reason(proc.stderr or proc.stdout, registry_auth)
        vm_log(cfg, vm_id, "pull failed: " + reason)
        raise AgentError("pull_failed", reason)
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
