output "worker_asg_name" {
  description = "Auto Scaling group of the workers (`spotinfer fleet scale --group`)."
  value       = aws_autoscaling_group.worker.name
}

output "fallback_asg_name" {
  description = "Auto Scaling group of the on-demand fallback workers (`spotinfer fleet fallback --fallback-group-name`); null when fallback_max_count is 0."
  value       = one(aws_autoscaling_group.fallback[*].name)
}

output "coordinator_internal_address" {
  description = "host:port of the coordinator's gRPC service inside the VPC."
  value       = "${aws_lb.coordinator["internal"].dns_name}:${var.coordinator_grpc_port}"
}

output "coordinator_public_address" {
  description = "host:port of the coordinator's gRPC service for client_cidrs; null without a public load balancer."
  value       = contains(keys(aws_lb.coordinator), "public") ? "${aws_lb.coordinator["public"].dns_name}:${var.coordinator_grpc_port}" : null
}

output "redis_endpoint" {
  description = "host:port of the Redis primary (TLS, AUTH)."
  value       = "${aws_elasticache_replication_group.kv.primary_endpoint_address}:${aws_elasticache_replication_group.kv.port}"
}

output "tls_secret_arns" {
  description = "Secrets Manager secrets to put each role's TLS bundle into (docs/security.md)."
  value       = { for role, secret in aws_secretsmanager_secret.tls : role => secret.arn }
}

output "kv_mac_secret_arn" {
  description = "Secrets Manager secret to put the cluster's KV MAC keyring into (docs/deploy.md)."
  value       = aws_secretsmanager_secret.kv_mac.arn
}

output "redis_auth_secret_arn" {
  description = "Secrets Manager secret holding the Redis AUTH token."
  value       = aws_secretsmanager_secret.redis_auth.arn
}

output "fis_experiment_template_id" {
  description = "FIS experiment template for `spotinfer fleet drill --cloud aws --template-id`."
  value       = aws_fis_experiment_template.spot_interruption.id
}

output "notice_queue_url" {
  description = "SQS queue of spot notices for `spotinfer fleet notices --cloud aws --queue-url`."
  value       = aws_sqs_queue.notices.url
}

output "fleet_tag" {
  description = "Tag key and value that mark this fleet's instances (`spotinfer fleet list --tag`)."
  value       = "${local.fleet_tag_key}=${var.name}"
}

output "fis_log_group" {
  description = "CloudWatch log group with the FIS experiment logs."
  value       = aws_cloudwatch_log_group.fis.name
}
