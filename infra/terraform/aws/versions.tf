terraform {
  # 1.5 for `check` blocks and the validation functions used in variables.tf.
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.x added aws_vpc_security_group_*_rule, NLB security groups and
      # elasticache transit_encryption_mode, all of which this module uses.
      version = ">= 5.40, < 7.0"
    }
    random = {
      source  = "hashicorp/random"
      version = ">= 3.5"
    }
  }
}
