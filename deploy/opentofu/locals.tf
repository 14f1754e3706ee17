locals {
  cache_ip  = cidrhost(var.subnet_cidr, 10)
  server_ip = cidrhost(var.subnet_cidr, 11)

  cache_password = var.cache_password != null ? var.cache_password : random_password.cache[0].result
  redis_url      = "redis://:${local.cache_password}@${local.cache_ip}:6379/0"

  # Paths and names of the two engines as Debian/Ubuntu package them.
  engines = {
    redis  = { package = "redis-server", service = "redis-server", conf = "/etc/redis/redis.conf", user = "redis", data_dir = "/var/lib/redis" }
    valkey = { package = "valkey-server", service = "valkey-server", conf = "/etc/valkey/valkey.conf", user = "valkey", data_dir = "/var/lib/valkey" }
  }
  engine = local.engines[var.cache_engine]

  create_s3_credentials = var.s3_access_key_id == null && var.s3_secret_access_key == null
  s3_access_key_id      = local.create_s3_credentials ? openstack_identity_ec2_credential_v3.results[0].access : var.s3_access_key_id
  s3_secret_access_key  = local.create_s3_credentials ? openstack_identity_ec2_credential_v3.results[0].secret : var.s3_secret_access_key

  server_admin_key = var.server_admin_key != null ? var.server_admin_key : one(random_password.server_admin_key[*].result)
  server_url = !var.server_enabled ? null : (
    var.server_domain != null ? "https://${var.server_domain}" : "http://${local.server_ip}:8000"
  )
  server_public = anytrue([for c in var.server_allowed_cidrs : endswith(c, "/0")])

  # The settings every offload process reads (OFFLOAD_* names; see offload/config.py). Values were validated to
  # hold no quotes, backslashes, '$', backticks or newlines, so double-quoting them is exact for systemd's
  # EnvironmentFile and for a shell's `set -a; . file`.
  common_env = merge(
    {
      OFFLOAD_REDIS_URL             = local.redis_url
      OFFLOAD_REDIS_CONNECT_TIMEOUT = "120"
      OFFLOAD_RESULT_BUCKET         = var.result_container
      OFFLOAD_S3_ENDPOINT           = var.s3_endpoint
      OFFLOAD_S3_ACCESS_KEY_ID      = local.s3_access_key_id
      OFFLOAD_S3_SECRET_ACCESS_KEY  = local.s3_secret_access_key
    },
    var.offload_config_yaml != null ? { OFFLOAD_CONFIG = "/etc/offload/offload.yaml" } : {},
  )
  worker_env = merge(
    local.common_env,
    { OFFLOAD_QUEUE = var.queue_name, OFFLOAD_MAX_ATTEMPTS = tostring(var.max_attempts) },
    var.ingest_list != null ? { OFFLOAD_QUEUE_KEY = var.ingest_list } : {},
    var.gpu_api_base != null ? { OFFLOAD_API_BASE = var.gpu_api_base } : {},
    var.gpu_api_key != null ? { OFFLOAD_API_KEY = var.gpu_api_key } : {},
    var.daily_job_cap != null ? { OFFLOAD_DAILY_JOB_CAP = tostring(var.daily_job_cap) } : {},
    var.worker_extra_env,
  )
  server_env = merge(
    local.common_env,
    { OFFLOAD_ADMIN_KEY = local.server_admin_key },
    var.worker_extra_env,
  )
  worker_env_file = templatefile("${path.module}/cloud-init/offload.env.tftpl", {
    env = { for k, v in local.worker_env : k => v if v != null }
  })

  # The systemd units shipped in deploy/systemd, installed verbatim.
  worker_unit = file("${path.module}/../systemd/offload-worker@.service")
  server_unit = file("${path.module}/../systemd/offload-server.service")

  # Only root may read the metadata service (user_data holds the secrets of the env file).
  metadata_guard = "command -v iptables >/dev/null 2>&1 || exit 0; iptables -w -C OUTPUT -d 169.254.169.254/32 -m owner ! --uid-owner 0 -j REJECT 2>/dev/null || iptables -w -I OUTPUT -d 169.254.169.254/32 -m owner ! --uid-owner 0 -j REJECT"

  pip_install = "${var.pip_index_url != null ? "PIP_INDEX_URL=${var.pip_index_url} " : ""}/opt/offload/venv/bin/pip install --no-cache-dir '${var.offload_pip_spec}'"
}

resource "random_password" "cache" {
  count   = var.cache_password == null ? 1 : 0
  length  = 40
  special = false
}

resource "random_password" "server_admin_key" {
  count   = var.server_enabled && var.server_admin_key == null ? 1 : 0
  length  = 48
  special = false
}
