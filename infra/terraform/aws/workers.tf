# The worker fleet: one launch template, one Auto Scaling group with a mixed instances policy.

resource "aws_launch_template" "worker" {
  name_prefix            = "${var.name}-worker-"
  description            = "spotinfer worker + context daemon (notice source: aws)"
  image_id               = var.ami_id
  update_default_version = true
  ebs_optimized          = true
  vpc_security_group_ids = [aws_security_group.worker.id]
  # No instance_type and no instance_market_options: the mixed instances policy below picks
  # both, and an ASG rejects a launch template that pins the market to spot itself.

  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }

  user_data = base64encode(templatefile("${local.boot_dir}/aws-boot.sh.tftpl", merge(local.boot_settings, {
    role = "worker"
    units = {
      "spotinfer-daemon.service" = file("${local.boot_dir}/spotinfer-daemon.service")
      "spotinfer-worker.service" = file("${local.boot_dir}/spotinfer-worker.service")
    }
  })))

  # IMDSv2 only. The daemon polls the spot notice through IMDSv2 tokens anyway; v1 would only
  # leave the instance credentials open to SSRF. A hop limit of 1 keeps containers, if any,
  # from reaching the metadata service through the host.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  block_device_mappings {
    device_name = var.root_device_name
    ebs {
      volume_size           = var.root_volume_gib
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.tags, { (local.role_tag_key) = "worker", Name = "${var.name}-worker" })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(local.tags, { (local.role_tag_key) = "worker" })
  }

  tags = local.tags
}

resource "aws_autoscaling_group" "worker" {
  name_prefix         = "${var.name}-workers-"
  vpc_zone_identifier = var.private_subnet_ids
  min_size            = var.worker_min_count
  max_size            = var.worker_max_count
  desired_capacity    = var.worker_desired_count

  # On a rebalance recommendation (an elevated risk of interruption, usually minutes before
  # the 2-minute notice) the group launches a replacement first and retires the at-risk
  # instance after; the daemon's notice handling still covers the final interruption.
  capacity_rebalance = true

  # A GPU worker needs minutes to install and load weights before it is useful.
  health_check_type         = "EC2"
  health_check_grace_period = 900
  default_instance_warmup   = 600

  # Spot capacity may be short at apply time; do not fail the apply waiting for it.
  wait_for_capacity_timeout = "0"

  mixed_instances_policy {
    instances_distribution {
      # The first on_demand_base_count workers are on demand (dependable standbys); all
      # others are spot.
      on_demand_base_capacity                  = var.on_demand_base_count
      on_demand_percentage_above_base_capacity = 0
      # capacity-optimized launches into the spot pools with the most spare capacity, i.e.
      # the lowest chance of interruption; for this workload an interruption costs more than
      # the price difference between pools.
      spot_allocation_strategy = "capacity-optimized"
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

  # Terminations the group starts itself (capacity rebalancing, scale-in, instance refresh)
  # come with no spot notice. The hook holds such an instance in Terminating:Wait for
  # termination_drain_seconds; IMDS shows it at
  # /latest/meta-data/autoscaling/target-lifecycle-state ("Terminated"), which is the daemon's
  # cue to migrate, and the instance may end the wait early with CompleteLifecycleAction.
  dynamic "initial_lifecycle_hook" {
    for_each = var.termination_drain_seconds > 0 ? [var.termination_drain_seconds] : []
    content {
      name                 = "drain-before-terminate"
      lifecycle_transition = "autoscaling:EC2_INSTANCE_TERMINATING"
      heartbeat_timeout    = initial_lifecycle_hook.value
      default_result       = "CONTINUE"
    }
  }

  # A new launch template version (new package, new model) rolls through the fleet; the
  # daemons migrate the in-flight requests off each replaced worker.
  instance_refresh {
    strategy = "Rolling"
    preferences {
      min_healthy_percentage = 75
    }
  }

  dynamic "tag" {
    for_each = merge(local.tags, { (local.role_tag_key) = "worker" })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }

  lifecycle {
    # `spotinfer fleet scale` changes the desired capacity at run time; Terraform must not
    # undo it on the next apply.
    ignore_changes = [desired_capacity]
  }
}
