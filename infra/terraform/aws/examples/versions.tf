terraform {
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
    random = {
      source  = "hashicorp/random"
      version = ">= 3.5"
    }
  }

  # Keep state remote and encrypted: it holds the Redis AUTH token. For example:
  # backend "s3" {
  #   bucket       = "my-terraform-state"
  #   key          = "spotinfer/terraform.tfstate"
  #   region       = "us-east-1"
  #   encrypt      = true
  #   use_lockfile = true
  # }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = {
      project = "spotinfer"
    }
  }
}
