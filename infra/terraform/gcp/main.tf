# spotinfer worker fleet on GCE Spot VMs.
#
#   clients ──▶ coordinator (on-demand VM, static internal IP; external IP only for
#               client_source_ranges)
#                 │ gRPC
#                 ▼
#   regional managed instance group: SPOT VMs over var.zones, termination action, longer
#   preemption notice (google-beta), autohealing on the worker port
#   fallback group (optional): STANDARD VMs, 0 until spot falls short
#     each VM: spotinfer-worker.service + spotinfer-daemon.service (notice source: gcp metadata)
#                 │ tokens + KV blocks (TLS, AUTH)
#                 ▼
#   Memorystore Redis (STANDARD_HA)     drill: instances.simulateMaintenanceEvent
#
# Files: firewall.tf, workers.tf, fallback.tf, coordinator.tf, redis.tf, outputs.tf.

locals {
  # Label keys are shared with spotinfer/fleet/constants.py (FLEET_LABEL_KEY, ROLE_LABEL_KEY,
  # TIER_LABEL_KEY, FALLBACK_TIER); GCE labels allow no ':' so they differ from the AWS tag keys.
  fleet_label_key = "spotinfer-fleet"
  role_label_key  = "spotinfer-role"
  tier_label_key  = "spotinfer-tier"
  fallback_tier   = "fallback"

  labels = merge(var.labels, {
    (local.fleet_label_key) = var.name
    "managed-by"            = "terraform"
  })

  # Network tags: the firewall rules' sources and targets.
  worker_tag      = "${var.name}-worker"
  coordinator_tag = "${var.name}-coordinator"

  boot_dir = "${path.module}/../../boot"

  boot_settings = {
    project              = var.project
    package              = var.spotinfer_package
    pip_args             = var.pip_args
    model                = var.model
    worker_port          = var.worker_port
    daemon_peer_port     = var.daemon_peer_port
    coordinator_address  = "${google_compute_address.coordinator_internal.address}:${var.coordinator_internal_port}"
    coordinator_port     = var.coordinator_grpc_port
    coordinator_http     = var.coordinator_http_port
    coordinator_internal = var.coordinator_internal_port
    worker_metrics       = var.worker_metrics_port
    daemon_metrics       = var.daemon_metrics_port
    lease_interval       = var.lease_interval_seconds
    lease_ttl            = var.lease_ttl_seconds
    # How long a worker that systemd stops (a managed group's delete, a shutdown) moves its
    # requests, inside the unit's TimeoutStopSec of 30 s.
    worker_stop_grace         = 25
    redis_host                = google_redis_instance.kv.host
    redis_port                = google_redis_instance.kv.port
    redis_ca_pem              = google_redis_instance.kv.server_ca_certs[0].cert
    redis_secret_id           = google_secret_manager_secret.redis_auth.secret_id
    tls_secret_id_coordinator = google_secret_manager_secret.tls["coordinator"].secret_id
    tls_secret_id_worker      = google_secret_manager_secret.tls["worker"].secret_id
    kv_mac_secret_id          = google_secret_manager_secret.kv_mac.secret_id
    install_script            = file("${local.boot_dir}/install-spotinfer.sh")
  }

  # The workers' startup script, spot and fallback alike.
  worker_startup_script = templatefile("${local.boot_dir}/gcp-boot.sh.tftpl", merge(local.boot_settings, {
    role = "worker"
    units = {
      "spotinfer-daemon.service" = file("${local.boot_dir}/spotinfer-daemon.service")
      "spotinfer-worker.service" = file("${local.boot_dir}/spotinfer-worker.service")
    }
  }))
}

# One service account for the fleet's VMs, with only what the boot script and the agents use.
resource "google_service_account" "node" {
  project      = var.project
  account_id   = "${var.name}-node"
  display_name = "spotinfer ${var.name} workers and coordinator"
}

resource "google_project_iam_member" "node" {
  for_each = toset([
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
  ])

  project = var.project
  role    = each.value
  member  = "serviceAccount:${google_service_account.node.email}"
}
