"""Properties the Terraform must keep, as functions over parsed HCL.

Each ``check_*`` takes a ``TerraformModule`` (every ``*.tf`` of one directory, parsed with
python-hcl2) and returns the violations it finds as sentences; an empty list means the
property holds. Tests run them on infra/terraform and on mutated copies, which must fail.

Values that are plain variable references (``${var.x}``) are resolved to the variable's
default, which is what an operator gets without overrides.

The on-demand fallback group (the resources named ``fallback``) is held to its own checks,
not to the spot ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hcl2
from hcl2.utils import SerializationOptions

OPEN_CIDRS = ("0.0.0.0/0", "::/0")
FALLBACK = "fallback"
_VAR_REFERENCE = re.compile(r"^\$\{var\.([A-Za-z0-9_]+)\}$")
_COUNT_IF_POSITIVE = re.compile(r"^\$\{var\.([A-Za-z0-9_]+) > 0 \? 1 : 0\}$")
_OPTIONS = SerializationOptions(
    with_comments=False, explicit_blocks=False, strip_string_quotes=True
)


@dataclass
class TerraformModule:
    path: Path
    resources: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    data: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    locals: dict[str, Any] = field(default_factory=dict)

    def of_type(self, resource_type: str) -> dict[str, dict[str, Any]]:
        return self.resources.get(resource_type, {})

    def resolve(self, value: Any) -> Any:
        """A ``${var.x}`` reference becomes x's default; anything else stays as it is."""
        if isinstance(value, str):
            match = _VAR_REFERENCE.match(value)
            if match and match.group(1) in self.variables:
                return self.variables[match.group(1)].get("default")
        return value


def load_module(path: Path) -> TerraformModule:
    module = TerraformModule(path)
    for tf_file in sorted(path.glob("*.tf")):
        with tf_file.open() as handle:
            parsed = hcl2.load(handle, serialization_options=_OPTIONS)
        for block in parsed.get("resource", []):
            for resource_type, named in block.items():
                module.resources.setdefault(resource_type, {}).update(named)
        for block in parsed.get("data", []):
            for data_type, named in block.items():
                module.data.setdefault(data_type, {}).update(named)
        for block in parsed.get("variable", []):
            module.variables.update(block)
        for block in parsed.get("locals", []):
            module.locals.update(block)
    return module


