# Memorystore for Redis: TLS (server authentication) and AUTH. The AUTH string is copied into
# Secret Manager, readable only by the fleet's service account.

resource "google_redis_instance" "kv" {
  project        = var.project
  name           = "${var.name}-kv"
  display_name   = "spotinfer ${var.name}: tokens and KV-cache blocks"
  region         = var.region
  tier           = "STANDARD_HA"
  memory_size_gb = var.redis_memory_gb
  redis_version  = var.redis_version

  authorized_network = var.network
  connect_mode       = "DIRECT_PEERING"

  # KV blocks are the users' prompts in another form: encrypt them on the wire, require AUTH.
  auth_enabled            = true
  transit_encryption_mode = "SERVER_AUTHENTICATION"

  # Never evict (Memorystore's default is volatile-lru): every request record carries a TTL,
  # and workers and the coordinator refuse a store that may evict one (store/eviction.py).
  redis_configs = {
    maxmemory-policy = "noeviction"
  }

  labels = local.labels
}

resource "google_secret_manager_secret" "redis_auth" {
  project   = var.project
  secret_id = "${var.name}-redis-auth"
  labels    = local.labels

  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_version" "redis_auth" {
  secret      = google_secret_manager_secret.redis_auth.id
  secret_data = google_redis_instance.kv.auth_string
}

resource "google_secret_manager_secret_iam_member" "node_reads_redis_auth" {
  project   = var.project
  secret_id = google_secret_manager_secret.redis_auth.secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.node.email}"
}
