terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.0, < 8.0"
    }
    google-beta = {
      source  = "hashicorp/google-beta"
      version = ">= 6.0, < 8.0"
    }
  }

  # Keep state remote: it holds the Memorystore AUTH string. For example:
  # backend "gcs" {
  #   bucket = "my-terraform-state"
  #   prefix = "spotinfer"
  # }
}

provider "google" {
  project = var.project
  region  = var.region
}

provider "google-beta" {
  project = var.project
  region  = var.region
}