def _blocks(body: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Nested blocks ``name`` of a body, static or ``dynamic`` (their ``content``)."""
    found = list(body.get(name, []))
    for dynamic in body.get("dynamic", []):
        if name in dynamic:
            found.extend(dynamic[name].get("content", []))
    return found


def _dynamic(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    for dynamic in body.get("dynamic", []):
        if name in dynamic:
            block: dict[str, Any] = dynamic[name]
            return block
    return None


def _one(body: dict[str, Any], name: str) -> dict[str, Any]:
    blocks = _blocks(body, name)
    return blocks[0] if blocks else {}


def count_when(body: dict[str, Any], variable: str, value: int) -> int | None:
    """How many of the resource exist when ``variable`` is ``value``; None if its count is not
    ``var.<variable> > 0 ? 1 : 0`` (the one optional-resource shape these modules use)."""
    match = _COUNT_IF_POSITIVE.match(str(body.get("count", "")))
    if not match or match.group(1) != variable:
        return None
    return 1 if value > 0 else 0


def _check_fallback_count(module: TerraformModule, where: str, body: dict[str, Any]) -> list[str]:
    violations = []
    default = module.variables.get("fallback_max_count", {}).get("default")
    if default != 0:
        violations.append(f"fallback_max_count defaults to {default!r}, not 0 (no group)")
    if count_when(body, "fallback_max_count", 0) != 0:
        violations.append(f"{where} is not created only when fallback_max_count > 0")
    return violations


# ---- AWS ------------------------------------------------------------------------------------


def check_aws_spot_fleet(module: TerraformModule) -> list[str]:
    """Workers are spot, capacity-optimized over several instance types, capacity rebalance on."""
    violations: list[str] = []
    groups = {
        name: body
        for name, body in module.of_type("aws_autoscaling_group").items()
        if _blocks(body, "mixed_instances_policy") and name != FALLBACK
    }
    if not groups:
        return ["no Auto Scaling group with a mixed instances policy"]
    for name, body in groups.items():
        policy = _one(body, "mixed_instances_policy")
        distribution = _one(policy, "instances_distribution")
        if module.resolve(body.get("capacity_rebalance")) is not True:
            violations.append(f"aws_autoscaling_group.{name}: capacity rebalance is not on")
        strategy = module.resolve(distribution.get("spot_allocation_strategy"))
        if strategy != "capacity-optimized":
            violations.append(f"aws_autoscaling_group.{name}: spot allocation is {strategy!r}")
        above_base = module.resolve(distribution.get("on_demand_percentage_above_base_capacity"))
        if above_base != 0:
            violations.append(
                f"aws_autoscaling_group.{name}: {above_base}% on demand above the base, not spot"
            )
        instance_types = _override_instance_types(module, _one(policy, "launch_template"))
        if len(set(instance_types)) < 2:
            violations.append(
                f"aws_autoscaling_group.{name}: {len(set(instance_types))} instance type(s); "
                "spot needs several pools"
            )
    return violations


def _override_instance_types(module: TerraformModule, launch_template: dict[str, Any]) -> list[str]:
    types = [
        block["instance_type"]
        for block in launch_template.get("override", [])
        if "instance_type" in block
    ]
    dynamic = _dynamic(launch_template, "override")
    if dynamic is not None:
        resolved = module.resolve(dynamic.get("for_each"))
        if isinstance(resolved, list):
            types.extend(str(item) for item in resolved)
    return types


def check_aws_fallback_group(module: TerraformModule) -> list[str]:
    """The optional fallback group: only when fallback_max_count > 0, all on demand, empty at
    first, the workers' launch template (whose boot registers an on-demand VM without
    --spot), subnets and drain hook, and a tier tag that tells it from the spot group."""
    groups = module.of_type("aws_autoscaling_group")
    if FALLBACK not in groups:
        return [f"no aws_autoscaling_group.{FALLBACK}"]
    body, spot = groups[FALLBACK], groups.get("worker", {})
    where = f"aws_autoscaling_group.{FALLBACK}"
    violations = _check_fallback_count(module, where, body)
    policy = _one(body, "mixed_instances_policy")
    distribution = _one(policy, "instances_distribution")
    on_demand = module.resolve(distribution.get("on_demand_percentage_above_base_capacity"))
    if on_demand != 100:
        violations.append(f"{where}: {on_demand}% on demand above the base, not all of it")
    if module.resolve(body.get("min_size")) != 0 or module.resolve(body.get("desired_capacity")):
        violations.append(f"{where}: does not start at 0 workers")
    if body.get("max_size") != "${var.fallback_max_count}":
        violations.append(f"{where}: max_size is not var.fallback_max_count")
    template = _one(_one(policy, "launch_template"), "launch_template_specification")
    if template.get("launch_template_id") != "${aws_launch_template.worker.id}":
        violations.append(f"{where}: not the workers' launch template (and boot)")
    if body.get("vpc_zone_identifier") != spot.get("vpc_zone_identifier"):
        violations.append(f"{where}: not the spot workers' subnets")
    if bool(_blocks(body, "initial_lifecycle_hook")) != bool(
        _blocks(spot, "initial_lifecycle_hook")
    ):
        violations.append(f"{where}: no drain lifecycle hook like the spot group's")
    tags = str((_dynamic(body, "tag") or {}).get("for_each", ""))
    if "(local.tier_tag_key) = local.fallback_tier" not in tags:
        violations.append(f"{where}: no tier tag (the adapter finds the group by it)")
    if "desired_capacity" not in _one(body, "lifecycle").get("ignore_changes", []):
        violations.append(f"{where}: Terraform would undo the adapter's desired capacity")
    return violations


def check_aws_imdsv2(module: TerraformModule) -> list[str]:
    """Every launch template requires IMDSv2 session tokens (and keeps the endpoint on)."""
    violations = []
    for name, body in module.of_type("aws_launch_template").items():
        options = _one(body, "metadata_options")
        if module.resolve(options.get("http_tokens")) != "required":
            violations.append(f"aws_launch_template.{name}: IMDSv2 is not required")
        if module.resolve(options.get("http_endpoint", "enabled")) != "enabled":
            violations.append(
                f"aws_launch_template.{name}: metadata endpoint off (the daemon needs it)"
            )
    return violations


def check_aws_redis_tls_auth(module: TerraformModule) -> list[str]:
    """ElastiCache encrypts in transit and at rest and requires an AUTH token."""
    groups = module.of_type("aws_elasticache_replication_group")
    if not groups:
        return ["no ElastiCache replication group"]
    violations = []
    for name, body in groups.items():
        if module.resolve(body.get("transit_encryption_enabled")) is not True:
            violations.append(f"aws_elasticache_replication_group.{name}: no TLS in transit")
        if not body.get("auth_token"):
            violations.append(f"aws_elasticache_replication_group.{name}: no AUTH token")
        if module.resolve(body.get("at_rest_encryption_enabled")) is not True:
            violations.append(f"aws_elasticache_replication_group.{name}: not encrypted at rest")
    return violations


def check_aws_redis_noeviction(module: TerraformModule) -> list[str]:
    """Every ElastiCache group uses a parameter group whose maxmemory-policy is noeviction
    (the default, volatile-lru, can evict request records: the processes refuse it)."""
    groups = module.of_type("aws_elasticache_replication_group")
    parameter_groups = module.of_type("aws_elasticache_parameter_group")
    violations = []
    for name, body in groups.items():
        reference = str(body.get("parameter_group_name", ""))
        target = reference.removeprefix("${").removesuffix("}").split(".")
        if len(target) < 2 or target[0] != "aws_elasticache_parameter_group":
            violations.append(f"aws_elasticache_replication_group.{name}: default parameters")
            continue
        parameters = _blocks(parameter_groups.get(target[1], {}), "parameter")
        policy = {p.get("name"): p.get("value") for p in parameters}.get("maxmemory-policy")
        if policy != "noeviction":
            violations.append(
                f"aws_elasticache_replication_group.{name}: maxmemory-policy {policy}, "
                "not noeviction"
            )
    return violations


def check_aws_fis_spot_drill(module: TerraformModule, fleet_tag_key: str) -> list[str]:
    """An FIS template sends spot interruptions to spot instances tagged with the fleet."""
    for name, body in module.of_type("aws_fis_experiment_template").items():
        actions = [
            action
            for action in body.get("action", [])
            if action.get("action_id") == "aws:ec2:send-spot-instance-interruptions"
        ]
        targets = [
            target
            for target in body.get("target", [])
            if target.get("resource_type") == "aws:ec2:spot-instance"
            and any(
                module.locals.get("fleet_tag_key") == fleet_tag_key
                and tag.get("key") == "${local.fleet_tag_key}"
                for tag in target.get("resource_tag", [])
            )
        ]
        if actions and targets:
            return []
        return [f"aws_fis_experiment_template.{name}: no spot interruption of tagged workers"]
    return ["no FIS experiment template"]


# ---- GCP ------------------------------------------------------------------------------------


def check_gcp_spot_template(module: TerraformModule, minimum_notice_seconds: int) -> list[str]:
    """Workers' template: SPOT, a termination action, and the longer preemption notice."""
    templates = {
        name: body
        for name, body in module.of_type("google_compute_instance_template").items()
        if name != FALLBACK
    }
    if not templates:
        return ["no instance template"]
    violations = []
    for name, body in templates.items():
        where = f"google_compute_instance_template.{name}"
        scheduling = _one(body, "scheduling")
        if module.resolve(scheduling.get("provisioning_model")) != "SPOT":
            violations.append(f"{where}: provisioning model is not SPOT")
        if module.resolve(scheduling.get("instance_termination_action")) not in ("DELETE", "STOP"):
            violations.append(f"{where}: no instance termination action")
        if module.resolve(scheduling.get("automatic_restart")) is not False:
            violations.append(f"{where}: automatic restart must be off for SPOT")
        notice_seconds = _notice_seconds(module, scheduling)
        if notice_seconds is None or notice_seconds < minimum_notice_seconds:
            violations.append(f"{where}: preemption notice {notice_seconds} s, not the longer one")
        # scheduling.preemption_notice_duration exists only in the google-beta provider.
        if body.get("provider") != "google-beta" and notice_seconds is not None:
            violations.append(f"{where}: the preemption notice needs provider google-beta")
        for interface in body.get("network_interface", []):
            if _blocks(interface, "access_config"):
                violations.append(f"{where}: workers get a public IP")
    return violations


