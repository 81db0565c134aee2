# ---------------------------------------------------------------------------------------------
# Identity and network
# ---------------------------------------------------------------------------------------------

variable "name" {
  description = "Fleet name. Prefixes every resource and is the value of the `spotinfer:fleet` tag that the fleet adapter, FIS and IAM conditions select on."
  type        = string

  validation {
    # Load balancer and target group names are capped at 32 characters; the longest suffix
    # this module adds is 14 ("-internal-grpc").
    condition     = can(regex("^[a-z][a-z0-9-]{1,15}$", var.name))
    error_message = "name must be 2-16 characters of lowercase letters, digits and '-', starting with a letter."
  }
}

variable "vpc_id" {
  description = "VPC to deploy into. Its CIDR block bounds who may reach the internal load balancer."
  type        = string
}

variable "private_subnet_ids" {
  description = "Private subnets (with a NAT route for pip and model downloads) for workers, the coordinator, Redis and the internal load balancer. One per availability zone: spot capacity differs by zone, so more zones mean fewer interruptions."
  type        = list(string)

  validation {
    condition     = length(var.private_subnet_ids) >= 2
    error_message = "Give at least two private subnets in different availability zones."
  }
}

variable "public_subnet_ids" {
  description = "Public subnets for the internet-facing load balancer. Only used when client_cidrs is not empty."
  type        = list(string)
  default     = []
}

variable "client_cidrs" {
  description = "CIDR blocks of clients outside the VPC allowed to reach the coordinator through an internet-facing load balancer. Empty (the default) creates no public endpoint."
  type        = list(string)
  default     = []

  validation {
    # The coordinator speaks plain gRPC with no authentication of its own: opening it to the
    # whole internet would hand the GPUs to anyone. Put an authenticating proxy in front instead.
    condition     = alltrue([for cidr in var.client_cidrs : !contains(["0.0.0.0/0", "::/0"], cidr)])
    error_message = "client_cidrs must not contain 0.0.0.0/0 or ::/0; list the clients' own ranges."
  }
}

variable "tags" {
  description = "Extra tags for every resource."
  type        = map(string)
  default     = {}
}

# ---------------------------------------------------------------------------------------------
# What the VMs run
# ---------------------------------------------------------------------------------------------

variable "ami_id" {
  description = "AMI for the workers: a GPU image with NVIDIA drivers and Python >= 3.10, e.g. the AWS Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04); docs/deploy.md shows how to look it up."
  type        = string
}

variable "coordinator_ami_id" {
  description = "AMI for the coordinator (needs no GPU). Null reuses ami_id."
  type        = string
  default     = null
}

variable "root_device_name" {
  description = "Root device name of the AMIs (/dev/sda1 on Ubuntu, /dev/xvda on Amazon Linux)."
  type        = string
  default     = "/dev/sda1"
}

variable "spotinfer_package" {
  description = "pip requirement that installs spotinfer on the VMs, e.g. \"spotinfer[gpu]==0.1.0\" or a wheel URL."
  type        = string
  default     = "spotinfer[gpu]"
}

variable "pip_args" {
  description = "Extra pip arguments for that install (an internal index URL, for example)."
  type        = string
  default     = ""
}

variable "model" {
  description = "Model every worker serves (Hugging Face id or local path), passed to `spotinfer worker --model`."
  type        = string
}

variable "worker_port" {
  description = "Port of the Worker gRPC service on each worker."
  type        = number
  default     = 50061
}

variable "daemon_peer_port" {
  description = "Port of the context daemon's peer migration server (KV blocks move between daemons on it during a grace period). Must match the daemon's setting."
  type        = number
  default     = 50071
}

variable "coordinator_grpc_port" {
  description = "Port of the coordinator's gRPC Inference and Control services."
  type        = number
  default     = 50051
}

variable "coordinator_internal_port" {
  description = "Port of the coordinator's mutual-TLS internal gRPC services (RegisterWorker, Control with an operator certificate, coordinator to coordinator). Workers register here: the public port asks no client certificate, so it cannot tell a worker from a user. Internal only; no public listener or rule opens it."
  type        = number
  default     = 50052
}

variable "coordinator_http_port" {
  description = "Port of the coordinator's OpenAI-compatible HTTP front."
  type        = number
  default     = 8000
}

variable "worker_metrics_port" {
  description = "Port of each worker's Prometheus /metrics endpoint (served on the VM's address; no ingress rule opens it: add one for your scraper)."
  type        = number
  default     = 9400
}

variable "daemon_metrics_port" {
  description = "Port of each context daemon's Prometheus /metrics endpoint (as worker_metrics_port)."
  type        = number
  default     = 9401
}

variable "lease_interval_seconds" {
  description = "How often each worker renews its registration with the coordinator."
  type        = number
  default     = 2
}

variable "lease_ttl_seconds" {
  description = "How long the coordinator keeps a worker's registration without a renewal; past it the worker takes no new request until it registers again."
  type        = number
  default     = 6
}

# ---------------------------------------------------------------------------------------------
# Worker fleet
# ---------------------------------------------------------------------------------------------

