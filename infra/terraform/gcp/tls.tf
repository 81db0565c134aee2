# TLS bundles of the nodes: one Secret Manager secret per role, read by the startup script
# (infra/boot/gcp-boot.sh.tftpl) into /etc/spotinfer/tls/ with mode 0600, never carried in
# instance metadata. Terraform makes the empty secrets only: the operator adds the versions
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
  tls_secret_ids = {
    for role in local.tls_roles : role => lookup(var.tls_secret_names, role, "${var.name}-tls-${role}")
  }
}

resource "google_secret_manager_secret" "tls" {
  for_each  = local.tls_roles
  project   = var.project
  secret_id = local.tls_secret_ids[each.key]
  labels    = local.labels

  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_iam_member" "node_reads_tls" {
  for_each  = local.tls_roles
  project   = var.project
  secret_id = google_secret_manager_secret.tls[each.key].secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.node.email}"
}

# The cluster's KV MAC keyring: one secret for the whole fleet (every coordinator, worker and
# daemon signs and verifies KV blocks and request records with the same keys), read by the
# startup script into /etc/spotinfer/kv-mac.keys (0600). Like the TLS bundles, Terraform makes
# the empty secret only and the operator adds the keyring as a version (docs/deploy.md), so
# no key sits in Terraform state.
#
#   secret value (text): "<key id>:<key as hex>" lines; the last line signs (docs/security.md)

resource "google_secret_manager_secret" "kv_mac" {
  project   = var.project
  secret_id = var.kv_mac_secret_name != "" ? var.kv_mac_secret_name : "${var.name}-kv-mac"
  labels    = local.labels

  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_iam_member" "node_reads_kv_mac" {
  project   = var.project
  secret_id = google_secret_manager_secret.kv_mac.secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.node.email}"
}
