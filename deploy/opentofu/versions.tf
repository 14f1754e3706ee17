# offload on an OpenStack cloud: one `tofu apply` stands up the private network, the Valkey/Redis queue, the
# dispatch workers, the result container and (optionally) the offload server. See docs/deploy.md.

terraform {
  # OpenTofu >= 1.6 (Terraform >= 1.5 reads it too). Keep state encrypted (OpenTofu's `encryption` block or
  # TF_ENCRYPTION) or in a private backend: it holds the cache password and the S3 credentials.
  required_version = ">= 1.6.0"

  required_providers {
    openstack = {
      source  = "terraform-provider-openstack/openstack"
      version = ">= 2.1.0, < 4.0.0"
    }
    random = {
      source  = "hashicorp/random"
      version = "~> 3.6"
    }
  }
}

# Credentials come from clouds.yaml (OS_CLOUD or var.openstack_cloud) or the usual OS_* variables, never from
# this module's variables.
provider "openstack" {
  cloud = var.openstack_cloud
}
