# Security groups. Nothing here admits 0.0.0.0/0: the gRPC ports of workers, daemons and the
# coordinator are reachable only from inside the VPC (security-group references) and, for the
# coordinator's public load balancer, from var.client_cidrs. Operators reach the VMs through
# SSM Session Manager, so no SSH port is opened either.

resource "aws_security_group" "worker" {
  name_prefix = "${var.name}-worker-"
  description = "spotinfer workers and their context daemons"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-worker" })

  lifecycle {
    create_before_destroy = true
  }
}

# The coordinator calls Generate / standby RPCs on the workers.
resource "aws_vpc_security_group_ingress_rule" "worker_from_coordinator" {
  security_group_id            = aws_security_group.worker.id
  description                  = "Worker gRPC from the coordinator"
  referenced_security_group_id = aws_security_group.coordinator.id
  ip_protocol                  = "tcp"
  from_port                    = var.worker_port
  to_port                      = var.worker_port
}

resource "aws_vpc_security_group_ingress_rule" "daemon_from_coordinator" {
  security_group_id            = aws_security_group.worker.id
  description                  = "Daemon migration control from the coordinator"
  referenced_security_group_id = aws_security_group.coordinator.id
  ip_protocol                  = "tcp"
  from_port                    = var.daemon_peer_port
  to_port                      = var.daemon_peer_port
}

# In a grace period the noticed worker's daemon streams KV blocks to the standby's daemon.
resource "aws_vpc_security_group_ingress_rule" "daemon_from_peers" {
  security_group_id            = aws_security_group.worker.id
  description                  = "KV migration between daemons of the fleet"
  referenced_security_group_id = aws_security_group.worker.id
  ip_protocol                  = "tcp"
  from_port                    = var.daemon_peer_port
  to_port                      = var.daemon_peer_port
}

resource "aws_vpc_security_group_ingress_rule" "worker_from_peers" {
  security_group_id            = aws_security_group.worker.id
  description                  = "Worker gRPC between workers (standby import)"
  referenced_security_group_id = aws_security_group.worker.id
  ip_protocol                  = "tcp"
  from_port                    = var.worker_port
  to_port                      = var.worker_port
}

resource "aws_security_group" "coordinator" {
  name_prefix = "${var.name}-coordinator-"
  description = "spotinfer coordinator"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-coordinator" })

  lifecycle {
    create_before_destroy = true
  }
}

# Clients and workers reach the coordinator only through its load balancers; a load balancer
# with security groups is referenced by its group, and its health checks come the same way.
resource "aws_vpc_security_group_ingress_rule" "coordinator_from_lb" {
  for_each = local.coordinator_listeners

  security_group_id            = aws_security_group.coordinator.id
  description                  = "Coordinator ${each.value.port_name} from the ${each.value.lb} load balancer"
  referenced_security_group_id = aws_security_group.lb[each.value.lb].id
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
}

resource "aws_security_group" "lb" {
  for_each = local.coordinator_lbs

  name_prefix = "${var.name}-${each.key}-lb-"
  description = "spotinfer coordinator ${each.key} load balancer"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-${each.key}-lb" })

  lifecycle {
    create_before_destroy = true
  }
}

# Internal load balancer: anything in the VPC (workers, daemons, in-VPC clients).
# Public load balancer: var.client_cidrs only (validated never to be 0.0.0.0/0).
locals {
  lb_source_cidrs = {
    internal = [local.vpc_cidr]
    public   = var.client_cidrs
  }
}

resource "aws_vpc_security_group_ingress_rule" "lb_from_clients" {
  for_each = {
    for rule in flatten([
      for listener_key, listener in local.coordinator_listeners : [
        for cidr in local.lb_source_cidrs[listener.lb] : {
          key  = "${listener_key}-${cidr}"
          lb   = listener.lb
          port = listener.port
          cidr = cidr
        }
      ]
    ]) : rule.key => rule
  }

  security_group_id = aws_security_group.lb[each.value.lb].id
  description       = "Coordinator port ${each.value.port} from ${each.value.cidr}"
  cidr_ipv4         = each.value.cidr
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
}

resource "aws_vpc_security_group_egress_rule" "lb_to_coordinator" {
  for_each = local.coordinator_listeners

  security_group_id            = aws_security_group.lb[each.value.lb].id
  description                  = "Forward ${each.value.port_name} and health checks to the coordinator"
  referenced_security_group_id = aws_security_group.coordinator.id
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
}

resource "aws_security_group" "redis" {
  name_prefix = "${var.name}-redis-"
  description = "spotinfer Redis (tokens and KV blocks)"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-redis" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "redis_from_nodes" {
  for_each = {
    worker      = aws_security_group.worker.id
    coordinator = aws_security_group.coordinator.id
  }

  security_group_id            = aws_security_group.redis.id
  description                  = "Redis (TLS) from the ${each.key}"
  referenced_security_group_id = each.value
  ip_protocol                  = "tcp"
  from_port                    = aws_elasticache_replication_group.kv.port
  to_port                      = aws_elasticache_replication_group.kv.port
}

# Workers and the coordinator need outbound HTTPS to PyPI, the model hub and AWS APIs
# (Secrets Manager, SSM), plus the fleet-internal ports above. Egress is not narrowed to
# those hosts: their addresses are not stable and a NAT gateway already fronts the VMs.
resource "aws_vpc_security_group_egress_rule" "nodes_anywhere" {
  for_each = {
    worker      = aws_security_group.worker.id
    coordinator = aws_security_group.coordinator.id
  }

  security_group_id = each.value
  description       = "Outbound from the ${each.key} (packages, model, AWS APIs, fleet ports)"
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "-1"
}
