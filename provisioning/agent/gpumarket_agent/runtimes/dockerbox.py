"""What the docker runtime puts beside a container: the entry wrapper and the env files for SSH sessions.

The box folder (<vm dir>/box) is mounted read-only at /.gpumarket; the wrapper keeps its state (the onstart
marker) in /.gpumarket-state inside the container's own writable layer (kept across stop/start, bounded by the
container's disk limit: nothing the renter writes lands in a host folder), or in $HOME when the image's user
cannot write /. The container runs `/bin/sh /.gpumarket/entry.sh <image's own command>`.

The image's command (ENTRYPOINT + CMD) runs as the wrapper's child with stdin from /dev/null, and the container stays
up when it exits: a command that exits at once without a terminal (a bare shell: ubuntu's and debian's CMD bash,
nvidia/cuda's entrypoint that execs bash when given nothing, `CMD bash` as `sh -c bash`, `bash -l`) had the
container crash-loop under `--restart unless-stopped`, killing sshd and the renter's sessions every time (found by
review: recognising shells in the argv missed all but `["/bin/bash"]`). `docker stop` ends it at once: the wrapper
traps TERM and INT, stops the command and exits.

The renter's env is no part of the container's environment: the wrapper's own steps (the env files for SSH
sessions, the host key, sshd) run in the image's environment with the platform's PATH, and a catalogue image's command
in the image's own environment. Only what the renter runs gets the env: onstart (the wrapper exports each NAME=value
line of the box's renter.env, taken literally, in onstart's subshell alone), their SSH sessions (/etc/environment for
pam_env, /etc/profile.d for login shells) and the command of the renter's own image (the platform's "image_env": the
agent puts an image-env marker in the box, and the wrapper exports renter.env the same way in the command's subshell):
a vLLM, TGI or Jupyter image reads MODEL_ID, HF_TOKEN or JUPYTER_TOKEN from it, and that image's SSH server is the
renter's to keep up anyway (provisioning/services/vms.py). Before, the env was the container's environment, so the
wrapper's own: PATH=/nowhere and no host key was made (ssh-keygen not found), sshd could not start, and the wrapper's
last loop spun (sleep not found); and the image's command (every catalogue image's runs a bash script:
provisioning/images) ran with it, where BASH_ENV alone runs code as root (bash expands it). So the renter's env could
silence the VM's SSH server, and a catalogue image's silence with any env had to be taken as the renter's (found by
review). Then no image's command got the env, and a renter's own image reading its settings from it (docker run -e,
as on other GPU clouds) lost them (found by review)."""
import shlex

