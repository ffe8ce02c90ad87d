"""Processes and ports."""
import contextlib
import os
import signal
import socket
import time


def proc_table():
    """{pid: (ppid, cmdline)} of live (non-zombie) processes."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
            with open("/proc/%s/cmdline" % name, "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            table[int(name)] = (int(fields[1]), cmdline)
    return table


def pids_matching(needle, table=None):
    # sshd rewrites its title but keeps "-f <config>" in the listener's, so the config path finds it.
    table = proc_table() if table is None else table
    return [pid for pid, (_, cmd) in table.items() if needle in cmd]


def kill_trees(roots, timeout=3.0):
    """SIGTERM the roots and all their descendants, SIGKILL what is left after `timeout`."""
    table = proc_table()
    spared, pid = set(), os.getpid()
    while pid > 1 and pid in table:  # never ourselves or our ancestors
        spared.add(pid)
        pid = table[pid][0]
    victims, stack = set(), [p for p in roots if p in table]
    while stack:
        pid = stack.pop()
        if pid not in victims and pid not in spared:
            victims.add(pid)
            stack.extend(child for child, (ppid, _) in table.items() if ppid == pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            victims &= set(proc_table())
            if not victims:
                return
            time.sleep(0.02)


def port_free(port, host="0.0.0.0"):  # noqa: S104 - docker publishes VM ports on all interfaces
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as sshd and dockerd bind
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def wait_port(host, port, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return True
        time.sleep(0.02)
    return False


def local_address(bind):
    """The address to reach, from the node itself, a port published on `bind` (all interfaces: loopback)."""
    if not bind or bind == "0.0.0.0":  # noqa: S104 - reading the bind address, not binding
        return "127.0.0.1"
    bind = bind.strip("[]")
    return "::1" if bind == "::" else bind


def ssh_banner(host, port, timeout=5.0):
    """Whether an SSH server answers on host:port with its banner within `timeout`: a listener that says nothing,
    or something else, is none (the platform's own wait for the VM's SSH reads the same four bytes)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2) as sock:
            sock.settimeout(2)
            if sock.recv(4).startswith(b"SSH-"):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
