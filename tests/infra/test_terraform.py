"""The Terraform, checked offline: formatting, and the properties a spot fleet depends on.

Every property check also runs on a mutated copy of the module, where it must fail: a check
that cannot fail protects nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from spotinfer.fleet import constants

pytest.importorskip("hcl2", reason="python-hcl2 is not installed")

from tests.infra import hcl_properties as hcl
from tests.infra.conftest import TERRAFORM_DIR

AWS_DIR = TERRAFORM_DIR / "aws"
GCP_DIR = TERRAFORM_DIR / "gcp"
LONG_NOTICE_SECONDS = 60  # anything above GCE's default 30 s counts as "the longer notice"

AWS_CHECKS: dict[str, Callable[[hcl.TerraformModule], list[str]]] = {
    "spot fleet": hcl.check_aws_spot_fleet,
    "fallback group": hcl.check_aws_fallback_group,
    "imdsv2": hcl.check_aws_imdsv2,
    "redis tls auth": hcl.check_aws_redis_tls_auth,
    "redis noeviction": hcl.check_aws_redis_noeviction,
    "no open ingress": hcl.check_no_open_ingress,
    "client ranges guarded": lambda module: hcl.check_client_ranges_guarded(
        module, ["client_cidrs"]
    ),
    "fis spot drill": lambda module: hcl.check_aws_fis_spot_drill(module, constants.FLEET_TAG_KEY),
    "kv mac keyring": lambda module: hcl.check_kv_mac_keyring(module, "aws"),
}

GCP_CHECKS: dict[str, Callable[[hcl.TerraformModule], list[str]]] = {
    "spot template": lambda module: hcl.check_gcp_spot_template(module, LONG_NOTICE_SECONDS),
    "fallback group": hcl.check_gcp_fallback_group,
    "redis tls auth": hcl.check_gcp_redis_tls_auth,
    "redis noeviction": hcl.check_gcp_redis_noeviction,
    "no open ingress": hcl.check_no_open_ingress,
    "client ranges guarded": lambda module: hcl.check_client_ranges_guarded(
        module, ["client_source_ranges", "internal_client_ranges"]
    ),
    "kv mac keyring": lambda module: hcl.check_kv_mac_keyring(module, "gcp"),
}


def test_terraform_fmt_is_clean() -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform is not installed (needed for `terraform fmt -check`)")
    result = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-list=true", str(TERRAFORM_DIR)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"files need `terraform fmt`:\n{result.stdout}"


@pytest.mark.parametrize("name", sorted(AWS_CHECKS))
def test_aws_module_keeps_property(name: str) -> None:
    assert AWS_CHECKS[name](hcl.load_module(AWS_DIR)) == []


@pytest.mark.parametrize("name", sorted(GCP_CHECKS))
def test_gcp_module_keeps_property(name: str) -> None:
    assert GCP_CHECKS[name](hcl.load_module(GCP_DIR)) == []


def test_examples_wire_the_modules() -> None:
    for example_dir in (AWS_DIR / "examples", GCP_DIR / "examples"):
        text = "\n".join(path.read_text() for path in example_dir.glob("*.tf"))
        assert re.search(r'module\s+"spotinfer"\s*\{\s*source\s*=\s*"\.\./"', text), example_dir


def test_tag_and_label_keys_match_the_adapters() -> None:
    aws, gcp = hcl.load_module(AWS_DIR), hcl.load_module(GCP_DIR)
    assert aws.locals["fleet_tag_key"] == constants.FLEET_TAG_KEY
    assert aws.locals["role_tag_key"] == constants.ROLE_TAG_KEY
    assert gcp.locals["fleet_label_key"] == constants.FLEET_LABEL_KEY
    assert gcp.locals["role_label_key"] == constants.ROLE_LABEL_KEY
    assert aws.locals["tier_tag_key"] == constants.TIER_TAG_KEY
    assert gcp.locals["tier_label_key"] == constants.TIER_LABEL_KEY
    assert aws.locals["fallback_tier"] == gcp.locals["fallback_tier"] == constants.FALLBACK_TIER


@pytest.mark.parametrize(
    ("cloud", "resources"),
    [
        ("aws", [("aws_autoscaling_group", "fallback")]),
        (
            "gcp",
            [
                ("google_compute_instance_template", "fallback"),
                ("google_compute_region_instance_group_manager", "fallback"),
            ],
        ),
    ],
)
def test_the_fallback_group_exists_only_when_its_maximum_is_above_0(
    cloud: str, resources: list[tuple[str, str]]
) -> None:
    module = hcl.load_module(TERRAFORM_DIR / cloud)
    assert module.variables["fallback_max_count"]["default"] == 0
    for resource_type, name in resources:
        body = module.of_type(resource_type)[name]
        assert hcl.count_when(body, "fallback_max_count", 0) == 0
        assert hcl.count_when(body, "fallback_max_count", 3) == 1


def test_the_fallback_group_is_where_the_adapter_looks() -> None:
    aws = hcl.load_module(AWS_DIR)
    # The node role may end the drain wait of either group's instances (by name prefix).
    assert (
        aws.of_type("aws_autoscaling_group")["fallback"]["name_prefix"] == "${var.name}-fallback-"
    )
    statements = aws.data["aws_iam_policy_document"]["node"]["statement"]
    (drain,) = [s for s in statements if s.get("sid") == "EndOwnTerminationWait"]
    assert any(
        arn.endswith("autoScalingGroupName/${var.name}-fallback-*") for arn in drain["resources"]
    )
    group_name = hcl.load_module(GCP_DIR).of_type("google_compute_region_instance_group_manager")[
        "fallback"
    ]["name"]
    assert group_name == "${var.name}" + constants.GCP_FALLBACK_GROUP_SUFFIX


def test_notice_rule_and_queue_match_the_adapter() -> None:
    aws = hcl.load_module(AWS_DIR)
    pattern = aws.of_type("aws_cloudwatch_event_rule")["spot_notices"]["event_pattern"]
    assert constants.AWS_EVENT_SOURCE in pattern
    assert constants.AWS_INTERRUPTION_DETAIL_TYPE in pattern
    assert constants.AWS_REBALANCE_DETAIL_TYPE in pattern
    queue_name = aws.of_type("aws_sqs_queue")["notices"]["name"]
    assert queue_name == "${var.name}" + constants.AWS_NOTICE_QUEUE_SUFFIX
    group_name = hcl.load_module(GCP_DIR).of_type("google_compute_region_instance_group_manager")[
        "worker"
    ]["name"]
    assert group_name == "${var.name}" + constants.GCP_GROUP_SUFFIX


# ---- mutations: each breaks one property in a copy; its check must notice ------------------

# (module, file, text to replace, replacement, check that must fail, words of the violation)
MUTATIONS = [
    (
        "aws",
        "workers.tf",
        "capacity_rebalance = true",
        "capacity_rebalance = false",
        "spot fleet",
        "capacity rebalance",
    ),
    (
        "aws",
        "workers.tf",
        'spot_allocation_strategy = "capacity-optimized"',
        'spot_allocation_strategy = "lowest-price"',
        "spot fleet",
        "lowest-price",
    ),
    (
        "aws",
        "workers.tf",
        "on_demand_percentage_above_base_capacity = 0",
        "on_demand_percentage_above_base_capacity = 100",
        "spot fleet",
        "on demand",
    ),
    (
        "aws",
        "variables.tf",
        '["g6.xlarge", "g5.xlarge", "g6.2xlarge", "g5.2xlarge", "g6e.xlarge"]',
        '["g6.xlarge"]',
        "spot fleet",
        "instance type",
    ),
    (
        "aws",
        "fallback.tf",
        "on_demand_percentage_above_base_capacity = 100",
        "on_demand_percentage_above_base_capacity = 0",
        "fallback group",
        "not all of it",
    ),
    (
        "aws",
        "fallback.tf",
        "desired_capacity    = 0",
        "desired_capacity    = 2",
        "fallback group",
        "start at 0",
    ),
    (
        "aws",
        "fallback.tf",
        "count = var.fallback_max_count > 0 ? 1 : 0",
        "count = 1",
        "fallback group",
        "only when fallback_max_count > 0",
    ),
    (
        "aws",
        "variables.tf",
        'creates no group."\n  type        = number\n  default     = 0',
        'creates no group."\n  type        = number\n  default     = 2',
        "fallback group",
        "defaults to 2",
    ),
    (
        "aws",
        "fallback.tf",
        "launch_template_id = aws_launch_template.worker.id",
        "launch_template_id = aws_launch_template.coordinator.id",
        "fallback group",
        "launch template",
    ),
    (
        "aws",
        "fallback.tf",
        'dynamic "initial_lifecycle_hook" {',
        'dynamic "warm_pool_hook" {',
        "fallback group",
        "lifecycle hook",
    ),
    (
        "aws",
        "fallback.tf",
        "(local.tier_tag_key) = local.fallback_tier",
        '"team" = "ml"',
        "fallback group",
        "tier tag",
    ),
    (
        "aws",
        "workers.tf",
        'http_tokens                 = "required"',
        'http_tokens                 = "optional"',
        "imdsv2",
        "IMDSv2",
    ),
    (
        "aws",
        "coordinator.tf",
        'http_tokens                 = "required"',
        'http_tokens                 = "optional"',
        "imdsv2",
        "coordinator",
    ),
    (
        "aws",
        "redis.tf",
        "transit_encryption_enabled = true",
        "transit_encryption_enabled = false",
        "redis tls auth",
        "TLS",
    ),
    (
        "aws",
        "redis.tf",
        "auth_token                 = random_password.redis_auth.result",
        "",
        "redis tls auth",
        "AUTH",
    ),
    (
        "aws",
        "redis.tf",
        'value = "noeviction"',
        'value = "volatile-lru"',
        "redis noeviction",
        "volatile-lru",
    ),
    (
        "aws",
        "redis.tf",
        "  parameter_group_name = aws_elasticache_parameter_group.kv.name\n",
        "",
        "redis noeviction",
        "default parameters",
    ),
    (
        "gcp",
        "redis.tf",
        'maxmemory-policy = "noeviction"',
        'maxmemory-policy = "allkeys-lru"',
        "redis noeviction",
        "allkeys-lru",
    ),
    (
        "aws",
        "security.tf",
        "cidr_ipv4         = each.value.cidr",
        'cidr_ipv4         = "0.0.0.0/0"',
        "no open ingress",
        "0.0.0.0/0",
    ),
    (
        "aws",
        "variables.tf",
        '!contains(["0.0.0.0/0", "::/0"], cidr)',
        "true",
        "client ranges guarded",
        "client_cidrs",
    ),
    (
        "aws",
        "fis.tf",
        '"aws:ec2:send-spot-instance-interruptions"',
        '"aws:ec2:stop-instances"',
        "fis spot drill",
        "spot interruption",
    ),
    (
        "gcp",
        "workers.tf",
        'provisioning_model = "SPOT"',
        'provisioning_model = "STANDARD"',
        "spot template",
        "SPOT",
    ),
    (
        "gcp",
        "variables.tf",
        'default     = "DELETE"',
        'default     = "NONE"',
        "spot template",
        "termination action",
    ),
    (
        "gcp",
        "variables.tf",
        "default     = 120",
        "default     = 0",
        "spot template",
        "preemption notice",
    ),
    ("gcp", "workers.tf", "provider = google-beta", "", "spot template", "google-beta"),
    (
        "gcp",
        "fallback.tf",
        'provisioning_model = "STANDARD"',
        'provisioning_model = "SPOT"',
        "fallback group",
        "STANDARD",
    ),
    (
        "gcp",
        "fallback.tf",
        "preemptible        = false",
        "preemptible        = true",
        "fallback group",
        "preemptible",
    ),
    (
        "gcp",
        "fallback.tf",
        "target_size        = 0",
        "target_size        = 2",
        "fallback group",
        "start at 0",
    ),
    (
        "gcp",
        "fallback.tf",
        "count = var.fallback_max_count > 0 ? 1 : 0",
        "count = 1",
        "fallback group",
        "only when fallback_max_count > 0",
    ),
    (
        "gcp",
        "fallback.tf",
        "startup-script         = local.worker_startup_script",
        'startup-script         = ""',
        "fallback group",
        "boot script",
    ),
    (
        "gcp",
        "redis.tf",
        'transit_encryption_mode = "SERVER_AUTHENTICATION"',
        'transit_encryption_mode = "DISABLED"',
        "redis tls auth",
        "TLS",
    ),
    (
        "gcp",
        "redis.tf",
        "auth_enabled            = true",
        "auth_enabled            = false",
        "redis tls auth",
        "AUTH",
    ),
    (
        "gcp",
        "firewall.tf",
        'source_ranges = ["35.191.0.0/16", "130.211.0.0/22"]',
        'source_ranges = ["0.0.0.0/0"]',
        "no open ingress",
        "0.0.0.0/0",
    ),
    (
        "aws",
        "iam.tf",
        "resources = [aws_secretsmanager_secret.kv_mac.arn]",
        "resources = [aws_secretsmanager_secret.redis_auth.arn]",
        "kv mac keyring",
        "cannot read",
    ),
    (
        "aws",
        "main.tf",
        "kv_mac_secret_arn          = aws_secretsmanager_secret.kv_mac.arn",
        'kv_mac_secret_arn          = ""',
        "kv mac keyring",
        "boot_settings",
    ),
    (
        "aws",
        "tls.tf",
        'resource "aws_secretsmanager_secret" "kv_mac" {',
        'resource "aws_secretsmanager_secret" "kv_mac" {\n  for_each = local.tls_roles',
        "kv mac keyring",
        "one keyring per cluster",
    ),
    (
        "gcp",
        "tls.tf",
        "secret_id = google_secret_manager_secret.kv_mac.secret_id",
        "secret_id = google_secret_manager_secret.redis_auth.secret_id",
        "kv mac keyring",
        "cannot read",
    ),
    (
        "gcp",
        "main.tf",
        "kv_mac_secret_id          = google_secret_manager_secret.kv_mac.secret_id",
        'kv_mac_secret_id          = ""',
        "kv mac keyring",
        "boot_settings",
    ),
]

EXTRA_OPEN_RULE = """
resource "aws_security_group_rule" "debug" {
  type              = "ingress"
  security_group_id = aws_security_group.worker.id
  from_port         = 50061
  to_port           = 50061
  protocol          = "tcp"
  cidr_blocks       = ["10.0.0.0/8", "0.0.0.0/0"]
}
"""


def _mutated_copy(
    tmp_path: Path, cloud: str, file_name: str, old: str, new: str
) -> hcl.TerraformModule:
    copy_dir = tmp_path / cloud
    shutil.copytree(TERRAFORM_DIR / cloud, copy_dir, ignore=shutil.ignore_patterns("examples"))
    target = copy_dir / file_name
    text = target.read_text()
    assert old in text, f"mutation anchor not found in {cloud}/{file_name}: {old!r}"
    target.write_text(text.replace(old, new, 1))
    return hcl.load_module(copy_dir)


@pytest.mark.parametrize(
    ("cloud", "file_name", "old", "new", "check", "words"),
    MUTATIONS,
    ids=[f"{m[0]}-{m[4]}-{m[5]}" for m in MUTATIONS],
)
def test_a_broken_property_is_caught(
    tmp_path: Path, cloud: str, file_name: str, old: str, new: str, check: str, words: str
) -> None:
    module = _mutated_copy(tmp_path, cloud, file_name, old, new)
    checks = AWS_CHECKS if cloud == "aws" else GCP_CHECKS

    violations = checks[check](module)

    assert any(words in violation for violation in violations), violations


def test_an_added_open_rule_is_caught(tmp_path: Path) -> None:
    copy_dir = tmp_path / "aws"
    shutil.copytree(AWS_DIR, copy_dir, ignore=shutil.ignore_patterns("examples"))
    (copy_dir / "debug.tf").write_text(EXTRA_OPEN_RULE)

    violations = hcl.check_no_open_ingress(hcl.load_module(copy_dir))

    assert violations == ["aws_security_group_rule.debug: ingress from 0.0.0.0/0"]
