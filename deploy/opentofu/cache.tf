# The queue: one Valkey/Redis instance with a fixed private address, reachable on 6379 from the subnet only.

resource "openstack_networking_secgroup_v2" "cache" {
  name        = "${var.name_prefix}-cache"
  description = "offload cache: ${var.cache_engine} on 6379 from the private subnet only"
}

resource "openstack_networking_secgroup_rule_v2" "cache_from_subnet" {
  security_group_id = openstack_networking_secgroup_v2.cache.id
  description       = "${var.cache_engine} from the private subnet"
  direction         = "ingress"
  ethertype         = "IPv4"
  protocol          = "tcp"
  port_range_min    = 6379
  port_range_max    = 6379
  remote_ip_prefix  = var.subnet_cidr
}

resource "openstack_networking_port_v2" "cache" {
  name               = "${var.name_prefix}-cache"
  network_id         = openstack_networking_network_v2.private.id
  admin_state_up     = true
  security_group_ids = [openstack_networking_secgroup_v2.cache.id]

  fixed_ip {
    subnet_id  = openstack_networking_subnet_v2.private.id
    ip_address = local.cache_ip
  }
}

resource "openstack_blockstorage_volume_v3" "cache" {
  count       = var.cache_persistence_enabled ? 1 : 0
  name        = "${var.name_prefix}-cache-data"
  description = "offload cache data (AOF); survives replacing the cache instance"
  size        = var.cache_volume_size_gb
  volume_type = var.cache_volume_type
}

resource "openstack_compute_instance_v2" "cache" {
  name        = "${var.name_prefix}-cache"
  image_name  = var.image_name
  flavor_name = var.cache_flavor
  key_pair    = var.key_pair
  # Shut the engine down cleanly (AOF flushed) before the instance goes.
  stop_before_destroy = true

  user_data = templatefile("${path.module}/cloud-init/cache.yaml.tftpl", {
    engine        = var.cache_engine
    package       = local.engine.package
    service       = local.engine.service
    user          = local.engine.user
    main_conf     = local.engine.conf
    override_conf = "${dirname(local.engine.conf)}/offload.conf"
    data_dir      = local.engine.data_dir
    bind_ip       = local.cache_ip
    password      = local.cache_password
    appendfsync   = var.cache_appendfsync
    volume_id     = var.cache_persistence_enabled ? openstack_blockstorage_volume_v3.cache[0].id : ""
    volume_script = file("${path.module}/cloud-init/cache-volume.sh")
  })

  network {
    port = openstack_networking_port_v2.cache.id
  }

  depends_on = [openstack_networking_router_interface_v2.private]
}

resource "openstack_compute_volume_attach_v2" "cache" {
  count       = var.cache_persistence_enabled ? 1 : 0
  instance_id = openstack_compute_instance_v2.cache.id
  volume_id   = openstack_blockstorage_volume_v3.cache[0].id
}
