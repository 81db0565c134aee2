variable "region" {
  description = "AWS region. Pick one with several GPU instance families in several zones (us-east-1, us-west-2, eu-west-1 ...)."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Fleet name (2-16 lowercase characters)."
  type        = string
  default     = "spotinfer"
}

variable "ami_id" {
  description = "GPU AMI for the workers; see docs/deploy.md for the lookup command."
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

variable "client_cidrs" {
  description = "Client ranges outside the VPC that may reach the coordinator (never 0.0.0.0/0). Empty: VPC only."
  type        = list(string)
  default     = []
}

variable "worker_desired_count" {
  description = "Initial number of workers."
  type        = number
  default     = 4
}

variable "on_demand_base_count" {
  description = "On-demand workers (standbys that are never interrupted)."
  type        = number
  default     = 0
}

variable "fallback_max_count" {
  description = "Most on-demand fallback workers, launched only while spot capacity falls short. 0: no fallback group."
  type        = number
  default     = 0
}

variable "vpc_cidr" {
  description = "CIDR block of the VPC this example creates."
  type        = string
  default     = "10.40.0.0/16"
}

variable "zone_count" {
  description = "Availability zones to spread over (spot capacity differs per zone)."
  type        = number
  default     = 3
}
