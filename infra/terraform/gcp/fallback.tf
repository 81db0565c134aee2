# The on-demand fallback: a regional managed instance group of STANDARD VMs that stays at 0
# until spot capacity cannot hold the load. `spotinfer fleet fallback N` (or the fleet
# adapter's set_fallback_capacity) resizes it; the coordinator routes to these workers only
# while spot ones fall short. Created only when fallback_max_count > 0.
#
# The template is the spot one's with the STANDARD provisioning model. The boot script reads
# scheduling/preemptible from the metadata server, so these VMs register without --spot and
# the coordinator treats them as the fallback tier.

resource "google_compute_instance_template" "fallback" {
  count = var.fallback_max_count > 0 ? 1 : 0

  project      = var.project
  name_prefix  = "${var.name}-fallback-"
  description  = "spotinfer on-demand fallback worker + context daemon (notice source: gcp)"
  machine_type = var.worker_machine_type
  tags         = [local.worker_tag]
  labels = merge(local.labels, {
    (local.role_label_key) = "worker"
    (local.tier_label_key) = local.fallback_tier
  })

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

  # No access_config: no public IP, as for the spot workers.
  network_interface {
    subnetwork = var.subnetwork
  }

  service_account {
    email  = google_service_account.node.email
    scopes = ["cloud-platform"]
  }

  # SSH access is granted by IAM through OS Login, never by project-wide keys.
  metadata = {
    block-project-ssh-keys = "TRUE"
    enable-oslogin         = "TRUE"
    startup-script         = local.worker_startup_script
  }

  scheduling {
    provisioning_model = "STANDARD"
    preemptible        = false
    automatic_restart  = true
    # GPUs cannot live-migrate.
    on_host_maintenance = "TERMINATE"
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

resource "google_compute_region_instance_group_manager" "fallback" {
  count = var.fallback_max_count > 0 ? 1 : 0

  project            = var.project
  name               = "${var.name}-fallback"
  base_instance_name = "${var.name}-fallback"
  region             = var.region
  target_size        = 0

  distribution_policy_zones        = var.zones
  distribution_policy_target_shape = var.distribution_shape

  version {
    instance_template = google_compute_instance_template.fallback[0].self_link_unique
  }

  named_port {
    name = "grpc"
    port = var.worker_port
  }

  auto_healing_policies {
    health_check      = google_compute_health_check.worker.id
    initial_delay_sec = 900
  }

  update_policy {
    type                         = "PROACTIVE"
    minimal_action               = "REPLACE"
    instance_redistribution_type = "NONE"
    max_surge_fixed              = length(var.zones)
    max_unavailable_fixed        = 0
  }

  lifecycle {
    # The fleet adapter resizes the group at run time; Terraform must not undo it.
    ignore_changes = [target_size]
  }
}
