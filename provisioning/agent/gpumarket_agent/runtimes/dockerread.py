"""Reading what a container controls, with bounded memory and time: a command's output cut at a byte limit
(bounded_output), the tail of `docker logs` with each line cut (container_log_tail), and the container's
/etc/os-release through `docker cp` (read_os)."""
import collections
import contextlib
import io
import subprocess
import tarfile
import time

from ..core import AgentError, safe_text
from .base import os_release_pretty_name, vm_name

MAX_OS_RELEASE = 64 * 1024  # the tar of /etc/os-release as docker cp streams it
MAX_HOST_KEY = 4096
MAX_LOG_LINE = 4096  # a container's log line longer than this is cut
MAX_LOG_BYTES = 64 * 1024 * 1024  # read from `docker logs` for one logs command


def bounded_output(argv, limit, timeout=30):
    """(returncode, stdout bytes, too_long) of a command whose output the container controls: at most `limit`
    bytes are read; past that the command is killed and too_long is True."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        raise AgentError("command_not_found", "%s is not installed on this node" % argv[0]) from None
    chunks, size, deadline = [], 0, time.monotonic() + timeout
    try:
        while size <= limit and time.monotonic() < deadline:
            chunk = proc.stdout.read1(min(65536, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        too_long = size > limit or time.monotonic() >= deadline
        if too_long:
            proc.kill()
        proc.stdout.close()
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    return code, b"".join(chunks)[:limit], too_long


def container_log_tail(argv, tail, max_line=MAX_LOG_LINE, max_bytes=MAX_LOG_BYTES, timeout=60):
    """The last `tail` lines a command prints (stdout and stderr), each cut at max_line bytes, reading at most
    max_bytes: memory stays bounded however long a line the container wrote. [] if the command fails."""
    lines, current, size, cut = collections.deque(maxlen=tail), bytearray(), 0, False
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        return []
    deadline = time.monotonic() + timeout
    ended = False
    try:
        while size < max_bytes and time.monotonic() < deadline:
            chunk = proc.stdout.read1(65536)
            if not chunk:
                ended = True
                break
            size += len(chunk)
            for n, piece in enumerate(chunk.split(b"\n")):
                if n:
                    lines.append(bytes(current))
                    current, cut = bytearray(), False
                if not cut:
                    current += piece[:max_line - len(current)]
                    cut = len(current) >= max_line
        if current:
            lines.append(bytes(current))
    finally:
        if not ended:
            proc.kill()  # past the bounds: what was read is kept
        proc.stdout.close()
        code = proc.wait()
    if ended and code != 0:
        return []
    return [safe_text(ln.decode("utf-8", "replace")) for ln in lines]  # a program's NUL refused the whole answer


def read_os(vm_id):
    """PRETTY_NAME of the container's /etc/os-release (a created container is enough: docker cp reads it).
    The image controls that file: at most MAX_OS_RELEASE bytes are read."""
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        with contextlib.suppress(OSError, subprocess.SubprocessError, tarfile.TarError, AttributeError, AgentError):
            code, out, too_long = bounded_output(
                ["docker", "cp", "-L", "%s:%s" % (vm_name(vm_id), path), "-"], MAX_OS_RELEASE)
            if code == 0 and not too_long:
                with tarfile.open(fileobj=io.BytesIO(out)) as tar:
                    member = tar.next()
                    if member is None or not member.isfile() or member.size > MAX_OS_RELEASE:
                        continue
                    text = tar.extractfile(member).read(MAX_OS_RELEASE).decode("utf-8", "replace")
                    return os_release_pretty_name(text)
    return None
