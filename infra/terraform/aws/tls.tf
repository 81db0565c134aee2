# TLS bundles of the nodes: one Secrets Manager secret per role, read by the boot script
# (infra/boot/aws-boot.sh.tftpl) into /etc/spotinfer/tls/ with mode 0600, never carried in
# user data. Terraform makes the empty secrets only: the PEMs are put by the operator
# (docs/security.md) so no private key ever sits in Terraform state.
#
#   secret value (JSON): {"ca": "<PEM>", "cert": "<PEM>", "key": "<PEM>",
#                         "api_keys": "<keys file, coordinator only>"}
#
# The worker bundle is one for every worker VM, so its certificate names no node
# (spiffe://spotinfer/node/<worker id>): a worker then takes its daemon's Preempt only over
# loopback, never from another VM (common/authz.py, docs/security.md).

locals {
  tls_roles = toset(["coordinator", "worker"])
  tls_secret_names = {
    for role in local.tls_roles : role => lookup(var.tls_secret_names, role, "${var.name}-tls-${role}")
  }
}

resource "aws_secretsmanager_secret" "tls" {
  for_each                = local.tls_roles
  name                    = local.tls_secret_names[each.key]
  description             = "TLS bundle (CA, certificate, key) of the spotinfer ${var.name} ${each.key} nodes"
  kms_key_id              = aws_kms_key.fleet.arn
  recovery_window_in_days = 7
  tags                    = local.tags

  #checkov:skip=CKV2_AWS_57:certificates are renewed by putting a new secret version (spotinfer certs or the operator's PKI); the boot script's hourly fetch picks it up
}

# The cluster's KV MAC keyring: one secret for the whole fleet (every coordinator, worker and
# daemon signs and verifies KV blocks and request records with the same keys), read by the
# boot script into /etc/spotinfer/kv-mac.keys (0600). Like the TLS bundles, Terraform makes
# the empty secret only and the operator puts the keyring (docs/deploy.md), so no key sits
# in Terraform state.
#
#   secret value (text): "<key id>:<key as hex>" lines; the last line signs (docs/security.md)

resource "aws_secretsmanager_secret" "kv_mac" {
  name                    = var.kv_mac_secret_name != "" ? var.kv_mac_secret_name : "${var.name}-kv-mac"
  description             = "KV MAC keyring of the spotinfer ${var.name} cluster"
  kms_key_id              = aws_kms_key.fleet.arn
  recovery_window_in_days = 7
  tags                    = local.tags

  #checkov:skip=CKV2_AWS_57:keys are rotated by putting a new secret version with a line appended (docs/security.md); the boot script's hourly fetch picks it up and processes sign with it from their next restart
}
