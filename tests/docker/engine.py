"""A real Docker engine and registry for the tests, started and stopped by them (tests/docker/conftest.py).

- dockerd (Debian's docker.io) with its own data root, exec root, socket and pid file under a temporary folder;
- Debian's docker-registry (registry v2) on a spare loopback port with htpasswd (bcrypt) authentication;
- the test image: a Debian root file system made by mmdebstrap (scripts/docker-test-setup, cached per machine, see
  CACHE), `docker import`ed with sshd as its command, and pushed to the registry.
Containers sit on the engine's own bridge; the tests reach them only through ports published on 127.0.0.1."""
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import bcrypt

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "docker-test-setup"
# Per machine, outside any checkout: the root file system (about 40 s of mmdebstrap, most of it CPU) outlives a clean
# clone (CI clones main afresh for every run) and is built again whenever scripts/docker-test-setup changes (its hash
# names the folder); the engine lock (tests/docker/conftest.py) is the machine's one, whichever checkout runs.
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpumarket" / "docker-test"
IMAGE = "gpumarket-test/debian-sshd:bookworm"  # what `docker import` makes
REGISTRY_USER, REGISTRY_PASSWORD = "tester", "registry-pass-8d3f"


def cannot_run_dockerd():
    """Why this machine cannot run a Docker engine at all, or None. Nothing else is a reason to skip."""
    if os.geteuid() != 0:
        return "dockerd needs root (tests/docker run only as root)"
    for need in ("/proc/self/ns/net", "/proc/self/ns/mnt", "/proc/self/ns/pid", "/sys/fs/cgroup"):
        if not os.path.exists(need):
            return f"the kernel lacks what containers need ({need} is missing)"
    return None


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check, timeout, what, log=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.1)
    tail = Path(log).read_text(errors="replace")[-3000:] if log and Path(log).exists() else ""
    raise RuntimeError(f"{what} did not come up within {timeout}s\n{tail}")


def rootfs_dir():
    """Where the root file system of this version of scripts/docker-test-setup is cached."""
    return CACHE / hashlib.sha256(SETUP.read_bytes()).hexdigest()[:16]


def setup_machine():
    """Packages and the cached root file system tarball (slow only the first time on a machine)."""
    proc = subprocess.run([str(SETUP), str(rootfs_dir())], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError("scripts/docker-test-setup failed:\n" + proc.stderr[-3000:])
    return Path(proc.stdout.strip().splitlines()[-1])


class Engine:
    """One dockerd: `env` points the docker CLI at it (DOCKER_HOST), `docker(...)` runs the CLI."""

    def __init__(self, base):
        self.base = Path(base)
        self.sock = self.base / "docker.sock"
        self.pidfile = self.base / "docker.pid"
        self.log = self.base / "dockerd.log"
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.sock}", DOCKER_CONFIG=str(self.base / "cli"))
        self.proc = None

    def start(self):
        (self.base / "cli").mkdir(mode=0o700, exist_ok=True)
        argv = ["dockerd", "--data-root", str(self.base / "data"), "--exec-root", str(self.base / "exec"),
                "-H", f"unix://{self.sock}", "--pidfile", str(self.pidfile), "--iptables=false",
                "--ip-masq=false", "--userland-proxy=true"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        wait_for(lambda: self.docker("version", "--format", "{{.Server.Version}}", timeout=5).returncode == 0,
                 60, "dockerd", self.log)

    def stop(self):
        if self.proc is None:
            return
        with contextlib.suppress(Exception):  # containers first, so their mounts go with them
            ids = self.docker("ps", "-aq", timeout=20).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, timeout=60)
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        # dockerd leaves overlay mounts behind when killed; unmount before the folder goes.
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f if str(self.base) in line.split()[1]]
        for mount in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)

    def docker(self, *args, timeout=120, input=None, check=False):
        proc = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              input=input)
        if check and proc.returncode != 0:
            raise RuntimeError("docker {}: {}".format(" ".join(args[:3]), proc.stderr.strip()[-2000:]))
        return proc

    def import_image(self, rootfs_tar, ref=IMAGE):
        if self.docker("image", "inspect", ref).returncode == 0:
            return ref
        proc = subprocess.run(["docker", "import", "--change", 'CMD ["/usr/local/sbin/gm-sshd"]',
                               "--change", "EXPOSE 22", str(rootfs_tar), ref], env=self.env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError("docker import: " + proc.stderr[-2000:])
        return ref


class Registry:
    """Debian's docker-registry on 127.0.0.1:<port> with one htpasswd user; docker trusts 127.0.0.0/8 over HTTP."""

    def __init__(self, base):
        self.base = Path(base)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.log = self.base / "registry.log"
        self.proc = None

    def start(self):
        self.base.mkdir(parents=True, exist_ok=True)
        htpasswd = self.base / "htpasswd"
        hashed = bcrypt.hashpw(REGISTRY_PASSWORD.encode(), bcrypt.gensalt(rounds=5)).decode()
        htpasswd.write_text(f"{REGISTRY_USER}:{hashed}\n")
        config = {"version": 0.1, "log": {"level": "info"},
                  "storage": {"filesystem": {"rootdirectory": str(self.base / "data")}, "delete": {"enabled": True}},
                  "http": {"addr": self.host, "secret": "test-only-secret"},
                  "auth": {"htpasswd": {"realm": "gpumarket-test", "path": str(htpasswd)}}}
        (self.base / "config.yml").write_text(json.dumps(config))  # JSON is YAML
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(["docker-registry", "serve", str(self.base / "config.yml")],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        wait_for(lambda: socket.create_connection(("127.0.0.1", self.port), timeout=1).close() is None, 30,
                 "docker-registry", self.log)

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def push(self, engine, local_ref, remote_name):
        """Tag and push with a throwaway docker login; answer the registry reference."""
        ref = f"{self.host}/{remote_name}"
        config = tempfile.mkdtemp(prefix="gm-push-")
        try:
            env = dict(engine.env, DOCKER_CONFIG=config)
            for argv, stdin in ((["login", "-u", REGISTRY_USER, "--password-stdin", self.host], REGISTRY_PASSWORD),
                                (["tag", local_ref, ref], None), (["push", ref], None)):
                proc = subprocess.run(["docker", *argv], env=env, capture_output=True, text=True, timeout=300,
                                      input=stdin)
                if proc.returncode != 0:
                    raise RuntimeError(f"docker {argv[0]}: {proc.stderr[-2000:]}")
        finally:
            shutil.rmtree(config, ignore_errors=True)
        return ref
