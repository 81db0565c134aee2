output "coordinator_internal_address" {
  description = "Coordinator gRPC address inside the VPC."
  value       = module.spotinfer.coordinator_internal_address
}

output "coordinator_external_address" {
  description = "Coordinator gRPC address for client_source_ranges (null if none)."
  value       = module.spotinfer.coordinator_external_address
}

output "instance_group_manager" {
  description = "Workers' regional managed instance group."
  value       = module.spotinfer.instance_group_manager
}

output "fallback_instance_group_manager" {
  description = "On-demand fallback workers' managed instance group (null without one)."
  value       = module.spotinfer.fallback_instance_group_manager
}

output "fallback_max_count" {
  description = "Most fallback workers (`spotinfer fleet fallback --fallback-max-count`)."
  value       = module.spotinfer.fallback_max_count
}

output "fleet_label" {
  description = "Label that marks the fleet's instances."
  value       = module.spotinfer.fleet_label
}

output "tls_secret_ids" {
  description = "Secret Manager secrets to add each role's TLS bundle to (docs/security.md)."
  value       = module.spotinfer.tls_secret_ids
}

output "kv_mac_secret_id" {
  description = "Secret Manager secret to add the cluster's KV MAC keyring to (docs/deploy.md)."
  value       = module.spotinfer.kv_mac_secret_id
}
