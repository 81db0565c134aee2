# A VPC with one subnetwork and Cloud NAT (the VMs have no public IPs but download packages
# and weights at boot). Bring your own network instead by passing its ids to the module.

resource "google_compute_network" "fleet" {
  name                    = "${var.name}-vpc"
  auto_create_subnetworks = false
}

resource "google_compute_subnetwork" "fleet" {
  name                     = "${var.name}-subnet"
  region                   = var.region
  network                  = google_compute_network.fleet.id
  ip_cidr_range            = var.subnet_cidr
  private_ip_google_access = true

  log_config {
    aggregation_interval = "INTERVAL_5_MIN"
    flow_sampling        = 0.5
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

resource "google_compute_router" "fleet" {
  name    = "${var.name}-router"
  region  = var.region
  network = google_compute_network.fleet.id
}

resource "google_compute_router_nat" "fleet" {
  name                               = "${var.name}-nat"
  router                             = google_compute_router.fleet.name
  region                             = var.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "ALL_SUBNETWORKS_ALL_IP_RANGES"

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}
