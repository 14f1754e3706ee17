# The private network everything lives on: nothing but floating IPs (opt-in) is reachable from outside.

data "openstack_networking_network_v2" "external" {
  name     = var.external_network_name
  external = true
}

resource "openstack_networking_network_v2" "private" {
  name           = "${var.name_prefix}-net"
  admin_state_up = true
}

resource "openstack_networking_subnet_v2" "private" {
  name            = "${var.name_prefix}-subnet"
  network_id      = openstack_networking_network_v2.private.id
  cidr            = var.subnet_cidr
  ip_version      = 4
  dns_nameservers = var.dns_nameservers

  # Fixed addresses (cache .10, server .11) sit below the DHCP pool, so no port created in parallel takes them.
  allocation_pool {
    start = cidrhost(var.subnet_cidr, 32)
    end   = cidrhost(var.subnet_cidr, -2)
  }
}

resource "openstack_networking_router_v2" "private" {
  name                = "${var.name_prefix}-router"
  admin_state_up      = true
  external_network_id = data.openstack_networking_network_v2.external.id
}

resource "openstack_networking_router_interface_v2" "private" {
  router_id = openstack_networking_router_v2.private.id
  subnet_id = openstack_networking_subnet_v2.private.id
}
