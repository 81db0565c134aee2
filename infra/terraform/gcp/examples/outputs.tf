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

output "fleet_label" {
  description = "Label that marks the fleet's instances."
  value       = module.spotinfer.fleet_label
}