def check_gcp_fallback_group(module: TerraformModule) -> list[str]:
    """The optional fallback group: only when fallback_max_count > 0, STANDARD VMs (not
    preemptible), empty at first, the workers' startup script (which registers a
    non-preemptible VM without --spot) and a tier label."""
    templates = module.of_type("google_compute_instance_template")
    managers = module.of_type("google_compute_region_instance_group_manager")
    if FALLBACK not in templates or FALLBACK not in managers:
        return [f"no google_compute_instance_template.{FALLBACK} and group manager"]
    template, manager = templates[FALLBACK], managers[FALLBACK]
    where = f"google_compute_instance_template.{FALLBACK}"
    group_where = f"google_compute_region_instance_group_manager.{FALLBACK}"
    violations = _check_fallback_count(module, where, template)
    violations += _check_fallback_count(module, group_where, manager)
    scheduling = _one(template, "scheduling")
    if module.resolve(scheduling.get("provisioning_model")) != "STANDARD":
        violations.append(f"{where}: provisioning model is not STANDARD")
    if module.resolve(scheduling.get("preemptible")) is not False:
        violations.append(f"{where}: VMs are preemptible")
    spot_metadata = templates.get("worker", {}).get("metadata", {})
    if template.get("metadata", {}).get("startup-script") != spot_metadata.get("startup-script"):
        violations.append(f"{where}: not the spot workers' boot script")
    if "(local.tier_label_key) = local.fallback_tier" not in str(template.get("labels", "")):
        violations.append(f"{where}: no tier label")
    if module.resolve(manager.get("target_size")) != 0:
        violations.append(f"{group_where}: does not start at 0 workers")
    version = _one(manager, "version").get("instance_template", "")
    if f"google_compute_instance_template.{FALLBACK}[0]" not in version:
        violations.append(f"{group_where}: does not use the fallback template")
    if "target_size" not in _one(manager, "lifecycle").get("ignore_changes", []):
        violations.append(f"{group_where}: Terraform would undo the adapter's size")
    return violations


