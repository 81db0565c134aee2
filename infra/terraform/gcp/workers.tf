# The worker fleet: an instance template with the SPOT provisioning model and a regional
# managed instance group.

resource "google_compute_instance_template" "worker" {
  # google-beta for scheduling.preemption_notice_duration (a Beta API field).
  provider = google-beta

  project      = var.project
  name_prefix  = "${var.name}-worker-"
  description  = "spotinfer worker + context daemon (notice source: gcp)"
  machine_type = var.worker_machine_type
  tags         = [local.worker_tag]
  labels       = merge(local.labels, { (local.role_label_key) = "worker" })

  disk {
    source_image = var.source_image
    disk_size_gb = var.boot_disk_gb
    disk_type    = "pd-balanced"
    boot         = true
    auto_delete  = true
  }

  dynamic "guest_accelerator" {
    for_each = var.worker_accelerator == null ? [] : [var.worker_accelerator]
    content {
      type  = guest_accelerator.value.type
      count = guest_accelerator.value.count
    }
  }

  # No access_config: no public IP. Outbound goes through Cloud NAT / Private Google Access.
  network_interface {
    subnetwork = var.subnetwork
  }

  service_account {
    email = google_service_account.node.email
    # Access is governed by the service account's IAM roles, not by legacy scopes.
    scopes = ["cloud-platform"]
  }

  # SSH access is granted by IAM through OS Login, never by project-wide keys.
  metadata = {
    block-project-ssh-keys = "TRUE"
    enable-oslogin         = "TRUE"
    startup-script         = local.worker_startup_script
  }

  scheduling {
    provisioning_model = "SPOT"
    preemptible        = true
    # Spot VMs cannot restart themselves or live-migrate; GPUs cannot live-migrate either.
    automatic_restart   = false
    on_host_maintenance = "TERMINATE"
    # Set explicitly: it decides whether a preempted worker is recreated (DELETE) or kept
    # stopped with its disk (STOP). See var.termination_action.
    instance_termination_action = var.termination_action

    # GCE's default notice is 30 s. A longer one (up to 120 s) is time the daemon uses to move
    # KV blocks to a standby instead of leaving it to recompute them.
    dynamic "preemption_notice_duration" {
      for_each = var.preemption_notice_seconds > 0 ? [var.preemption_notice_seconds] : []
      content {
        seconds = preemption_notice_duration.value
      }
    }
  }

  shielded_instance_config {
    enable_secure_boot          = var.secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  lifecycle {
    create_before_destroy = true
  }

}

resource "google_compute_health_check" "worker" {
  project             = var.project
  name                = "${var.name}-worker"
  description         = "Worker gRPC port accepts connections"
  check_interval_sec  = 15
  timeout_sec         = 5
  healthy_threshold   = 2
  unhealthy_threshold = 4

  tcp_health_check {
    port = var.worker_port
  }
}

resource "google_compute_region_instance_group_manager" "worker" {
  project            = var.project
  name               = "${var.name}-workers"
  base_instance_name = "${var.name}-worker"
  region             = var.region
  target_size        = var.worker_count

  distribution_policy_zones = var.zones
  # See var.distribution_shape: by default each VM goes where spot capacity is now.
  distribution_policy_target_shape = var.distribution_shape

  version {
    instance_template = google_compute_instance_template.worker.self_link_unique
  }

  named_port {
    name = "grpc"
    port = var.worker_port
  }

  auto_healing_policies {
    health_check = google_compute_health_check.worker.id
    # Installing spotinfer and loading the weights takes minutes on a fresh VM.
    initial_delay_sec = 900
  }

  update_policy {
    type           = "PROACTIVE"
    minimal_action = "REPLACE"
    # Proactive redistribution would move running workers to rebalance zones, and the ANY
    # shapes refuse it.
    instance_redistribution_type = "NONE"
    # Surge first, never take a worker away before its replacement is up; a regional group
    # surges at least one VM per zone.
    max_surge_fixed       = length(var.zones)
    max_unavailable_fixed = 0
  }

  lifecycle {
    # `spotinfer fleet scale` resizes the group at run time; Terraform must not undo it.
    ignore_changes = [target_size]
  }
}
