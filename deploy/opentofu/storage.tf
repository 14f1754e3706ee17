# Where results land: one private container, read and written through the cloud's S3 API.

resource "openstack_objectstorage_container_v1" "results" {
  name          = var.result_container
  force_destroy = var.result_container_force_destroy
  # No container_read / container_write ACLs: the container stays private to the project.

  lifecycle {
    precondition {
      condition     = (var.s3_access_key_id == null) == (var.s3_secret_access_key == null)
      error_message = "s3_access_key_id and s3_secret_access_key must be set together (or both left null)."
    }
  }
}

# S3 credentials for the workers, unless the caller brings a pair. They act as the deploying user in this
# project; bring a dedicated user's pair (s3_access_key_id / s3_secret_access_key) for a narrower scope.
resource "openstack_identity_ec2_credential_v3" "results" {
  count = local.create_s3_credentials ? 1 : 0
}
