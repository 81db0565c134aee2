"""The secrets a Terraform fleet's VMs read at boot, made as an operator makes them, and the
cloud CLIs that hand them out.

    operator (docs/deploy.md, docs/security.md)          a VM's boot script
    spotinfer certs ca / node ─▶ <name>-tls-coordinator ─┐
                               ▶ <name>-tls-worker     ──┼─▶ aws secretsmanager get-secret-value
    spotinfer keys add        ─▶ (coordinator's api_keys)│   gcloud secrets versions access latest
    new_keyring_text          ─▶ <name>-kv-mac          ──┤        (stand-ins on the VM's PATH)
    ElastiCache / Memorystore ─▶ the Redis AUTH token   ──┘

The bundles are JSON ``{"ca", "cert", "key"[, "api_keys"]}`` as docs/security.md puts them,
the keyring ``<id>:<hex key>`` lines, the AUTH token plain text. One bundle per role, as
Terraform makes one secret per role: every worker VM gets the same worker certificate (roles
worker and daemon), so it names every address a rehearsal VM can have, as a deployed one
would name the workers' subnet or DNS names. The rehearsal itself keeps an operator
certificate (ListWorkers, the greedy reference straight on a worker) and two API keys: a
tenant's (the client VM's streams) and an admin's.

The stand-ins answer the exact calls of the rendered boot scripts, with the CLIs' own output:
``aws ... --query SecretString --output text`` prints the string and a newline; ``gcloud
secrets versions access`` prints the payload's bytes as stored. A secret they do not hold,
or an option they do not know, fails as the real CLI fails (a message on stderr, a non-zero
exit), so the boot script stops where it would stop on a VM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.api_keys import ADMIN_ROLE, TENANT_ROLE, append_key, new_key
from common.authz import COORDINATOR, DAEMON, OPERATOR, WORKER
from common.channels import TransportConfig
from spotinfer.local.certs import CertPaths, make_ca, make_node_cert
from store.mac_keyring import new_keyring_text

TENANT = "rehearsal"
SECRETS_FOLDER = "secrets"  # in a VM's rehearsal-bin: what the stand-ins serve
KEYS_FILE = "keys.jsonl"
CLI_NAMES = ("aws", "gcloud")


@dataclass(frozen=True)
class SecretIds:
    """Where the boot template finds each secret (Terraform's boot_settings)."""

    redis: str
    tls_coordinator: str
    tls_worker: str
    kv_mac: str

    def values(self, cloud: str) -> dict[str, str]:
        """The template variables that name the secrets, for `cloud`."""
        if cloud == "aws":
            return {
                "redis_secret_arn": self.redis,
                "tls_secret_arn_coordinator": self.tls_coordinator,
                "tls_secret_arn_worker": self.tls_worker,
                "kv_mac_secret_arn": self.kv_mac,
            }
        return {
            "redis_secret_id": self.redis,
            "tls_secret_id_coordinator": self.tls_coordinator,
            "tls_secret_id_worker": self.tls_worker,
            "kv_mac_secret_id": self.kv_mac,
        }


def secret_ids(cloud: str, name: str = "spotinfer-rehearsal") -> SecretIds:
    """The ids Terraform's defaults give (`<name>-tls-<role>`, `<name>-kv-mac`): ARNs on AWS,
    Secret Manager ids on GCP."""
    if cloud == "aws":
        arn = "arn:aws:secretsmanager:us-east-1:000000000000:secret:"
        return SecretIds(
            f"{arn}{name}-redis-auth",
            f"{arn}{name}-tls-coordinator",
            f"{arn}{name}-tls-worker",
            f"{arn}{name}-kv-mac",
        )
    return SecretIds(
        f"{name}-redis-auth", f"{name}-tls-coordinator", f"{name}-tls-worker", f"{name}-kv-mac"
    )


def tls_bundle(ca: CertPaths, node: CertPaths, api_keys: str = "") -> str:
    """A role's TLS bundle as the operator puts it (docs/security.md, "Deployed fleets")."""
    bundle = {"ca": ca.cert.read_text(), "cert": node.cert.read_text(), "key": node.key.read_text()}
    if api_keys:
        bundle["api_keys"] = api_keys
    return json.dumps(bundle)


@dataclass(frozen=True)
class FleetSecrets:
    """The cluster CA, each role's bundle, the keyring, the AUTH token, and the rehearsal's own
    operator certificate and API keys. `by_id` is what the cloud's secret store holds."""

    ca: CertPaths
    operator: CertPaths
    api_key: str
    admin_key: str
    by_id: Mapping[str, str] = field(repr=False)

    @classmethod
    def make(
        cls,
        folder: Path,
        ids: SecretIds,
        redis_token: str,
        coordinator_hosts: Sequence[str],
        worker_hosts: Sequence[str],
    ) -> FleetSecrets:
        folder = folder.resolve()
        ca = make_ca(folder, name="spotinfer rehearsal cluster CA")
        coordinator = make_node_cert(
            ca, folder, "coordinator", COORDINATOR, tuple(coordinator_hosts)
        )
        worker = make_node_cert(
            ca, folder, "worker", WORKER, tuple(worker_hosts), extra_roles=(DAEMON,)
        )
        operator = make_node_cert(ca, folder, "operator", OPERATOR)
        keys_file = folder / KEYS_FILE
        keys_file.unlink(missing_ok=True)
        tokens = []
        for tenant, role in ((TENANT, TENANT_ROLE), ("", ADMIN_ROLE)):
            record, token = new_key(tenant, role)
            append_key(keys_file, record)
            tokens.append(token)
        by_id = {
            ids.redis: redis_token,
            ids.tls_coordinator: tls_bundle(ca, coordinator, keys_file.read_text()),
            ids.tls_worker: tls_bundle(ca, worker),
            ids.kv_mac: new_keyring_text(),
        }
        return cls(ca, operator, tokens[0], tokens[1], by_id)

    @property
    def client_transport(self) -> TransportConfig:
        """A user's client: the cluster CA to verify the coordinator, no certificate."""
        return TransportConfig(str(self.ca.cert))

    @property
    def operator_transport(self) -> TransportConfig:
        return TransportConfig(str(self.ca.cert), str(self.operator.cert), str(self.operator.key))

    def install_clis(self, shims: Path) -> None:
        """The `aws` and `gcloud` stand-ins in `shims` (a VM's PATH), and what they serve."""
        store = shims / SECRETS_FOLDER
        store.mkdir(mode=0o700, parents=True, exist_ok=True)
        for index, (secret_id, value) in enumerate(sorted(self.by_id.items())):
            for suffix, text in ((".id", secret_id), (".value", value)):
                path = store / f"{index}{suffix}"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(text)
        for cli, script in (("aws", AWS_CLI), ("gcloud", GCLOUD_CLI)):
            path = shims / cli
            path.write_text(script.replace("@SECRETS@", str(store)))
            path.chmod(0o755)


# The file that holds a secret's value, by id (<n>.id / <n>.value in the stand-in's folder).
_LOOKUP = r"""
lookup() {
  for id_file in "@SECRETS@"/*.id; do
    if [ "$(cat "$id_file")" = "$1" ]; then
      printf '%s' "${id_file%.id}.value"
      return 0
    fi
  done
  return 1
}
"""

AWS_CLI = (
    r"""#!/usr/bin/env bash
# Rehearsal stand-in for the AWS CLI: `secretsmanager get-secret-value` of the secrets the
# boot script reads, printed as `--query SecretString --output text` prints them.
set -uo pipefail
"""
    + _LOOKUP
    + r"""
refuse() { printf 'rehearsal aws: %s\n' "$1" >&2; exit 252; }
[ "${1:-}" = secretsmanager ] && [ "${2:-}" = get-secret-value ] ||
  refuse "only 'secretsmanager get-secret-value' is available, not: $*"
shift 2
secret_id="" query="" output=""
while [ $# -gt 0 ]; do
  case "$1" in
    --region) shift ;;
    --secret-id) secret_id=${2:-}; shift ;;
    --query) query=${2:-}; shift ;;
    --output) output=${2:-}; shift ;;
    *) refuse "unknown option $1" ;;
  esac
  shift
done
[ -n "$secret_id" ] || refuse "the following arguments are required: --secret-id"
[ "$query" = SecretString ] && [ "$output" = text ] ||
  refuse "only --query SecretString --output text is rehearsed"
if ! value_file=$(lookup "$secret_id"); then
  echo "" >&2
  echo "An error occurred (ResourceNotFoundException) when calling the GetSecretValue" \
    "operation: Secrets Manager can't find the specified secret." >&2
  exit 254
fi
cat "$value_file"
echo
"""
)

GCLOUD_CLI = (
    r"""#!/usr/bin/env bash
# Rehearsal stand-in for gcloud: `secrets versions access latest` of the secrets the startup
# script reads, the payload printed as stored (no newline added).
set -uo pipefail
"""
    + _LOOKUP
    + r"""
refuse() { printf 'ERROR: (gcloud) rehearsal: %s\n' "$1" >&2; exit 2; }
[ "${1:-}" = secrets ] && [ "${2:-}" = versions ] && [ "${3:-}" = access ] ||
  refuse "only 'secrets versions access' is available, not: $*"
shift 3
version="" secret="" project=""
while [ $# -gt 0 ]; do
  case "$1" in
    --secret=*) secret=${1#--secret=} ;;
    --project=*) project=${1#--project=} ;;
    --*) refuse "unrecognized arguments: $1" ;;
    *) version=$1 ;;
  esac
  shift
done
[ "$version" = latest ] || refuse "only the version 'latest' is rehearsed, not '$version'"
[ -n "$secret" ] || refuse "argument --secret: Must be specified."
if ! value_file=$(lookup "$secret"); then
  echo "ERROR: (gcloud.secrets.versions.access) NOT_FOUND: Secret" \
    "[projects/$project/secrets/$secret] not found or has no versions." >&2
  exit 1
fi
cat "$value_file"
"""
)
