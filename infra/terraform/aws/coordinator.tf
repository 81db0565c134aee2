# The coordinator: one on-demand instance kept alive by an Auto Scaling group of one, behind
# network load balancers. The internal one is what workers and daemons dial; the public one
# exists only when var.client_cidrs lists clients outside the VPC.

locals {
  coordinator_ports = {
    grpc = var.coordinator_grpc_port
    http = var.coordinator_http_port
    mtls = var.coordinator_internal_port
  }

  # Load balancer name => is it internal?
  coordinator_lbs = merge(
    { internal = true },
    length(var.client_cidrs) > 0 ? { public = false } : {},
  )

  # A network load balancer's target group belongs to one load balancer: one listener and one
  # target group per (load balancer, port). The mutual-TLS port is on the internal one only.
  coordinator_listeners = {
    for pair in setproduct(keys(local.coordinator_lbs), keys(local.coordinator_ports)) :
    "${pair[0]}-${pair[1]}" => {
      lb        = pair[0]
      port_name = pair[1]
      port      = local.coordinator_ports[pair[1]]
    } if local.coordinator_lbs[pair[0]] || pair[1] != "mtls"
  }
}

resource "aws_launch_template" "coordinator" {
  name_prefix            = "${var.name}-coordinator-"
  description            = "spotinfer coordinator"
  image_id               = coalesce(var.coordinator_ami_id, var.ami_id)
  instance_type          = var.coordinator_instance_type
  update_default_version = true
  ebs_optimized          = true
  vpc_security_group_ids = [aws_security_group.coordinator.id]

  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }

  user_data = base64encode(templatefile("${local.boot_dir}/aws-boot.sh.tftpl", merge(local.boot_settings, {
    role  = "coordinator"
    units = { "spotinfer-coordinator.service" = file("${local.boot_dir}/spotinfer-coordinator.service") }
  })))

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  block_device_mappings {
    device_name = var.root_device_name
    ebs {
      volume_size           = 50
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
    tags          = merge(local.tags, { (local.role_tag_key) = "coordinator", Name = "${var.name}-coordinator" })
  }

  tags = local.tags
}

resource "aws_autoscaling_group" "coordinator" {
  name_prefix         = "${var.name}-coordinator-"
  vpc_zone_identifier = var.private_subnet_ids
  min_size            = 1
  max_size            = 1
  desired_capacity    = 1
  target_group_arns   = [for tg in aws_lb_target_group.coordinator : tg.arn]

  # Replace the coordinator when the load balancer finds it unreachable, not only when EC2
  # finds the hardware broken.
  health_check_type         = "ELB"
  health_check_grace_period = 300

  launch_template {
    id      = aws_launch_template.coordinator.id
    version = aws_launch_template.coordinator.latest_version
  }

  dynamic "tag" {
    for_each = merge(local.tags, { (local.role_tag_key) = "coordinator" })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}

resource "aws_lb" "coordinator" {
  for_each = local.coordinator_lbs

  name                             = "${var.name}-${each.key}"
  load_balancer_type               = "network"
  internal                         = each.value
  subnets                          = each.value ? var.private_subnet_ids : var.public_subnet_ids
  security_groups                  = [aws_security_group.lb[each.key].id]
  enable_cross_zone_load_balancing = true
  enable_deletion_protection       = var.deletion_protection
  tags                             = local.tags

  #checkov:skip=CKV_AWS_150:var.deletion_protection, off by default so a trial fleet can be destroyed; turn it on for production
  #checkov:skip=CKV_AWS_91:access logs need an S3 bucket policy per region; the coordinator logs every request itself
}

resource "aws_lb_target_group" "coordinator" {
  for_each = local.coordinator_listeners

  name        = "${var.name}-${each.key}"
  port        = each.value.port
  protocol    = "TCP"
  vpc_id      = var.vpc_id
  target_type = "instance"
  # Long enough for open streams to finish when the coordinator is replaced.
  deregistration_delay = 60

  health_check {
    protocol            = "TCP"
    interval            = 10
    healthy_threshold   = 2
    unhealthy_threshold = 3
  }

  tags = local.tags
}

resource "aws_lb_listener" "coordinator" {
  for_each = local.coordinator_listeners

  load_balancer_arn = aws_lb.coordinator[each.value.lb].arn
  port              = each.value.port
  # TLS terminates at the load balancer when a certificate is given.
  protocol        = var.certificate_arn == null ? "TCP" : "TLS"
  certificate_arn = var.certificate_arn
  ssl_policy      = var.certificate_arn == null ? null : "ELBSecurityPolicy-TLS13-1-2-2021-06"

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.coordinator[each.key].arn
  }

  tags = local.tags
}
