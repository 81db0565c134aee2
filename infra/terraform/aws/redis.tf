# ElastiCache Redis: where daemons commit tokens and KV blocks. TLS in transit, an AUTH token,
# encryption at rest with the fleet key, and a replica in another zone.

resource "random_password" "redis_auth" {
  # ElastiCache accepts 16-128 printable characters but not every symbol; alphanumerics also
  # keep the token safe to embed in a redis:// URL.
  length  = 64
  special = false
}

resource "aws_secretsmanager_secret" "redis_auth" {
  name_prefix             = "${var.name}-redis-auth-"
  description             = "AUTH token of the spotinfer ${var.name} Redis"
  kms_key_id              = aws_kms_key.fleet.arn
  recovery_window_in_days = 7
  tags                    = local.tags

  #checkov:skip=CKV2_AWS_57:rotation needs a Lambda and the ElastiCache ROTATE strategy; docs/deploy.md shows the manual rotation
}

resource "aws_secretsmanager_secret_version" "redis_auth" {
  secret_id     = aws_secretsmanager_secret.redis_auth.id
  secret_string = random_password.redis_auth.result
}

resource "aws_elasticache_subnet_group" "kv" {
  name       = "${var.name}-kv"
  subnet_ids = var.private_subnet_ids
  tags       = local.tags
}

# The store must never evict: every request record carries a TTL, so ElastiCache's default
# maxmemory-policy (volatile-lru) could take a running request's record under memory
# pressure. Workers and the coordinator refuse a store that may evict (store/eviction.py).
resource "aws_elasticache_parameter_group" "kv" {
  name        = "${var.name}-kv"
  family      = "redis${split(".", var.redis_engine_version)[0]}"
  description = "spotinfer ${var.name}: full means refused writes, never evicted keys"

  parameter {
    name  = "maxmemory-policy"
    value = "noeviction"
  }

  tags = local.tags
}

resource "aws_elasticache_replication_group" "kv" {
  replication_group_id = "${var.name}-kv"
  description          = "spotinfer ${var.name}: generated tokens and KV-cache blocks"
  engine               = "redis"
  engine_version       = var.redis_engine_version
  node_type            = var.redis_node_type
  num_cache_clusters   = var.redis_node_count
  port                 = 6379
  subnet_group_name    = aws_elasticache_subnet_group.kv.name
  security_group_ids   = [aws_security_group.redis.id]
  parameter_group_name = aws_elasticache_parameter_group.kv.name

  automatic_failover_enabled = var.redis_node_count > 1
  multi_az_enabled           = var.redis_node_count > 1

  # KV blocks are the users' prompts in another form: encrypt them everywhere.
  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.fleet.arn
  transit_encryption_enabled = true
  transit_encryption_mode    = "required"
  auth_token                 = random_password.redis_auth.result
  auth_token_update_strategy = "ROTATE"

  auto_minor_version_upgrade = true
  apply_immediately          = false
  # The store holds in-flight state only (finished requests' keys expire): a snapshot would
  # be stale within seconds and is not worth its cost or its copy of user data.
  snapshot_retention_limit = 0

  tags = local.tags

  #checkov:skip=CKV2_AWS_50:failover is on whenever redis_node_count > 1 (default 2); the check cannot evaluate the expression
}