def _notice_seconds(module: TerraformModule, scheduling: dict[str, Any]) -> int | None:
    static = scheduling.get("preemption_notice_duration", [])
    if static:
        seconds = module.resolve(static[0].get("seconds"))
        return seconds if isinstance(seconds, int) else None
    dynamic = _dynamic(scheduling, "preemption_notice_duration")
    if dynamic is None:
        return None
    # `for_each = var.x > 0 ? [var.x] : []`: the block exists when x's default is positive.
    match = re.search(r"var\.([A-Za-z0-9_]+)", str(dynamic.get("for_each", "")))
    if not match or match.group(1) not in module.variables:
        return None
    default = module.variables[match.group(1)].get("default")
    return default if isinstance(default, int) and default > 0 else None


def check_gcp_redis_tls_auth(module: TerraformModule) -> list[str]:
    """Memorystore requires AUTH and TLS (server authentication)."""
    instances = module.of_type("google_redis_instance")
    if not instances:
        return ["no Memorystore instance"]
    violations = []
    for name, body in instances.items():
        if module.resolve(body.get("auth_enabled")) is not True:
            violations.append(f"google_redis_instance.{name}: AUTH is off")
        if module.resolve(body.get("transit_encryption_mode")) != "SERVER_AUTHENTICATION":
            violations.append(f"google_redis_instance.{name}: no TLS in transit")
    return violations


def check_gcp_redis_noeviction(module: TerraformModule) -> list[str]:
    """Memorystore's maxmemory-policy is noeviction (its default, volatile-lru, can evict
    request records: the processes refuse it)."""
    violations = []
    for name, body in module.of_type("google_redis_instance").items():
        configs = module.resolve(body.get("redis_configs")) or {}
        policy = configs.get("maxmemory-policy") if isinstance(configs, dict) else None
        if policy != "noeviction":
            violations.append(
                f"google_redis_instance.{name}: maxmemory-policy {policy}, not noeviction"
            )
    return violations


# ---- both -----------------------------------------------------------------------------------


def _sources(module: TerraformModule, value: Any) -> list[str]:
    resolved = module.resolve(value)
    if isinstance(resolved, str):
        return [resolved]
    if isinstance(resolved, list):
        return [str(item) for item in resolved]
    return []


