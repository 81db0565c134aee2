# The on-demand fallback: an Auto Scaling group of on-demand workers that stays at 0 until
# spot capacity cannot hold the load. `spotinfer fleet fallback N` (or the fleet adapter's
# set_fallback_capacity) sets its size; the coordinator routes to these workers only while
# spot ones fall short. Created only when fallback_max_count > 0.
#
# The workers' launch template is reused as it is: its boot script reads the market from IMDS
# (instance-life-cycle), so these VMs register without --spot and the coordinator treats them
# as the fallback tier.

resource "aws_autoscaling_group" "fallback" {
  count = var.fallback_max_count > 0 ? 1 : 0

  # Matches the node role's lifecycle-hook permission (iam.tf).
  name_prefix         = "${var.name}-fallback-"
  vpc_zone_identifier = var.private_subnet_ids
  min_size            = 0
  max_size            = var.fallback_max_count
  desired_capacity    = 0

  health_check_type         = "EC2"
  health_check_grace_period = 900
  default_instance_warmup   = 600
  wait_for_capacity_timeout = "0"

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = 100
      # The first instance type of worker_instance_types that has capacity is launched.
      on_demand_allocation_strategy = "prioritized"
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.worker.id
        version            = aws_launch_template.worker.latest_version
      }

      dynamic "override" {
        for_each = var.worker_instance_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  # Releasing the fallback when spot returns is a scale-in: the same drain as the spot
  # group's lets each daemon move its requests before the instance goes.
  dynamic "initial_lifecycle_hook" {
    for_each = var.termination_drain_seconds > 0 ? [var.termination_drain_seconds] : []
    content {
      name                 = "drain-before-terminate"
      lifecycle_transition = "autoscaling:EC2_INSTANCE_TERMINATING"
      heartbeat_timeout    = initial_lifecycle_hook.value
      default_result       = "CONTINUE"
    }
  }

  instance_refresh {
    strategy = "Rolling"
    preferences {
      min_healthy_percentage = 75
    }
  }

  # The tier tag tells this group from the spot one (both carry the fleet and worker tags).
  dynamic "tag" {
    for_each = merge(local.tags, {
      (local.role_tag_key) = "worker"
      (local.tier_tag_key) = local.fallback_tier
    })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }

  lifecycle {
    # The fleet adapter sets the size at run time; Terraform must not undo it.
    ignore_changes = [desired_capacity]
  }
}
