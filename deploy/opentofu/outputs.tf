output "cache_private_ip" {
  description = "Private address of the cache (the tutorial's CACHE_PRIVATE_IP)."
  value       = local.cache_ip
}

output "network_name" {
  description = "The private network every instance is on; attach more instances to it."
  value       = openstack_networking_network_v2.private.name
}

output "subnet_cidr" {
  description = "The private subnet's CIDR (the only source the cache admits)."
  value       = openstack_networking_subnet_v2.private.cidr
}

output "redis_url" {
  description = "OFFLOAD_REDIS_URL for hosts on the private network."
  value       = local.redis_url
  sensitive   = true
}

output "cache_password" {
  description = "The cache password (generated unless cache_password was set)."
  value       = local.cache_password
  sensitive   = true
}

output "worker_private_ips" {
  description = "Private address of each worker instance."
  value       = [for p in openstack_networking_port_v2.workers : p.all_fixed_ips[0]]
}

output "worker_floating_ips" {
  description = "Floating IP of each worker (empty unless worker_floating_ips)."
  value       = openstack_networking_floatingip_v2.workers[*].address
}

output "worker_units" {
  description = "The systemd units running on every worker."
  value       = [for i in range(1, var.worker_processes + 1) : "offload-worker@${i}.service"]
}

output "server_url" {
  description = "Base URL of the offload server's API (null unless server_enabled)."
  value       = local.server_url
}

output "server_floating_ip" {
  description = "The server's floating IP (null unless server_enabled and server_floating_ip): point server_domain here."
  value       = one(openstack_networking_floatingip_v2.server[*].address)
}

output "server_admin_key" {
  description = "The server's admin API key (OFFLOAD_ADMIN_KEY)."
  value       = var.server_enabled ? local.server_admin_key : null
  sensitive   = true
}

output "result_container" {
  description = "The results container (S3 bucket)."
  value       = openstack_objectstorage_container_v1.results.name
}

output "s3_endpoint" {
  description = "S3 endpoint for the aws CLI (--endpoint-url)."
  value       = var.s3_endpoint
}

output "s3_access_key_id" {
  description = "S3 access key the workers use."
  value       = local.s3_access_key_id
  sensitive   = true
}

output "s3_secret_access_key" {
  description = "S3 secret key the workers use."
  value       = local.s3_secret_access_key
  sensitive   = true
}
