#!/bin/bash
# Start sshd for the renter. The agent bind-mounts the renter's keys read-only at
# /root/.ssh/authorized_keys; that file belongs to the agent's user on the host, which sshd's
# StrictModes would refuse, so a root-owned copy is what sshd reads (AuthorizedKeysFile).
set -euo pipefail

mounted=/root/.ssh/authorized_keys
if [ ! -s "$mounted" ]; then
    echo "gpumarket: no keys mounted at $mounted; refusing to start sshd" >&2
    exit 1
fi
install -d -m 0755 -o root -g root /etc/ssh/gpumarket
install -m 0600 -o root -g root "$mounted" /etc/ssh/gpumarket/authorized_keys

ssh-keygen -A >/dev/null  # this container's own host keys, on first start only
install -d -m 0755 /run/sshd

# On a docker node the platform's entry wrapper runs this script as the image's command, after it has
# started sshd itself and put the renter's env where SSH sessions read it (its lines at the end of
# /etc/environment, the same as its box's `environment`; /etc/profile.d/gpumarket-env.sh):
# provisioning/agent/gpumarket_agent/runtimes/dockerbox.py. Its box is mounted at /.gpumarket.
wrapper=/.gpumarket

# sshd starts sessions with a clean environment: hand the image's variables (PATH to conda or
# python, CUDA and NVIDIA settings from the base image and the container toolkit) to SSH sessions:
# /etc/environment through PAM for every session, /etc/profile.d for login shells.
keep='^(PATH|LD_LIBRARY_PATH|LIBRARY_PATH|CUDA_[A-Z0-9_]*|NVIDIA_[A-Z0-9_]*|NV_[A-Z0-9_]*|NCCL_[A-Z0-9_]*|CONDA_[A-Z0-9_]*|PYTORCH_[A-Z0-9_]*|TF_[A-Z0-9_]*|PYTHON[A-Z0-9_]*|LANG|LC_ALL)$'
environment="" profile=""
for name in $(compgen -e | grep -E "$keep" || true); do
    value=${!name}
    case "$value" in *'"'* | *$'\n'*) continue ;; esac
    printf -v line '%s="%s"\n' "$name" "$value" && environment+=$line
    printf -v line 'export %s=%q\n' "$name" "$value" && profile+=$line
done
printf '%s' "$profile" >/etc/profile.d/00-gpumarket-env.sh
if [ -d "$wrapper" ]; then
    # The image's lines, then the wrapper's (the renter's env, which wins: pam_env keeps a name's last
    # line). Before, this truncated /etc/environment and SSH sessions lost the renter's env.
    { printf '%s' "$environment"; cat "$wrapper/environment" 2>/dev/null || true; } >/etc/environment
    # The wrapper's sshd holds port 22: a second one could not bind (it exited 1). Wait, quietly.
    exec sleep infinity
fi
printf '%s' "$environment" >/etc/environment
exec /usr/sbin/sshd -D -e
