output "instance_group_manager" {
  description = "Regional managed instance group of the workers (`spotinfer fleet ... --group`)."
  value       = google_compute_region_instance_group_manager.worker.name
}

output "fallback_instance_group_manager" {
  description = "Regional managed instance group of the on-demand fallback workers (`spotinfer fleet fallback --fallback-group-name`); null when fallback_max_count is 0."
  value       = one(google_compute_region_instance_group_manager.fallback[*].name)
}

output "fallback_max_count" {
  description = "Most fallback workers (`spotinfer fleet fallback --fallback-max-count` on GCP, where the group keeps no maximum of its own)."
  value       = var.fallback_max_count
}

output "coordinator_internal_address" {
  description = "host:port of the coordinator's gRPC service inside the VPC."
  value       = "${google_compute_address.coordinator_internal.address}:${var.coordinator_grpc_port}"
}

output "coordinator_external_address" {
  description = "host:port for client_source_ranges; null without an external IP."
  value       = length(google_compute_address.coordinator_external) > 0 ? "${google_compute_address.coordinator_external[0].address}:${var.coordinator_grpc_port}" : null
}

output "redis_endpoint" {
  description = "host:port of Memorystore (TLS, AUTH)."
  value       = "${google_redis_instance.kv.host}:${google_redis_instance.kv.port}"
}

output "fleet_label" {
  description = "Label that marks this fleet's instances (`spotinfer fleet list --label`)."
  value       = "${local.fleet_label_key}=${var.name}"
}

output "service_account_email" {
  description = "Service account the VMs run as."
  value       = google_service_account.node.email
}

output "tls_secret_ids" {
  description = "Secret Manager secrets to add each role's TLS bundle to (docs/security.md)."
  value       = { for role, secret in google_secret_manager_secret.tls : role => secret.secret_id }
}

output "kv_mac_secret_id" {
  description = "Secret Manager secret to add the cluster's KV MAC keyring to (docs/deploy.md)."
  value       = google_secret_manager_secret.kv_mac.secret_id
}
