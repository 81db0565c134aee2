# spotinfer worker fleet on EC2 spot.
#
#   clients ──▶ NLB (internal; public only for client_cidrs) ──▶ coordinator (on-demand ASG of 1)
#                                                                   │ gRPC
#                 ┌─────────────────────────────────────────────────┘
#                 ▼
#   worker ASG: spot, capacity-optimized over several GPU types and zones, capacity rebalance
#   fallback ASG (optional): on-demand workers, 0 until spot falls short
#     each VM: spotinfer-worker.service + spotinfer-daemon.service (notice source: aws IMDSv2)
#                 │ tokens + KV blocks (TLS, AUTH)
#                 ▼
#   ElastiCache Redis (Multi-AZ)        EventBridge spot notices ──▶ SQS (for `spotinfer fleet notices`)
#                                       FIS template: aws:ec2:send-spot-instance-interruptions
#
# Files: security.tf (security groups), iam.tf, workers.tf, fallback.tf, coordinator.tf,
# redis.tf, notices.tf (EventBridge + SQS), fis.tf, outputs.tf.

data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

data "aws_vpc" "this" {
  id = var.vpc_id
}

locals {
  # The tag keys are shared with spotinfer/fleet/constants.py (FLEET_TAG_KEY, ROLE_TAG_KEY,
  # TIER_TAG_KEY, FALLBACK_TIER): the fleet adapter discovers workers and groups by them, FIS
  # targets them, IAM conditions test them.
  fleet_tag_key = "spotinfer:fleet"
  role_tag_key  = "spotinfer:role"
  tier_tag_key  = "spotinfer:tier"
  fallback_tier = "fallback"

  tags = merge(var.tags, {
    (local.fleet_tag_key) = var.name
    "managed-by"          = "terraform"
  })

  region     = data.aws_region.current.name
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  vpc_cidr   = data.aws_vpc.this.cidr_block

  boot_dir = "${path.module}/../../boot"

  # What every VM's boot script needs besides its role and units.
  # coordinator_address: the workers register at the mutual-TLS internal port (the public
  # one asks no client certificate, so it cannot tell a worker from a user).
  boot_settings = {
    region               = local.region
    package              = var.spotinfer_package
    pip_args             = var.pip_args
    model                = var.model
    worker_port          = var.worker_port
    daemon_peer_port     = var.daemon_peer_port
    coordinator_address  = "${aws_lb.coordinator["internal"].dns_name}:${var.coordinator_internal_port}"
    coordinator_port     = var.coordinator_grpc_port
    coordinator_http     = var.coordinator_http_port
    coordinator_internal = var.coordinator_internal_port
    worker_metrics       = var.worker_metrics_port
    daemon_metrics       = var.daemon_metrics_port
    lease_interval       = var.lease_interval_seconds
    lease_ttl            = var.lease_ttl_seconds
    # A scale-in's lifecycle hook wait (the daemon's notice deadline) and how long a worker
    # that systemd stops moves its requests (inside the unit's TimeoutStopSec of 30 s).
    termination_drain          = var.termination_drain_seconds
    worker_stop_grace          = 25
    redis_host                 = aws_elasticache_replication_group.kv.primary_endpoint_address
    redis_port                 = aws_elasticache_replication_group.kv.port
    redis_secret_arn           = aws_secretsmanager_secret.redis_auth.arn
    tls_secret_arn_coordinator = aws_secretsmanager_secret.tls["coordinator"].arn
    tls_secret_arn_worker      = aws_secretsmanager_secret.tls["worker"].arn
    kv_mac_secret_arn          = aws_secretsmanager_secret.kv_mac.arn
    install_script             = file("${local.boot_dir}/install-spotinfer.sh")
  }
}

# One customer-managed key for the module's data at rest (Redis, its AUTH secret, drill logs):
# one key policy to audit, rotation on, and deleting the fleet can revoke all of it at once.
resource "aws_kms_key" "fleet" {
  description             = "spotinfer ${var.name}: Redis at rest, Redis AUTH secret, drill logs"
  enable_key_rotation     = true
  deletion_window_in_days = 7
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = local.tags
}

resource "aws_kms_alias" "fleet" {
  name          = "alias/spotinfer-${var.name}"
  target_key_id = aws_kms_key.fleet.key_id
}

data "aws_iam_policy_document" "kms" {
  # In a key policy "*" means "this key": these checks read it as an IAM policy over all keys.
  #checkov:skip=CKV_AWS_109:key policy; "*" is this key and administration stays with the account root
  #checkov:skip=CKV_AWS_111:key policy; "*" is this key and administration stays with the account root
  #checkov:skip=CKV_AWS_356:key policy; "*" is this key and administration stays with the account root

  # Key administration stays with the account's IAM policies (the AWS default key policy).
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:root"]
    }
  }

  # CloudWatch Logs encrypts the FIS log group with this key; only log groups of this account
  # and region may use it.
  statement {
    sid       = "CloudWatchLogsEncrypt"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${local.region}.amazonaws.com"]
    }
    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${local.partition}:logs:${local.region}:${local.account_id}:log-group:*"]
    }
  }
}
