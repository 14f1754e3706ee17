# The optional offload server: HTTP API on 8000 for the subnet and server_allowed_cidrs; with server_domain, Caddy
# serves it over TLS on 443 (80 for the ACME challenge and the redirect) and 8000 stays on loopback.

resource "openstack_networking_secgroup_v2" "server" {
  count       = var.server_enabled ? 1 : 0
  name        = "${var.name_prefix}-server"
  description = "offload server API: the private subnet and server_allowed_cidrs only"
}

locals {
  # (port, source) pairs the server admits; SSH comes from the workers' group.
  server_rules = !var.server_enabled ? {} : merge(
    var.server_domain == null ? { "8000-subnet" = { port = 8000, cidr = var.subnet_cidr } } : {},
    { for c in var.server_allowed_cidrs : "8000-${c}" => { port = 8000, cidr = c } if var.server_domain == null },
    { for c in var.server_allowed_cidrs : "443-${c}" => { port = 443, cidr = c } if var.server_domain != null },
    { for c in var.server_allowed_cidrs : "80-${c}" => { port = 80, cidr = c } if var.server_domain != null },
  )
}

resource "openstack_networking_secgroup_rule_v2" "server" {
  for_each          = local.server_rules
  security_group_id = openstack_networking_secgroup_v2.server[0].id
  description       = "offload server port ${each.value.port} from ${each.value.cidr}"
  direction         = "ingress"
  ethertype         = length(regexall(":", each.value.cidr)) > 0 ? "IPv6" : "IPv4"
  protocol          = "tcp"
  port_range_min    = each.value.port
  port_range_max    = each.value.port
  remote_ip_prefix  = each.value.cidr

  lifecycle {
    precondition {
      condition     = !local.server_public || var.server_domain != null
      error_message = "server_allowed_cidrs opens the API to the whole internet: set server_domain so it is served over TLS."
    }
  }
}

resource "openstack_networking_port_v2" "server" {
  count          = var.server_enabled ? 1 : 0
  name           = "${var.name_prefix}-server"
  network_id     = openstack_networking_network_v2.private.id
  admin_state_up = true
  security_group_ids = [
    openstack_networking_secgroup_v2.server[0].id,
    openstack_networking_secgroup_v2.workers.id,
  ]

  fixed_ip {
    subnet_id  = openstack_networking_subnet_v2.private.id
    ip_address = local.server_ip
  }
}

resource "openstack_compute_instance_v2" "server" {
  count               = var.server_enabled ? 1 : 0
  name                = "${var.name_prefix}-server"
  image_name          = var.image_name
  flavor_name         = var.server_flavor
  key_pair            = var.key_pair
  stop_before_destroy = true

  user_data = templatefile("${path.module}/cloud-init/server.yaml.tftpl", {
    env_file = templatefile("${path.module}/cloud-init/offload.env.tftpl", {
      env = { for k, v in merge(local.server_env, {
        OFFLOAD_SERVER_HOST = var.server_domain != null ? "127.0.0.1" : local.server_ip
        OFFLOAD_PUBLIC_URL  = local.server_url
        # Caddy on the same host: its X-Forwarded-For names each client (else all share Caddy's address)
        OFFLOAD_TRUSTED_PROXIES = var.server_domain != null ? "127.0.0.1,::1" : null
      }) : k => v if v != null }
    })
    unit           = local.server_unit
    config_yaml    = var.offload_config_yaml != null ? var.offload_config_yaml : ""
    pip_install    = local.pip_install
    metadata_guard = local.metadata_guard
    domain         = var.server_domain != null ? var.server_domain : ""
  })

  network {
    port = openstack_networking_port_v2.server[0].id
  }

  depends_on = [
    openstack_networking_router_interface_v2.private,
    openstack_compute_instance_v2.cache,
  ]

  lifecycle {
    precondition {
      condition     = var.server_domain == null || var.server_floating_ip
      error_message = "server_domain needs server_floating_ip = true (the name must point at a reachable address)."
    }
  }
}

resource "openstack_networking_floatingip_v2" "server" {
  count       = var.server_enabled && var.server_floating_ip ? 1 : 0
  pool        = var.external_network_name
  description = "${var.name_prefix}-server"
  port_id     = openstack_networking_port_v2.server[0].id

  depends_on = [openstack_networking_router_interface_v2.private]
}
