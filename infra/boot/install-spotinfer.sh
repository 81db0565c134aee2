#!/usr/bin/env bash
# Installs spotinfer into its own virtualenv and starts the systemd units a VM's role needs.
#
# Shared by the AWS user data and the GCP startup script, which write
# /etc/spotinfer/spotinfer.env and the unit files first, then call this with:
#   SPOTINFER_PACKAGE   pip requirement, e.g. "spotinfer[gpu]==0.1.0" or a wheel URL
#   SPOTINFER_UNITS     units to enable, e.g. "spotinfer-daemon.service spotinfer-worker.service"
#   SPOTINFER_PIP_ARGS  optional extra pip arguments (an internal index, --no-cache-dir, ...)
#
# Safe to run again: GCP runs startup scripts on every boot, and a stopped-then-restarted
# spot VM must not spend its first minutes reinstalling an unchanged package.
set -euo pipefail

: "${SPOTINFER_PACKAGE:?set SPOTINFER_PACKAGE to the pip requirement for spotinfer}"
: "${SPOTINFER_UNITS:?set SPOTINFER_UNITS to the systemd units to start}"

prefix=/opt/spotinfer
venv="$prefix/venv"
stamp="$prefix/installed-package"

if ! id -u spotinfer >/dev/null 2>&1; then
  useradd --system --home-dir /var/lib/spotinfer --shell /usr/sbin/nologin spotinfer
fi
install -d -m 0755 "$prefix"

# GPU images ship one system Python; prefer the newest that spotinfer supports (>= 3.10).
python_bin=""
for candidate in python3.12 python3.11 python3.10; do
  if command -v "$candidate" >/dev/null 2>&1; then
    python_bin=$(command -v "$candidate")
    break
  fi
done
if [ -z "$python_bin" ]; then
  echo "no Python >= 3.10 on this image; use a GPU image with a recent Python" >&2
  exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
  if ! "$python_bin" -m venv "$venv"; then
    # Debian and Ubuntu split venv out of the interpreter package.
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$(basename "$python_bin")-venv"
    "$python_bin" -m venv "$venv"
  fi
fi

if [ "$(cat "$stamp" 2>/dev/null || true)" != "$SPOTINFER_PACKAGE" ]; then
  "$venv/bin/pip" install --quiet --upgrade pip
  # shellcheck disable=SC2086  # SPOTINFER_PIP_ARGS is a list of words on purpose
  "$venv/bin/pip" install --quiet ${SPOTINFER_PIP_ARGS:-} "$SPOTINFER_PACKAGE"
  echo "$SPOTINFER_PACKAGE" >"$stamp"
fi

# The env file carries the Redis AUTH token: root and systemd read it, nobody else.
chown root:root /etc/spotinfer/spotinfer.env
chmod 0600 /etc/spotinfer/spotinfer.env

systemctl daemon-reload
# shellcheck disable=SC2086  # one word per unit
systemctl enable --now $SPOTINFER_UNITS
echo "spotinfer: started $SPOTINFER_UNITS"
