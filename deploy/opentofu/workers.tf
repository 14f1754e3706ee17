# The dispatch workers: N instances on the private network, K offload-worker@ units each. No inbound port is
# open unless ssh_allowed_cidrs names who may SSH in.

resource "openstack_networking_secgroup_v2" "workers" {
  name        = "${var.name_prefix}-workers"
  description = "offload workers and server: SSH only from ssh_allowed_cidrs (none by default)"
}

resource "openstack_networking_secgroup_rule_v2" "workers_ssh" {
  for_each          = toset(var.ssh_allowed_cidrs)
  security_group_id = openstack_networking_secgroup_v2.workers.id
  description       = "SSH from ${each.value}"
  direction         = "ingress"
  ethertype         = length(regexall(":", each.value)) > 0 ? "IPv6" : "IPv4"
  protocol          = "tcp"
  port_range_min    = 22
  port_range_max    = 22
  remote_ip_prefix  = each.value
}

resource "openstack_networking_port_v2" "workers" {
  count              = var.worker_count
  name               = "${var.name_prefix}-worker-${count.index + 1}"
  network_id         = openstack_networking_network_v2.private.id
  admin_state_up     = true
  security_group_ids = [openstack_networking_secgroup_v2.workers.id]

  fixed_ip {
    subnet_id = openstack_networking_subnet_v2.private.id
  }
}

resource "openstack_compute_instance_v2" "workers" {
  count       = var.worker_count
  name        = "${var.name_prefix}-worker-${count.index + 1}"
  image_name  = var.image_name
  flavor_name = var.worker_flavor
  key_pair    = var.key_pair
  # SIGTERM first: workers stop claiming and hand their leases back (remote ids kept) within the unit's grace.
  stop_before_destroy = true

  user_data = templatefile("${path.module}/cloud-init/worker.yaml.tftpl", {
    env_file       = local.worker_env_file
    unit           = local.worker_unit
    config_yaml    = var.offload_config_yaml != null ? var.offload_config_yaml : ""
    pip_install    = local.pip_install
    metadata_guard = local.metadata_guard
    units          = [for i in range(1, var.worker_processes + 1) : "offload-worker@${i}.service"]
  })

  network {
    port = openstack_networking_port_v2.workers[count.index].id
  }

  depends_on = [
    openstack_networking_router_interface_v2.private,
    openstack_compute_instance_v2.cache,
  ]

  lifecycle {
    precondition {
      condition     = var.gpu_api_base != null || var.offload_config_yaml != null
      error_message = "Workers need a backend: set gpu_api_base (the tutorial's job API) or offload_config_yaml."
    }
  }
}

resource "openstack_networking_floatingip_v2" "workers" {
  count       = var.worker_floating_ips ? var.worker_count : 0
  pool        = var.external_network_name
  description = "${var.name_prefix}-worker-${count.index + 1}"
  port_id     = openstack_networking_port_v2.workers[count.index].id

  depends_on = [openstack_networking_router_interface_v2.private]
}
