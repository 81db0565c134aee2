variable "project" {
  description = "GCP project id."
  type        = string
}

variable "region" {
  description = "Region with L4 GPUs in several zones."
  type        = string
  default     = "us-central1"
}

variable "zones" {
  description = "Zones of the region that offer the worker GPU."
  type        = list(string)
  default     = ["us-central1-a", "us-central1-b", "us-central1-c"]
}

variable "name" {
  description = "Fleet name (2-20 lowercase characters)."
  type        = string
  default     = "spotinfer"
}

variable "source_image" {
  description = "GPU boot image; see docs/deploy.md for the lookup command."
  type        = string
}

variable "model" {
  description = "Model the workers serve."
  type        = string
  default     = "Qwen/Qwen2.5-7B-Instruct"
}

variable "spotinfer_package" {
  description = "pip requirement that installs spotinfer on the VMs."
  type        = string
  default     = "spotinfer[gpu]"
}

variable "client_source_ranges" {
  description = "Public client ranges that may reach the coordinator (never 0.0.0.0/0). Empty: no external IP."
  type        = list(string)
  default     = []
}

variable "worker_count" {
  description = "Initial number of workers."
  type        = number
  default     = 4
}

variable "fallback_max_count" {
  description = "Most on-demand fallback workers, launched only while spot capacity falls short. 0: no fallback group."
  type        = number
  default     = 0
}

variable "subnet_cidr" {
  description = "Primary range of the subnetwork this example creates."
  type        = string
  default     = "10.50.0.0/20"
}
