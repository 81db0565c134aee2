# Least privilege: the VMs may read one secret, register with SSM and end their own
# termination wait; the FIS role may interrupt only spot instances tagged with this fleet.

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name_prefix        = "${var.name}-node-"
  description        = "spotinfer ${var.name} workers and coordinator"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = local.tags
}

resource "aws_iam_instance_profile" "node" {
  name_prefix = "${var.name}-node-"
  role        = aws_iam_role.node.name
  tags        = local.tags
}

# Session Manager replaces SSH: shell access is audited by IAM and needs no open port.
resource "aws_iam_role_policy_attachment" "node_ssm" {
  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

data "aws_iam_policy_document" "node" {
  statement {
    sid       = "ReadRedisAuthToken"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_secretsmanager_secret.redis_auth.arn]
  }

  # The nodes' TLS bundles (tls.tf), fetched at boot and hourly by the boot script.
  statement {
    sid       = "ReadTlsBundles"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [for secret in aws_secretsmanager_secret.tls : secret.arn]
  }

  # The cluster's KV MAC keyring (tls.tf), fetched at boot and hourly by the boot script.
  statement {
    sid       = "ReadKvMacKeyring"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_secretsmanager_secret.kv_mac.arn]
  }

  # A worker being drained by the termination lifecycle hook ends the wait itself once its
  # requests have moved; only this fleet's worker groups (spot and fallback, by their name
  # prefixes) can be touched.
  statement {
    sid     = "EndOwnTerminationWait"
    actions = ["autoscaling:CompleteLifecycleAction", "autoscaling:RecordLifecycleActionHeartbeat"]
    resources = [
      "arn:${local.partition}:autoscaling:${local.region}:${local.account_id}:autoScalingGroup:*:autoScalingGroupName/${var.name}-workers-*",
      "arn:${local.partition}:autoscaling:${local.region}:${local.account_id}:autoScalingGroup:*:autoScalingGroupName/${var.name}-fallback-*",
    ]
  }

  # The secret is encrypted with the fleet key; decrypting is allowed only through
  # Secrets Manager, not for arbitrary ciphertext.
  statement {
    sid       = "DecryptRedisAuthToken"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.fleet.arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["secretsmanager.${local.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "node" {
  name_prefix = "spotinfer-node-"
  role        = aws_iam_role.node.id
  policy      = data.aws_iam_policy_document.node.json
}

# ---------------------------------------------------------------------------------------------
# FIS: the role an experiment runs as.
# ---------------------------------------------------------------------------------------------

data "aws_iam_policy_document" "fis_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["fis.amazonaws.com"]
    }
    # Confused-deputy guard: only experiments of this account may assume the role.
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account_id]
    }
  }
}

resource "aws_iam_role" "fis" {
  name_prefix        = "${var.name}-fis-"
  description        = "FIS spot interruption drills against the spotinfer ${var.name} fleet"
  assume_role_policy = data.aws_iam_policy_document.fis_assume.json
  tags               = local.tags
}

data "aws_iam_policy_document" "fis" {
  statement {
    sid       = "InterruptOnlyThisFleet"
    actions   = ["ec2:SendSpotInstanceInterruptions"]
    resources = ["arn:${local.partition}:ec2:${local.region}:${local.account_id}:instance/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/${local.fleet_tag_key}"
      values   = [var.name]
    }
  }

  # FIS resolves the experiment's targets by tag; DescribeInstances has no resource-level
  # permissions, so "*" is the narrowest possible resource.
  statement {
    sid       = "ResolveTargets"
    actions   = ["ec2:DescribeInstances"]
    resources = ["*"]
  }

  # Delivering experiment logs to CloudWatch Logs (the log delivery APIs take no resource).
  statement {
    sid = "DeliverExperimentLogs"
    actions = [
      "logs:CreateLogDelivery",
      "logs:PutResourcePolicy",
      "logs:DescribeResourcePolicies",
      "logs:DescribeLogGroups",
    ]
    resources = ["*"]
  }
}

resource "aws_iam_role_policy" "fis" {
  name_prefix = "spotinfer-fis-"
  role        = aws_iam_role.fis.id
  policy      = data.aws_iam_policy_document.fis.json
}
