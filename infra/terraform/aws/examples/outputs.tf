output "coordinator_internal_address" {
  description = "Coordinator gRPC address inside the VPC."
  value       = module.spotinfer.coordinator_internal_address
}

output "coordinator_public_address" {
  description = "Coordinator gRPC address for client_cidrs (null if none)."
  value       = module.spotinfer.coordinator_public_address
}

output "worker_asg_name" {
  description = "Workers' Auto Scaling group."
  value       = module.spotinfer.worker_asg_name
}

output "fallback_asg_name" {
  description = "On-demand fallback workers' Auto Scaling group (null without one)."
  value       = module.spotinfer.fallback_asg_name
}

output "fis_experiment_template_id" {
  description = "Template for `spotinfer fleet drill --cloud aws`."
  value       = module.spotinfer.fis_experiment_template_id
}

output "notice_queue_url" {
  description = "Queue for `spotinfer fleet notices --cloud aws`."
  value       = module.spotinfer.notice_queue_url
}

output "fleet_tag" {
  description = "Tag that marks the fleet's instances."
  value       = module.spotinfer.fleet_tag
}

output "region" {
  description = "Region of the fleet."
  value       = var.region
}

output "tls_secret_arns" {
  description = "Secrets Manager secrets to put each role's TLS bundle into (docs/security.md)."
  value       = module.spotinfer.tls_secret_arns
}

output "kv_mac_secret_arn" {
  description = "Secrets Manager secret to put the cluster's KV MAC keyring into (docs/deploy.md)."
  value       = module.spotinfer.kv_mac_secret_arn
}
