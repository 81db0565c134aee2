# Firewall rules. None admits 0.0.0.0/0: the worker, daemon and coordinator ports are open to
# the fleet's own network tags, Google's health checkers, and ranges the operator lists.

resource "google_compute_firewall" "fleet_internal" {
  project     = var.project
  name        = "${var.name}-fleet-internal"
  network     = var.network
  description = "Worker gRPC and daemon migration ports between the fleet's VMs"
  direction   = "INGRESS"

  allow {
    protocol = "tcp"
    ports    = [tostring(var.worker_port), tostring(var.daemon_peer_port)]
  }

  source_tags = [local.worker_tag, local.coordinator_tag]
  target_tags = [local.worker_tag]
}

resource "google_compute_firewall" "worker_health_check" {
  project     = var.project
  name        = "${var.name}-worker-health-check"
  network     = var.network
  description = "Autohealing health checks on the worker port"
  direction   = "INGRESS"

  allow {
    protocol = "tcp"
    ports    = [tostring(var.worker_port)]
  }

  # Google's health checkers (documented, fixed ranges).
  source_ranges = ["35.191.0.0/16", "130.211.0.0/22"]
  target_tags   = [local.worker_tag]
}

resource "google_compute_firewall" "coordinator_internal" {
  project     = var.project
  name        = "${var.name}-coordinator-internal"
  network     = var.network
  description = "Coordinator gRPC, HTTP and the mutual-TLS internal port from the workers and internal clients"
  direction   = "INGRESS"

  allow {
    protocol = "tcp"
    ports = [
      tostring(var.coordinator_grpc_port),
      tostring(var.coordinator_http_port),
      tostring(var.coordinator_internal_port),
    ]
  }

  source_tags   = [local.worker_tag]
  source_ranges = var.internal_client_ranges
  target_tags   = [local.coordinator_tag]
}

resource "google_compute_firewall" "coordinator_clients" {
  count = length(var.client_source_ranges) > 0 ? 1 : 0

  project     = var.project
  name        = "${var.name}-coordinator-clients"
  network     = var.network
  description = "Coordinator gRPC and HTTP from the listed public client ranges"
  direction   = "INGRESS"

  allow {
    protocol = "tcp"
    ports    = [tostring(var.coordinator_grpc_port), tostring(var.coordinator_http_port)]
  }

  source_ranges = var.client_source_ranges
  target_tags   = [local.coordinator_tag]
}

resource "google_compute_firewall" "iap_ssh" {
  count = var.enable_iap_ssh ? 1 : 0

  project     = var.project
  name        = "${var.name}-iap-ssh"
  network     = var.network
  description = "SSH through Identity-Aware Proxy only"
  direction   = "INGRESS"

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }

  # IAP's TCP forwarding range; the VMs have no public IP for SSH.
  source_ranges = ["35.235.240.0/20"]
  target_tags   = [local.worker_tag, local.coordinator_tag]
}
