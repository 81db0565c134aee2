# The coordinator: one on-demand VM with a static internal IP the workers dial. It live-migrates
# through host maintenance, so it is never preempted.

resource "google_compute_address" "coordinator_internal" {
  project      = var.project
  name         = "${var.name}-coordinator-internal"
  region       = var.region
  subnetwork   = var.subnetwork
  address_type = "INTERNAL"
}

resource "google_compute_address" "coordinator_external" {
  count = length(var.client_source_ranges) > 0 ? 1 : 0

  project = var.project
  name    = "${var.name}-coordinator-external"
  region  = var.region
}

resource "google_compute_instance" "coordinator" {
  project      = var.project
  name         = "${var.name}-coordinator"
  zone         = var.zones[0]
  machine_type = var.coordinator_machine_type
  tags         = [local.coordinator_tag]
  # Changing the machine type needs a stop; allow it rather than fail the apply.
  allow_stopping_for_update = true
  labels                    = merge(local.labels, { (local.role_label_key) = "coordinator" })

  boot_disk {
    initialize_params {
      image = coalesce(var.coordinator_image, var.source_image)
      size  = 50
      type  = "pd-balanced"
    }
  }

  network_interface {
    subnetwork = var.subnetwork
    network_ip = google_compute_address.coordinator_internal.address

    # An external IP only when public clients are listed (firewall: client_source_ranges).
    dynamic "access_config" {
      for_each = google_compute_address.coordinator_external
      content {
        nat_ip = access_config.value.address
      }
    }
  }

  service_account {
    email  = google_service_account.node.email
    scopes = ["cloud-platform"]
  }

  # SSH access is granted by IAM through OS Login, never by project-wide keys.
  metadata = {
    block-project-ssh-keys = "TRUE"
    enable-oslogin         = "TRUE"
    startup-script = templatefile("${local.boot_dir}/gcp-boot.sh.tftpl", merge(local.boot_settings, {
      role  = "coordinator"
      units = { "spotinfer-coordinator.service" = file("${local.boot_dir}/spotinfer-coordinator.service") }
    }))
  }

  scheduling {
    provisioning_model  = "STANDARD"
    automatic_restart   = true
    on_host_maintenance = "MIGRATE"
  }

  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  #checkov:skip=CKV_GCP_38:the boot disk holds the OS and a virtualenv; Google-managed encryption is enough
  #checkov:skip=CKV_GCP_40:an external IP exists only when client_source_ranges lists clients; the firewall admits only them
}
