# The drill: an AWS FIS experiment template that sends a real spot interruption notice to
# tagged workers of this fleet. `spotinfer fleet drill --cloud aws` starts it; the instance
# gets the same IMDS notice and EventBridge event as a real interruption, then is interrupted
# after var.fis_interruption_notice.

resource "aws_cloudwatch_log_group" "fis" {
  name              = "/spotinfer/${var.name}/fis"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.fleet.arn
  tags              = local.tags

  #checkov:skip=CKV_AWS_338:drill logs are worth months, not the one year the check asks for; set log_retention_days if policy requires
}

resource "aws_fis_experiment_template" "spot_interruption" {
  description = "Interrupt ${var.fis_target_selection} spot worker(s) of spotinfer ${var.name} with ${var.fis_interruption_notice} notice"
  role_arn    = aws_iam_role.fis.arn

  action {
    name      = "interrupt-spot-workers"
    action_id = "aws:ec2:send-spot-instance-interruptions"

    parameter {
      key   = "durationBeforeInterruption"
      value = var.fis_interruption_notice
    }

    target {
      key   = "SpotInstances"
      value = "spot-workers"
    }
  }

  target {
    name           = "spot-workers"
    resource_type  = "aws:ec2:spot-instance"
    selection_mode = var.fis_target_selection

    resource_tag {
      key   = local.fleet_tag_key
      value = var.name
    }

    resource_tag {
      key   = local.role_tag_key
      value = "worker"
    }

    # Only running instances can be interrupted; without the filter a drill can pick one that
    # is already shutting down and fail.
    filter {
      path   = "State.Name"
      values = ["running"]
    }
  }

  # Without an alarm the experiment runs to completion: interrupting one worker is the point.
  dynamic "stop_condition" {
    for_each = var.fis_stop_alarm_arn == null ? ["none"] : [var.fis_stop_alarm_arn]
    content {
      source = var.fis_stop_alarm_arn == null ? "none" : "aws:cloudwatch:alarm"
      value  = var.fis_stop_alarm_arn
    }
  }

  log_configuration {
    log_schema_version = 2
    cloudwatch_logs_configuration {
      log_group_arn = "${aws_cloudwatch_log_group.fis.arn}:*"
    }
  }

  tags = merge(local.tags, { Name = "${var.name}-spot-interruption" })
}