def check_no_open_ingress(module: TerraformModule) -> list[str]:
    """No ingress rule anywhere admits 0.0.0.0/0 or ::/0 (so no worker, daemon or
    coordinator gRPC port is open to the internet)."""
    found: list[tuple[str, list[str]]] = []
    for name, body in module.of_type("aws_security_group").items():
        for rule in _blocks(body, "ingress"):
            cidrs = _sources(module, rule.get("cidr_blocks"))
            cidrs += _sources(module, rule.get("ipv6_cidr_blocks"))
            found.append((f"aws_security_group.{name}", cidrs))
    for name, body in module.of_type("aws_vpc_security_group_ingress_rule").items():
        cidrs = _sources(module, body.get("cidr_ipv4")) + _sources(module, body.get("cidr_ipv6"))
        found.append((f"aws_vpc_security_group_ingress_rule.{name}", cidrs))
    for name, body in module.of_type("aws_security_group_rule").items():
        if module.resolve(body.get("type")) == "ingress":
            cidrs = _sources(module, body.get("cidr_blocks"))
            cidrs += _sources(module, body.get("ipv6_cidr_blocks"))
            found.append((f"aws_security_group_rule.{name}", cidrs))
    for name, body in module.of_type("google_compute_firewall").items():
        if module.resolve(body.get("direction", "INGRESS")) == "INGRESS":
            found.append(
                (f"google_compute_firewall.{name}", _sources(module, body.get("source_ranges")))
            )
    return [
        f"{where}: ingress from {cidr}"
        for where, cidrs in found
        for cidr in cidrs
        if cidr in OPEN_CIDRS
    ]


def check_client_ranges_guarded(module: TerraformModule, variable_names: list[str]) -> list[str]:
    """Variables that feed ingress rules refuse 0.0.0.0/0 and ::/0 in their validation."""
    violations = []
    for name in variable_names:
        variable = module.variables.get(name)
        if variable is None:
            violations.append(f"variable {name} is missing")
            continue
        conditions = " ".join(
            str(rule.get("condition", "")) for rule in variable.get("validation", [])
        )
        if not all(cidr in conditions for cidr in OPEN_CIDRS):
            violations.append(f"variable {name} does not refuse {' and '.join(OPEN_CIDRS)}")
        if any(cidr in OPEN_CIDRS for cidr in variable.get("default") or []):
            violations.append(f"variable {name} defaults to an open range")
    return violations


# ---- both -----------------------------------------------------------------------------------


def check_kv_mac_keyring(module: TerraformModule, cloud: str) -> list[str]:
    """One KV MAC keyring secret for the cluster, readable by the nodes, whose id the boot
    script is given (without it every process refuses the off-loopback Redis)."""
    secret_type, setting = {
        "aws": ("aws_secretsmanager_secret", "kv_mac_secret_arn"),
        "gcp": ("google_secret_manager_secret", "kv_mac_secret_id"),
    }[cloud]
    secrets = module.of_type(secret_type)
    if "kv_mac" not in secrets:
        return [f"no {secret_type}.kv_mac (the cluster's KV MAC keyring)"]
    violations = []
    if "for_each" in secrets["kv_mac"] or "count" in secrets["kv_mac"]:
        violations.append(f"{secret_type}.kv_mac: one keyring per cluster, not one per role")
    reference = f"{secret_type}.kv_mac."
    if reference not in str(module.locals.get("boot_settings", {}).get(setting, "")):
        violations.append(f"boot_settings.{setting} does not name {secret_type}.kv_mac")
    if cloud == "aws":
        statements = module.data.get("aws_iam_policy_document", {}).get("node", {})
        readable = [
            statement
            for statement in statements.get("statement", [])
            if "secretsmanager:GetSecretValue" in statement.get("actions", [])
            and reference in str(statement.get("resources", ""))
        ]
    else:
        readable = [
            body
            for body in module.of_type("google_secret_manager_secret_iam_member").values()
            if reference in str(body.get("secret_id", ""))
            and module.resolve(body.get("role")) == "roles/secretmanager.secretAccessor"
        ]
    if not readable:
        violations.append(f"the node identity cannot read {secret_type}.kv_mac")
    return violations
