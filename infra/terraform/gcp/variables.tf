# ---------------------------------------------------------------------------------------------
# Identity and network
# ---------------------------------------------------------------------------------------------

variable "project" {
  description = "GCP project id."
  type        = string
}

variable "name" {
  description = "Fleet name. Prefixes every resource and is the value of the `spotinfer-fleet` label the fleet adapter lists instances by."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,19}$", var.name))
    error_message = "name must be 2-20 characters of lowercase letters, digits and '-', starting with a letter."
  }
}

variable "region" {
  description = "Region of the fleet and of Memorystore."
  type        = string
}

variable "zones" {
  description = "Zones the regional instance group may place workers in. Spot capacity differs per zone: list every zone of the region that has your GPU type."
  type        = list(string)

  validation {
    condition     = length(var.zones) >= 2
    error_message = "List at least two zones: one zone's spot capacity is reclaimed together."
  }
}

variable "network" {
  description = "Self link or id of the VPC network (Memorystore peers with it)."
  type        = string
}

variable "subnetwork" {
  description = "Self link or id of the subnetwork for the VMs. Needs Private Google Access or Cloud NAT: the VMs have no public IP."
  type        = string
}

variable "internal_client_ranges" {
  description = "CIDR ranges inside the VPC (or peered/VPN) allowed to call the coordinator, besides the workers."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for cidr in var.internal_client_ranges : !contains(["0.0.0.0/0", "::/0"], cidr)])
    error_message = "internal_client_ranges must not contain 0.0.0.0/0 or ::/0."
  }
}

variable "client_source_ranges" {
  description = "Public client ranges allowed to reach the coordinator on its external IP. Empty (the default) gives the coordinator no external IP."
  type        = list(string)
  default     = []

  validation {
    # The coordinator speaks plain gRPC with no authentication of its own.
    condition     = alltrue([for cidr in var.client_source_ranges : !contains(["0.0.0.0/0", "::/0"], cidr)])
    error_message = "client_source_ranges must not contain 0.0.0.0/0 or ::/0; list the clients' own ranges."
  }
}

variable "enable_iap_ssh" {
  description = "Allow SSH through Identity-Aware Proxy (35.235.240.0/20) for `gcloud compute ssh --tunnel-through-iap`."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Extra labels for every resource."
  type        = map(string)
  default     = {}
}

# ---------------------------------------------------------------------------------------------
# What the VMs run
# ---------------------------------------------------------------------------------------------

variable "source_image" {
  description = "Boot image for the workers: NVIDIA driver and Python >= 3.10, e.g. a Deep Learning VM image family from project deeplearning-platform-release (docs/deploy.md shows how to list them)."
  type        = string
}

variable "coordinator_image" {
  description = "Boot image for the coordinator (needs no GPU). Null reuses source_image."
  type        = string
  default     = null
}

variable "spotinfer_package" {
  description = "pip requirement that installs spotinfer on the VMs."
  type        = string
  default     = "spotinfer[gpu]"
}

variable "pip_args" {
  description = "Extra pip arguments for that install."
  type        = string
  default     = ""
}

variable "model" {
  description = "Model every worker serves, passed to `spotinfer worker --model`."
  type        = string
}

variable "worker_port" {
  description = "Port of the Worker gRPC service."
  type        = number
  default     = 50061
}

variable "daemon_peer_port" {
  description = "Port of the context daemon's peer migration server. Must match the daemon's setting."
  type        = number
  default     = 50071
}

variable "coordinator_grpc_port" {
  description = "Port of the coordinator's gRPC services."
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

variable "worker_machine_type" {
  description = "Machine type of the workers. g2-standard-8 has one NVIDIA L4 (24 GiB) and 32 GiB of RAM, enough for an 8B model in bf16."
  type        = string
  default     = "g2-standard-8"
}

variable "worker_accelerator" {
  description = "GPU to attach for machine types without a built-in one (n1-*), e.g. { type = \"nvidia-tesla-t4\", count = 1 }. Null for a2/a3/g2, whose GPUs come with the machine type."
  type = object({
    type  = string
    count = number
  })
  default = null
}

variable "worker_count" {
  description = "Initial number of workers. Terraform sets it once; afterwards `spotinfer fleet scale` owns it."
  type        = number
  default     = 4
}

variable "fallback_max_count" {
  description = "Most on-demand fallback workers: a second managed instance group of STANDARD VMs, empty until `spotinfer fleet fallback` (or the fleet adapter) sizes it while spot capacity falls short. 0 (the default) creates no group."
  type        = number
  default     = 0

  validation {
    condition     = var.fallback_max_count >= 0 && floor(var.fallback_max_count) == var.fallback_max_count
    error_message = "fallback_max_count must be a whole number, 0 or more."
  }
}

variable "distribution_shape" {
  description = "How the regional group spreads workers over var.zones: ANY places each VM in whichever zone has spot capacity now (fewest failed creations and preemptions); BALANCED and EVEN keep zones level, which stalls when one zone runs dry; ANY_SINGLE_ZONE keeps all workers in one zone (lowest latency between them)."
  type        = string
  default     = "ANY"

  validation {
    condition     = contains(["ANY", "ANY_SINGLE_ZONE", "BALANCED", "EVEN"], var.distribution_shape)
    error_message = "distribution_shape must be ANY, ANY_SINGLE_ZONE, BALANCED or EVEN."
  }
}

variable "boot_disk_gb" {
  description = "Boot disk size: OS, virtualenv and model weights."
  type        = number
  default     = 200
}

variable "termination_action" {
  description = "What GCE does to a preempted worker: DELETE (the group recreates it wherever capacity exists; nothing is billed meanwhile) or STOP (the disk with its cached weights is kept and billed, and the group restarts the VM when capacity returns)."
  type        = string
  default     = "DELETE"

  validation {
    condition     = contains(["DELETE", "STOP"], var.termination_action)
    error_message = "termination_action must be DELETE or STOP."
  }
}

variable "preemption_notice_seconds" {
  description = "Preemption notice the metadata server gives before the VM is shut down (Spot only; the default 30 s notice applies when 0). Longer notice lets the daemon move more KV cache; up to 120 s."
  type        = number
  default     = 120

  validation {
    condition     = var.preemption_notice_seconds >= 0 && var.preemption_notice_seconds <= 120
    error_message = "preemption_notice_seconds must be between 0 and 120."
  }
}

variable "secure_boot" {
  description = "Shielded VM secure boot. Off by default: it refuses to load NVIDIA kernel modules that are not signed with a key the VM trusts, which most driver installs are not."
  type        = bool
  default     = false
}

variable "coordinator_machine_type" {
  description = "Machine type of the coordinator (on-demand, CPU only)."
  type        = string
  default     = "e2-standard-2"
}

# ---------------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------------

variable "redis_memory_gb" {
  description = "Memorystore capacity. Size it for the KV cache of all in-flight requests (Llama-3-8B: 128 KiB per token)."
  type        = number
  default     = 16
}

variable "redis_version" {
  description = "Memorystore Redis version."
  type        = string
  default     = "REDIS_7_2"
}

variable "tls_secret_names" {
  description = "Secret Manager secret ids of the TLS bundles by role (coordinator, worker); a role not named gets <name>-tls-<role>."
  type        = map(string)
  default     = {}
}

variable "kv_mac_secret_name" {
  description = "Secret Manager secret id of the cluster's KV MAC keyring; empty: <name>-kv-mac."
  type        = string
  default     = ""
}
