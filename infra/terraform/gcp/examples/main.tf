# Example: a small spotinfer fleet in a fresh VPC.
#
#   cp terraform.tfvars.example terraform.tfvars   # then set project and source_image
#   terraform init && terraform apply

# APIs the module uses. Kept on destroy: other things in the project may use them too.
resource "google_project_service" "apis" {
  for_each = toset([
    "compute.googleapis.com",
    "redis.googleapis.com",
    "secretmanager.googleapis.com",
    "iap.googleapis.com",
  ])

  project            = var.project
  service            = each.value
  disable_on_destroy = false
}

module "spotinfer" {
  source = "../"

  project    = var.project
  name       = var.name
  region     = var.region
  zones      = var.zones
  network    = google_compute_network.fleet.id
  subnetwork = google_compute_subnetwork.fleet.id

  client_source_ranges = var.client_source_ranges

  source_image      = var.source_image
  model             = var.model
  spotinfer_package = var.spotinfer_package
  worker_count      = var.worker_count

  fallback_max_count = var.fallback_max_count

  depends_on = [google_project_service.apis, google_compute_router_nat.fleet]
}
