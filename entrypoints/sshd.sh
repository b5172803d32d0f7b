#!/bin/sh
# OpenSSH for the training container, run as the non-root user: keys only, no passwords, no
# root login (sshd without root cannot switch to another user at all). Host keys are made at
# first start in $GPUFEED_SSH_HOST_KEY_DIR (a volume), so they survive restarts and no image
# layer holds one.
#
# Authorized keys, all that are given are used: SSH_AUTHORIZED_KEYS (one or more keys, newline
# separated), PUBLIC_KEY (the RunPod name), and the file SSH_AUTHORIZED_KEYS_FILE (default
# /run/secrets/authorized_keys, e.g. a compose secret or a read-only bind mount).
set -eu

log() { printf 'gpufeed sshd: %s\n' "$*" >&2; }

key_dir=${GPUFEED_SSH_HOST_KEY_DIR:-/var/lib/gpufeed/ssh}
port=${GPUFEED_SSH_PORT:-2222}
run_dir=${GPUFEED_SSH_RUN_DIR:-/run/gpufeed-sshd}
keys_file=${SSH_AUTHORIZED_KEYS_FILE:-/run/secrets/authorized_keys}
user=$(id -un)

if [ "$(id -u)" = 0 ]; then
    log "refusing to run sshd as root; run the image as its default user"
    exit 64
fi

umask 077
mkdir -p "$HOME/.ssh" "$run_dir"
chmod 700 "$HOME/.ssh"
authorized="$HOME/.ssh/authorized_keys"
{
    if [ -n "${SSH_AUTHORIZED_KEYS:-}" ]; then printf '%s\n' "$SSH_AUTHORIZED_KEYS"; fi
    if [ -n "${PUBLIC_KEY:-}" ]; then printf '%s\n' "$PUBLIC_KEY"; fi
    if [ -r "$keys_file" ]; then cat "$keys_file"; echo; fi
} | grep -E '^(ssh-|ecdsa-|sk-)' >"$authorized.new" || true
if [ ! -s "$authorized.new" ]; then
    rm -f "$authorized.new"
    log "no public key given: set SSH_AUTHORIZED_KEYS or PUBLIC_KEY to your public key" \
        "(e.g. SSH_AUTHORIZED_KEYS=\"\$(cat ~/.ssh/id_ed25519.pub)\"), or mount an" \
        "authorized_keys file at $keys_file; password logins are disabled"
    exit 65
fi
mv "$authorized.new" "$authorized"
log "$(wc -l <"$authorized" | tr -d ' ') authorized key(s) for $user"

if [ ! -w "$key_dir" ]; then
    log "host key folder $key_dir is not writable by $user; mount a volume there"
    exit 66
fi
for type in ed25519 rsa; do
    key="$key_dir/ssh_host_${type}_key"
    if [ ! -s "$key" ]; then
        ssh-keygen -q -t "$type" -N '' -C "gpufeed-$(hostname)" -f "$key"
        log "made host key $(ssh-keygen -l -f "$key.pub")"
    fi
done

# SSH sessions start with a clean environment; hand them the container's: the venv on PATH,
# NVIDIA_*/CUDA_* for the driver libraries, the dataset path, our own settings, and
# torch.compile's cache folders (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR: the cache volume).
config="$run_dir/sshd_config"
{
    cat <<CONFIG
Port $port
ListenAddress 0.0.0.0
HostKey $key_dir/ssh_host_ed25519_key
HostKey $key_dir/ssh_host_rsa_key
PidFile $run_dir/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
AllowUsers $user
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
PermitEmptyPasswords no
UsePAM no
StrictModes yes
PrintMotd no
X11Forwarding no
AllowTcpForwarding yes
Subsystem sftp internal-sftp
CONFIG
    env | grep -E '^(PATH|VIRTUAL_ENV|LANG|LC_ALL|LD_LIBRARY_PATH|PYTHON[A-Z_]*|NVIDIA_[A-Z_]*|CUDA_[A-Z_]*|NCCL_[A-Z_]*|TORCH_[A-Z_]*|TORCHINDUCTOR_[A-Z_]*|TRITON_[A-Z_]*|HF_[A-Z_]*|GPUFEED_[A-Z_]*|OMP_NUM_THREADS)=' \
        | grep -v '"' | {
            # sshd takes only the first SetEnv line, so all of them go on one.
            printf 'SetEnv'
            while IFS='=' read -r name value; do printf ' %s="%s"' "$name" "$value"; done
            printf '\n'
        }
} >"$config"

/usr/sbin/sshd -t -f "$config"
log "listening on port $port (keys only, user $user)"
exec /usr/sbin/sshd -D -e -f "$config"
