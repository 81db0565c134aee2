# Spot notices as events: EventBridge forwards the interruption warning and the rebalance
# recommendation of every instance in the region to one SQS queue, which
# `spotinfer fleet notices --cloud aws` reads and narrows to this fleet's instances. The
# daemons do not depend on it (they poll IMDS on their own VM); it gives operators and drills
# a fleet-wide record of who was warned, and when.

resource "aws_sqs_queue" "notices" {
  name                      = "${var.name}-spot-notices"
  message_retention_seconds = 86400
  receive_wait_time_seconds = 20
  sqs_managed_sse_enabled   = true
  tags                      = local.tags
}

resource "aws_cloudwatch_event_rule" "spot_notices" {
  name        = "${var.name}-spot-notices"
  description = "EC2 spot interruption warnings and rebalance recommendations"
  # Events carry the instance id but not its tags, so the rule cannot filter by fleet.
  event_pattern = jsonencode({
    source      = ["aws.ec2"]
    detail-type = ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]
  })
  tags = local.tags
}

resource "aws_cloudwatch_event_target" "spot_notices" {
  rule = aws_cloudwatch_event_rule.spot_notices.name
  arn  = aws_sqs_queue.notices.arn
}

data "aws_iam_policy_document" "notices_queue" {
  statement {
    sid       = "EventBridgeSendsThisRuleOnly"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.notices.arn]
    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }
    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [aws_cloudwatch_event_rule.spot_notices.arn]
    }
  }
}

resource "aws_sqs_queue_policy" "notices" {
  queue_url = aws_sqs_queue.notices.id
  policy    = data.aws_iam_policy_document.notices_queue.json
}