# POSIX sh, run as the image's user. Nothing in it comes from a request: the renter's env reaches it only as files
# written by the agent (renter.env, read line by line and exported as it is, never parsed as shell code; profile.sh
# and environment, copied for SSH sessions; image-env, an empty marker); onstart is a file it runs.
ENTRY_SH = r"""#!/bin/sh
# gpumarket entry: env for SSH sessions, host keys, sshd (unless the image's command is one), onstart once,
# then the image's own command as a child; the container stays up when it exits.
G=/.gpumarket
S=/.gpumarket-state
# The wrapper's own steps find their programs on the platform's PATH; the image's command gets the image's.
IMAGE_PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
say() { echo "[gpumarket] $*"; }
renter_env() {
    # The renter's env, for the renter's own processes only: NAME=value lines (names checked by the agent, values
    # one line each), each exported as it is (a name the shell keeps read-only is skipped).
    [ -f "$G/renter.env" ] || return 0
    while IFS= read -r line; do
        command export "$line" 2>/dev/null || say "env: ${line%%=*} cannot be set here"
    done < "$G/renter.env"
}
mkdir -p "$S" 2>/dev/null && [ -w "$S" ] || { S="${HOME:-/tmp}/.gpumarket-state"; mkdir -p "$S" 2>/dev/null; }
if [ -w /etc ]; then
    if [ -f "$G/profile.sh" ]; then
        mkdir -p /etc/profile.d && cp "$G/profile.sh" /etc/profile.d/gpumarket-env.sh &&
            chmod 644 /etc/profile.d/gpumarket-env.sh
    fi
    if [ -f "$G/environment" ]; then
        if [ ! -f "$S/environment.orig" ]; then
            cat /etc/environment > "$S/environment.orig" 2>/dev/null || : > "$S/environment.orig"
        fi
        cat "$S/environment.orig" "$G/environment" > /etc/environment
    fi
    KEYGEN=""
    for candidate in /usr/bin/ssh-keygen /usr/local/bin/ssh-keygen; do
        [ -x "$candidate" ] && KEYGEN=$candidate && break
    done
    if [ -n "$KEYGEN" ] && [ -d /etc/ssh ] && ! ls /etc/ssh/ssh_host_*_key >/dev/null 2>&1; then
        # One ed25519 host key per container (an image must not carry keys; RSA ones take seconds to make).
        "$KEYGEN" -q -t ed25519 -N "" -f /etc/ssh/ssh_host_ed25519_key </dev/null >/dev/null 2>&1
    fi
fi
SSHD=""
for candidate in /usr/sbin/sshd /usr/local/sbin/sshd; do
    [ -x "$candidate" ] && SSHD=$candidate && break
done
case "${1:-}" in
    *sshd) ;;
    *) if [ -n "$SSHD" ]; then
           mkdir -p /run/sshd 2>/dev/null
           if "$SSHD" -e; then say "sshd started"; else say "sshd did not start"; fi
       else
           say "the image has no sshd: SSH will not answer"
       fi ;;
esac
if [ -f "$G/onstart.sh" ] && [ ! -e "$S/onstart.started" ]; then
    : > "$S/onstart.started"
    say "onstart: running"
    ( PATH=$IMAGE_PATH; renter_env; cd "${HOME:-/}" 2>/dev/null; /bin/sh "$G/onstart.sh"; say "onstart: exited $?"
    ) </dev/null 2>&1 &
fi
SLEEPER=""
stop() {
    trap - TERM INT QUIT WINCH
    [ -n "$SLEEPER" ] && kill "$SLEEPER" 2>/dev/null
    exit 0
}
# docker stop's signal (TERM, or the image's STOPSIGNAL: INT, QUIT, httpd's WINCH) reaches the image's command
# through docker-init, which signals the whole process group (TINI_KILL_PROCESS_GROUP, dockerargv); the wrapper
# then ends too, once the command has.
trap stop TERM INT QUIT WINCH
if [ $# -gt 0 ]; then
    # Not exec: a command that exits (a shell reading EOF) must not end the container. In the foreground: sh starts
    # a background command with SIGINT and SIGQUIT ignored, for it and everything it starts (no Ctrl-C in a
    # terminal the image opens; found by review). In the image's environment, with the renter's env for their own
    # image only (above).
    ( PATH=$IMAGE_PATH; if [ -f "$G/image-env" ]; then renter_env; fi; exec "$@" ) </dev/null
    RC=$?
    say "the image's command exited $RC; the instance stays up for SSH"
    case "$1" in
        *sshd) # The image's own sshd was SSH: a failed one is replaced by the wrapper's (one that daemonised
               # exited 0 and still serves).
            if [ "$RC" -ne 0 ] && [ -n "$SSHD" ]; then
                mkdir -p /run/sshd 2>/dev/null
                if "$SSHD" -e; then say "sshd started"; else say "sshd did not start"; fi
            fi ;;
    esac
fi
while :; do
    sleep 3600 &
    SLEEPER=$!
    wait "$SLEEPER"
done
"""


def env_file(env):
    """The box's renter.env: NAME=value lines, each exported as it is by the wrapper for onstart and for the command
    of the renter's own image (values hold no CR/LF: options.validate_env)."""
    return "".join("%s=%s\n" % (k, v) for k, v in sorted(env.items()))


def profile_sh(env):
    """/etc/profile.d/gpumarket-env.sh: every name, exactly, for login shells."""
    return "".join("export %s=%s\n" % (k, shlex.quote(v)) for k, v in sorted(env.items()))


def pam_safe(value):
    # pam_env reads /etc/environment loosely: '#' starts a comment, '\' escapes, outer quotes are stripped.
    return "#" not in value and "\\" not in value and value[:1] not in ("'", '"') and value.strip() == value


def pam_environment(env):
    """/etc/environment lines (pam_env: every SSH session) for the values it carries exactly."""
    return "".join("%s=%s\n" % (k, v) for k, v in sorted(env.items()) if v and pam_safe(v))
