"""`serve`: one long-lived agent on one SSH channel, answering read-only commands one JSON line at a time.

The platform's fleet health check would otherwise start the agent's Python on the node (~60-200 ms of node CPU)
and open an SSH channel with an exec (paramiko packets and Python on the platform) for every probe. Over a kept
connection it starts `serve` once; a probe is then one line written and one line read:

    -> {"id": 7, "command": "health", "request": {}}
    <- {"id": 7, "ok": true, ...the command's answer...}

Only the commands given to serve() (read-only ones: `health`) are served; a request is validated as strictly as
on the command line (unknown fields refused, the request an object, at most MAX_REQUEST_BYTES a line). It stops
at the end of its input (the platform closed the channel, or the connection died: sshd closes it) and when the
agent's own file was removed or replaced (an upgrade, a clean-up): it answers `agent_missing` then, so the
platform checks the agent over SFTP again and starts the current one.
"""
import json
import os
import sys

from .core import AGENT_VERSION, MAX_REQUEST_BYTES, AgentError, Config, invalid

_FIELDS = ("id", "command", "request")


def _identity(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size


def parse_request(line, commands):
    """(id, handler, request) from one line; raises AgentError (its id is None when it could not be read)."""
    try:
        msg = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid("request", "the line is not JSON: %s" % exc) from None
    except RecursionError:  # bad input, not the agent's own bug
        raise invalid("request", "the line is nested too deeply") from None
    if not isinstance(msg, dict):
        raise invalid("request", "each line must be a JSON object")
    extra = sorted(set(msg) - set(_FIELDS))
    if extra:
        raise invalid(extra[0], "unknown field %r" % extra[0])
    rid = msg.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < 2 ** 53:
        raise invalid("id", "id must be an integer from 0 to 2**53 - 1")
    command = msg.get("command")
    if not isinstance(command, str) or command not in commands:
        raise AgentError("invalid_request", "command must be one of %s" % ", ".join(sorted(commands)), "command")
    req = msg.get("request", {})
    if not isinstance(req, dict):
        raise invalid("request", "the request must be a JSON object")
    return rid, commands[command], req


def _error(exc):
    error = {"code": exc.code, "message": exc.message}
    if exc.field:
        error["field"] = exc.field
    return {"ok": False, "agent_version": AGENT_VERSION, "error": error}


def serve(env, commands, stdin=None, stdout=None, me=None):
    """Answer requests until the end of stdin; returns the exit status."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    me = me or os.path.abspath(sys.argv[0])
    started_as = _identity(me)
    try:  # held open, its inode cannot be reused by a new file: a replaced file always shows
        held = open(me, "rb")  # noqa: SIM115
    except OSError:
        held = None
    try:
        return _loop(env, commands, stdin, stdout, me, started_as)
    finally:
        if held is not None:
            held.close()


def _loop(env, commands, stdin, stdout, me, started_as):
    try:
        cfg = Config(env)
    except AgentError as exc:
        cfg, config_error = None, exc
    while True:
        line = stdin.readline(MAX_REQUEST_BYTES + 1)
        if not line:
            return 0
        if len(line) > MAX_REQUEST_BYTES:  # the rest of that line cannot be told from the next request
            answer = _error(invalid("request", "request larger than 1 MiB"))
            answer["id"] = None
            _write(stdout, answer)
            return 2
        rid = None
        try:
            rid, handler, req = parse_request(line, commands)
            if _identity(me) != started_as:
                answer = _error(AgentError("agent_missing", "the agent's file was removed or replaced"))
            elif cfg is None:
                answer = _error(config_error)
            else:
                answer = handler(cfg, req)
                answer.update(ok=True, agent_version=AGENT_VERSION)
        except AgentError as exc:
            answer = _error(exc)
        except Exception as exc:  # one JSON line per request, even for our own bugs
            answer = _error(AgentError("internal_error", "%s: %s" % (type(exc).__name__, exc)))
        answer["id"] = rid
        _write(stdout, answer)
        if answer.get("error", {}).get("code") == "agent_missing":
            return 1


def _write(stdout, answer):
    stdout.write(json.dumps(answer, sort_keys=True).encode() + b"\n")
    stdout.flush()
