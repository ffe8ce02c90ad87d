"""The sim runtime: a VM is an sshd of its own with a fake nvidia-smi showing only its GPUs."""
import contextlib
import json
import os
import pwd
import shlex
import socket
import subprocess
import sys
import time

from ..allocation import cards_now
from ..core import AgentError, read_json, run, write_file
from ..mig import list_text, sim_slices
from ..procs import kill_trees, local_address, pids_matching, port_free, ssh_banner, wait_port
from ..records import vm_dir, vm_log
from ..smi import QUERY_FIELDS, load_profile, parse_gpu_csv, split_smi_line
from .base import Runtime, os_release_pretty_name
from .simbox import BOX_FILE
from .simpull import sim_pull


def find_sshd():
    for path in ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd"):
        if os.access(path, os.X_OK):
            return path  # sshd refuses to start from a relative path (it re-executes itself)
    raise AgentError("command_not_found", "sshd is not installed on this node")


SIM_OWN_ENV = ("CUDA_VISIBLE_DEVICES", "GPUMARKET_SIM_VISIBLE", "HOME", "PATH")


def sim_vm_env(vmdir, visible_indices, visible_uuids, renter_env=None, mig_uuids=None):
    """The environment of a sim VM's sessions and onstart: the renter's names, then ours (which win). A VM given
    MIG slices sees those devices only (CUDA_VISIBLE_DEVICES=MIG-..., as the container toolkit sets it)."""
    env = dict(renter_env or {})
    env.update({"CUDA_VISIBLE_DEVICES": ",".join(mig_uuids) if mig_uuids else
                ",".join(str(i) for i in visible_indices),
                "GPUMARKET_SIM_VISIBLE": ",".join(visible_uuids),
                "HOME": os.path.join(vmdir, "home"),
                "PATH": os.path.join(vmdir, "bin") + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
    return env


def image_command_line(spec):
    """The VM's log line for the image's own command at each start. A sim VM runs no image, so no command: the line
    says what environment the docker runtime's entry wrapper would give it (dockerbox.py), the renter's env for
    the renter's own image only (the request's image_env, options.validate_options; a catalogue image's command
    runs without it), so that the platform's word is seen where its instance's logs are read. Names only: the
    values may be secrets, and the VM's log is on the node. The names the sim's own win over are left out, as in
    the VM's sessions and onstart (sim_vm_env)."""
    if not spec.get("image_env"):
        return ("the image's command (sim: none is run) would run without the renter's env, which onstart and SSH "
                "sessions get (not the renter's own image)")
    names = sorted(k for k in spec.get("env", {}) if k not in SIM_OWN_ENV)
    return "the image's command (sim: none is run) would get the renter's env: %s (the renter's own image)" % (
        ", ".join(names) or "none given")


def sshd_quote(value):
    # sshd_config splits arguments like a shell: inside double quotes only \\ and \" are escapes (misc.c argv_split).
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sim_sshd_config(vmdir, port, listen, visible_indices, visible_uuids, renter_env=None, mig_uuids=None):
    env = sim_vm_env(vmdir, visible_indices, visible_uuids, renter_env, mig_uuids)
    # sshd keeps the first SetEnv of a name, so ours come first: the renter cannot move HOME or PATH.
    order = [k for k in sorted(env) if k in SIM_OWN_ENV] + [k for k in sorted(env) if k not in SIM_OWN_ENV]
    return "\n".join([
        "Port %d" % port, "ListenAddress " + listen,
        "HostKey " + os.path.join(vmdir, "ssh_host_ed25519_key"),
        "PidFile " + os.path.join(vmdir, "sshd.pid"),
        "AuthorizedKeysFile " + os.path.join(vmdir, "authorized_keys"),
        "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes no", "PermitRootLogin prohibit-password", "PermitUserEnvironment no",
        "X11Forwarding no", "Subsystem sftp internal-sftp -d " + env["HOME"],
        # SetEnv is applied after sshd's default PATH, so the fake nvidia-smi in bin/ comes first.
        "SetEnv " + " ".join(sshd_quote("%s=%s" % (k, env[k])) for k in order), "",
    ])


def fake_nvidia_smi_script(python, agent_copy, gpus_file):
    return "#!/bin/sh\nexec %s %s _sim-nvidia-smi %s \"$@\"\n" % (
        shlex.quote(python), shlex.quote(agent_copy), shlex.quote(gpus_file))


class SimRuntime(Runtime):
    """A sim VM: its own sshd (as the node's login) and a box process (simbox.py) for ports and onstart.

    Modelled as a container would do it: the renter's env in every session and in onstart; onstart run once;
    each container port answered on its mapped host port; a volume mounted at /m is ~/m in the VM (a link to the
    volume's folder on the node, which outlives the VM); the OS is the node's own (a sim VM runs no image, so no
    image's command: the VM's log says at each start whether it would get the renter's env, image_command_line)."""
    name = "sim"

    @property
    def ssh_user(self):
        return pwd.getpwuid(os.getuid()).pw_name  # VM sshds run as the node's own login

    def host(self):
        return self.cfg.public_host or self.cfg.sim_listen

    def allocate(self, rec, records):
        rec["ssh_port"] = None  # picked at start: any free port
        rec["ports"] = {"%d/tcp" % p: None for p in rec["spec"].get("ports", ())}

    def provision(self, rec, registry_auth=None):
        vmdir = vm_dir(self.cfg, rec["vm_id"])
        if "docker" in rec["spec"]["image"] and not rec.get("pulled"):
            sim_pull(self.cfg, rec, registry_auth)
            rec["pulled"] = True
        for sub in ("bin", "home"):
            os.makedirs(os.path.join(vmdir, sub), exist_ok=True)
        key = os.path.join(vmdir, "ssh_host_ed25519_key")
        if not os.path.exists(key + ".pub"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(key)
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpumarket-vm-" + rec["vm_id"], "-f", key])
        with open(key + ".pub") as f:
            rec["ssh_host_key"] = " ".join(f.read().split()[:2])
        write_file(os.path.join(vmdir, "authorized_keys"), "\n".join(rec["spec"]["ssh_public_keys"]) + "\n")
        self.rebind(rec)
        # A private copy of the agent, so re-uploading or moving the agent never breaks a running VM.
        agent_copy = os.path.join(vmdir, "bin", "gpumarket_agent.pyz")
        from ..bundle import copy_agent  # only here: zipfile and the rest are not needed for a health check

        copy_agent(agent_copy)
        write_file(os.path.join(vmdir, "bin", "nvidia-smi"), fake_nvidia_smi_script(
            sys.executable, agent_copy, os.path.join(vmdir, "gpus.json")), 0o755)
        for volume in rec["spec"].get("volumes", ()):
            link = os.path.join(vmdir, "home", volume["mount"].lstrip("/"))
            os.makedirs(os.path.dirname(link), exist_ok=True)
            if not os.path.islink(link):
                os.symlink(self.volume_path(volume["name"]), link)
        if rec["spec"].get("onstart"):
            write_file(os.path.join(vmdir, "onstart.sh"), rec["spec"]["onstart"], 0o700)
        rec["os"] = host_os()
        self.checked_start(rec)

    def rebind(self, rec):
        # The VM's own nvidia-smi and CUDA_VISIBLE_DEVICES show only its GPUs (sshd_config is written at start):
        # the cards the spec names, by UUID where recorded, checked as a real runtime's are (cards_now): a card
        # the profile no longer lists, or lists at another index, is refused, never swapped for another.
        profile, gpus = load_profile(self.cfg.sim_profile)
        rows = [ln for ln in profile["nvidia_smi"] if ln.strip()]  # in parse_gpu_csv's order
        cards = cards_now(gpus, rec["spec"]["gpu_indices"], rec["spec"].get("gpu_uuids"))
        mine = sorted(gpus.index(g) for g in cards)
        mig = rec["spec"].get("mig_uuids")
        write_file(os.path.join(vm_dir(self.cfg, rec["vm_id"]), "gpus.json"), json.dumps({
            "cuda_version": profile.get("cuda_version"), "nvidia_smi": [rows[n] for n in mine],
            # a VM given MIG slices lists only those under its card (`nvidia-smi -L`)
            "mig": {str(i): s for i, s in sim_slices(profile).items()} if mig else {}, "mig_uuids": mig}), 0o644)
        rec["visible_uuids"] = list(mig) if mig else [gpus[n]["uuid"] for n in mine]

    def ssh_answers(self, rec):
        return bool(rec.get("ssh_port")) and ssh_banner(local_address(self.cfg.sim_listen), rec["ssh_port"])

    def free_port(self, port):
        if port and port_free(port, self.cfg.sim_listen):
            return port
        with socket.socket() as sock:
            sock.bind((self.cfg.sim_listen, 0))
            return sock.getsockname()[1]

    def start(self, rec):
        if self.state(rec) != "running":
            self.start_sshd(rec)
            vm_log(self.cfg, rec["vm_id"], "sshd listening on %s:%d" % (self.cfg.sim_listen, rec["ssh_port"]))
        if not pids_matching(self.box_needle(rec)):
            self.start_box(rec)
            # as a container's command runs at each start of its container (not again while it runs)
            vm_log(self.cfg, rec["vm_id"], image_command_line(rec["spec"]))

    def box_needle(self, rec):
        return os.path.join(vm_dir(self.cfg, rec["vm_id"]), "bin", "gpumarket_agent.pyz") + " _sim-box "

    def start_box(self, rec):
        vmdir = vm_dir(self.cfg, rec["vm_id"])
        for _ in range(3):  # as for sshd: a port picked free can be taken before the box binds it
            rec["ports"] = {name: self.free_port(port) for name, port in (rec.get("ports") or {}).items()}
            onstart = os.path.join(vmdir, "onstart.sh")
            write_file(os.path.join(vmdir, BOX_FILE), json.dumps({
                "vm_id": rec["vm_id"], "listen": self.cfg.sim_listen, "ports": rec["ports"],
                "onstart": onstart if os.path.exists(onstart) else None,
                "env": sim_vm_env(vmdir, rec["spec"]["gpu_indices"], rec.get("visible_uuids", []),
                                  rec["spec"].get("env"), rec["spec"].get("mig_uuids"))}))
            proc = subprocess.Popen(
                [sys.executable, os.path.join(vmdir, "bin", "gpumarket_agent.pyz"), "_sim-box", vmdir],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)  # outlives this agent run and its SSH session, as sshd does
            _DETACHED.append(proc)
            # Until every port answers, or the box exits (a port was taken: try others); slow only under load.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                if all(wait_port(self.cfg.sim_listen, p, 0.05) for p in rec["ports"].values()):
                    return
                time.sleep(0.02)
            kill_trees([proc.pid])
        raise AgentError("vm_start_failed", "the VM's ports did not come up: " + " ".join(self.logs(rec, 3)))

    def start_sshd(self, rec):
        vmdir = vm_dir(self.cfg, rec["vm_id"])
        config, log = os.path.join(vmdir, "sshd_config"), os.path.join(vmdir, "sshd.log")
        port = rec.get("ssh_port")
        for _ in range(3):  # a port picked free can be taken before sshd binds it: retry on another
            port = self.free_port(port)
            write_file(config, sim_sshd_config(vmdir, port, self.cfg.sim_listen, rec["spec"]["gpu_indices"],
                                               rec.get("visible_uuids", []), rec["spec"].get("env"),
                                               rec["spec"].get("mig_uuids")))
            write_file(log, "")
            # Without -D sshd daemonises (setsid, stdio to /dev/null), so it outlives this SSH session.
            run([find_sshd(), "-f", config, "-E", log],
                env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
            if wait_port(self.cfg.sim_listen, port):
                rec["ssh_port"] = port
                return
            kill_trees(pids_matching(config))
            port = None
        with open(log) as f:
            raise AgentError("vm_start_failed", "sshd did not come up: " + f.read()[-800:])

    def stop(self, rec):
        # The listener, the box, onstart and every live session under them: a stopped VM keeps nothing running.
        vmdir = vm_dir(self.cfg, rec["vm_id"])
        kill_trees(pids_matching(os.path.join(vmdir, "sshd_config")) + pids_matching(self.box_needle(rec)))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(vmdir, "sshd.pid"))

    def destroy(self, rec):
        self.stop(rec)

    def destroy_unrecorded(self, vm_id):
        rec = {"vm_id": vm_id}
        found = self.state(rec) == "running" or bool(pids_matching(self.box_needle(rec)))
        self.stop(rec)
        return found

    def state(self, rec):
        config = os.path.join(vm_dir(self.cfg, rec["vm_id"]), "sshd_config")
        return "running" if pids_matching(config) else "stopped"

    def health(self):
        load_profile(self.cfg.sim_profile)
        find_sshd()
        return True, "sim: ok"


_DETACHED = []  # box processes started by this agent run: never waited for, so never collected as garbage


def host_os():
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        with contextlib.suppress(OSError):
            with open(path) as f:
                return os_release_pretty_name(f.read())
    return None


def sim_nvidia_smi(args, gpus_file, out=sys.stdout):
    """The fake nvidia-smi inside a sim VM: only the VM's GPUs, in the table or --query-gpu csv form."""
    data = read_json(gpus_file)
    rows = [split_smi_line(line) for line in data["nvidia_smi"]]
    gpus = parse_gpu_csv("\n".join(data["nvidia_smi"]))
    query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
    if query is not None:
        fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "csv").split(",")
        fields = [f.strip() for f in query.split(",") if f.strip()]
        units = {"memory.total": "MiB", "power.limit": "W", "power.default_limit": "W"}
        if "noheader" not in fmt:
            out.write(", ".join(f + (" [%s]" % units[f] if f in units and "nounits" not in fmt else "")
                                for f in fields) + "\n")
        for raw in rows:
            cells = []
            for field in fields:
                value = raw[QUERY_FIELDS.index(field)] if field in QUERY_FIELDS else "[N/A]"
                if field in units and "nounits" not in fmt and not value.startswith("["):
                    value += " " + units[field]
                cells.append(value)
            out.write(", ".join(cells) + "\n")
        return 0
    if args in (["-L"], ["--list-gpus"]) and data.get("mig_uuids"):
        slices = {int(k): v for k, v in (data.get("mig") or {}).items()}
        out.write(list_text(gpus, slices, set(data["mig_uuids"])))
        return 0
    if args in (["-L"], ["--list-gpus"]):
        for g in gpus:
            out.write("GPU %d: %s (UUID: %s)\n" % (g["index"], g["name"], g["uuid"]))
        return 0
    if args:
        out.write("nvidia-smi (gpumarket sim) supports no options but --query-gpu=... --format=csv and -L\n")
        return 2
    bar = "+" + "-" * 41 + "+" + "-" * 22 + "+" + "-" * 22 + "+"

    def row(a, b, c):
        out.write("| %-39s | %-20s | %20s |\n" % (a, b, c))
    driver = gpus[0]["driver_version"] if gpus else "N/A"
    out.write(time.strftime("%a %b %d %H:%M:%S %Y") + "\n" + bar + "\n")
    out.write("| %-85s |\n" % ("NVIDIA-SMI %-20s Driver Version: %-12s CUDA Version: %s" % (
        driver, driver, data.get("cuda_version") or "N/A")))
    out.write(bar.replace("-", "=") + "\n")
    for g in gpus:
        power = "60W / %dW" % g["power_limit_w"] if g["power_limit_w"] else "N/A"
        row("%3d  %-28s  On" % (g["index"], g["name"][:28]), "%s Off" % g["pci_bus_id"],
            "0" if g["ecc_mode"] == "Enabled" else "N/A")
        row("N/A   30C    P0  %21s" % power, "%20s" % ("0MiB / %dMiB" % (g["memory_total_mib"] or 0)),
            "0%      Default")
        row("", "", g["mig_mode"] or "N/A")
        out.write(bar + "\n")
    return 0
