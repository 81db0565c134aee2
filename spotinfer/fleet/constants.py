"""Names and numbers the fleet adapters share with the Terraform in infra/terraform.

The tag and label keys below are also spelled in infra/terraform/aws/main.tf and
infra/terraform/gcp/main.tf; tests/infra checks that both sides agree.
"""

from __future__ import annotations

# AWS tags (keys may contain ':').
FLEET_TAG_KEY = "spotinfer:fleet"
ROLE_TAG_KEY = "spotinfer:role"

# GCE labels (lowercase letters, digits, '-' and '_' only).
FLEET_LABEL_KEY = "spotinfer-fleet"
ROLE_LABEL_KEY = "spotinfer-role"

WORKER_ROLE = "worker"

# The on-demand fallback group carries the worker tags / labels too; its tier tells it from
# the spot group. AWS tag key, GCE label key, and the value both take.
TIER_TAG_KEY = "spotinfer:tier"
TIER_LABEL_KEY = "spotinfer-tier"
FALLBACK_TIER = "fallback"

# EventBridge events the notice queue receives (infra/terraform/aws/notices.tf).
AWS_EVENT_SOURCE = "aws.ec2"
AWS_INTERRUPTION_DETAIL_TYPE = "EC2 Spot Instance Interruption Warning"
AWS_REBALANCE_DETAIL_TYPE = "EC2 Instance Rebalance Recommendation"

# EC2 interrupts a spot instance two minutes after the warning.
AWS_INTERRUPTION_NOTICE_SECONDS = 120.0

# SQS long polling: 20 s is the API's maximum wait, 10 its maximum batch.
SQS_MAX_WAIT_SECONDS = 20
SQS_MAX_MESSAGES = 10

# Suffixes the Terraform modules give to names derived from the fleet name.
AWS_NOTICE_QUEUE_SUFFIX = "-spot-notices"
GCP_GROUP_SUFFIX = "-workers"
GCP_FALLBACK_GROUP_SUFFIX = "-fallback"

# EC2 instance states that an instance of the fleet can be listed in.
AWS_LISTED_STATES = ("pending", "running", "shutting-down", "stopping", "stopped")