variable "worker_instance_types" {
  description = "GPU instance types the Auto Scaling group may launch. Several types (all able to hold the model) let the capacity-optimized strategy pick the spot pools least likely to be interrupted. The defaults each have one 24-48 GiB GPU, enough for an 8B model in bf16."
  type        = list(string)
  default     = ["g6.xlarge", "g5.xlarge", "g6.2xlarge", "g5.2xlarge", "g6e.xlarge"]

  validation {
    condition     = length(var.worker_instance_types) >= 2
    error_message = "List at least two instance types: a single spot pool is interrupted together."
  }
}

variable "worker_min_count" {
  description = "Minimum number of workers."
  type        = number
  default     = 2
}

variable "worker_desired_count" {
  description = "Initial number of workers. Terraform sets it once; afterwards `spotinfer fleet scale` owns it."
  type        = number
  default     = 4
}

variable "worker_max_count" {
  description = "Maximum number of workers. Keep headroom above the desired count: capacity rebalancing launches a replacement before the old instance is gone."
  type        = number
  default     = 8
}

variable "on_demand_base_count" {
  description = "Workers launched on demand before any spot worker. On-demand workers are never interrupted, so they make dependable standbys; each costs about 2.5-3x a spot one."
  type        = number
  default     = 0
}

variable "fallback_max_count" {
  description = "Most on-demand fallback workers: a second Auto Scaling group, empty until `spotinfer fleet fallback` (or the fleet adapter) sizes it while spot capacity falls short. 0 (the default) creates no group."
  type        = number
  default     = 0

  validation {
    condition     = var.fallback_max_count >= 0 && floor(var.fallback_max_count) == var.fallback_max_count
    error_message = "fallback_max_count must be a whole number, 0 or more."
  }
}

variable "termination_drain_seconds" {
  description = "How long a worker the group itself terminates (rebalance, scale-in, refresh) stays in Terminating:Wait so its daemon can move requests away, as a spot notice would allow. 0 turns the lifecycle hook off."
  type        = number
  default     = 120

  validation {
    condition     = var.termination_drain_seconds == 0 || (var.termination_drain_seconds >= 30 && var.termination_drain_seconds <= 7200)
    error_message = "termination_drain_seconds must be 0 or between 30 and 7200."
  }
}

variable "root_volume_gib" {
  description = "Root volume size: the OS, the virtualenv (about 15 GiB with CUDA wheels) and the model weights."
  type        = number
  default     = 200
}

variable "coordinator_instance_type" {
  description = "On-demand instance type for the coordinator (CPU only)."
  type        = string
  default     = "m7i.large"
}

# ---------------------------------------------------------------------------------------------
# Redis (tokens and KV-cache blocks)
# ---------------------------------------------------------------------------------------------

variable "redis_node_type" {
  description = "ElastiCache node type. Size it for the KV cache of all in-flight requests: KV bytes per token x tokens in flight (Llama-3-8B: 128 KiB/token, so 32 requests of 4k tokens need 16 GiB)."
  type        = string
  default     = "cache.r7g.xlarge"
}

variable "redis_node_count" {
  description = "Nodes in the replication group: 1 primary plus replicas. Two or more turn on Multi-AZ automatic failover."
  type        = number
  default     = 2

  validation {
    condition     = var.redis_node_count >= 1 && var.redis_node_count <= 6
    error_message = "redis_node_count must be between 1 and 6."
  }
}

variable "redis_engine_version" {
  description = "Redis engine version (7.x supports the AUTH token rotation this module relies on)."
  type        = string
  default     = "7.1"
}

# ---------------------------------------------------------------------------------------------
# Drills and protection
# ---------------------------------------------------------------------------------------------

variable "fis_interruption_notice" {
  description = "Notice FIS gives before it interrupts a spot worker (ISO 8601, PT2M to PT15M). PT2M matches a real spot interruption."
  type        = string
  default     = "PT2M"

  validation {
    condition     = can(regex("^PT([2-9]|1[0-5])M$", var.fis_interruption_notice))
    error_message = "fis_interruption_notice must be PT2M ... PT15M."
  }
}

variable "fis_target_selection" {
  description = "How many tagged spot workers one drill interrupts: COUNT(n) or PERCENT(p)."
  type        = string
  default     = "COUNT(1)"

  validation {
    condition     = can(regex("^(COUNT\\([1-9][0-9]*\\)|PERCENT\\(([1-9][0-9]?|100)\\))$", var.fis_target_selection))
    error_message = "fis_target_selection must be COUNT(n) or PERCENT(p)."
  }
}

variable "fis_stop_alarm_arn" {
  description = "CloudWatch alarm that stops a running drill when it fires (for example on the coordinator's error rate). Null runs drills without a stop condition."
  type        = string
  default     = null
}

variable "certificate_arn" {
  description = "ACM certificate for TLS on the load balancer listeners. Null keeps plain TCP (traffic stays inside the VPC or the allowed client ranges)."
  type        = string
  default     = null
}

variable "tls_secret_names" {
  description = "Secrets Manager secret names of the TLS bundles by role (coordinator, worker); a role not named gets <name>-tls-<role>."
  type        = map(string)
  default     = {}
}

variable "kv_mac_secret_name" {
  description = "Secrets Manager secret name of the cluster's KV MAC keyring; empty: <name>-kv-mac."
  type        = string
  default     = ""
}

variable "deletion_protection" {
  description = "Protect the load balancers from deletion. Turn on for production."
  type        = bool
  default     = false
}

variable "log_retention_days" {
  description = "Retention of the FIS drill logs."
  type        = number
  default     = 90
}
