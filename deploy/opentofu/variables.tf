# Every input of the module. Secrets are `sensitive = true`; nothing opens a port to the internet by default.

# --- cloud and naming -----------------------------------------------------------------------------------------

variable "openstack_cloud" {
  type        = string
  description = "Entry of clouds.yaml to use. null: the provider's own lookup (OS_CLOUD or the OS_* variables)."
  default     = null
}

variable "name_prefix" {
  type        = string
  nullable    = false
  description = "Prefix of every resource name (network, security groups, instances, volume)."
  default     = "offload"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,23}$", var.name_prefix))
    error_message = "name_prefix must be 1-24 characters from a-z, 0-9 and '-', starting with a letter."
  }
}

variable "image_name" {
  type        = string
  nullable    = false
  description = "Glance image every instance boots (Ubuntu 24.04 or Debian 12/13: cloud-init, apt, systemd)."
  default     = "Ubuntu-24.04"

  validation {
    condition     = length(trimspace(var.image_name)) > 0
    error_message = "image_name must not be empty."
  }
}

variable "key_pair" {
  type        = string
  description = "Name of an existing Nova key pair for SSH as the image's default user. null: no key is installed."
  default     = null

  validation {
    condition     = var.key_pair == null || can(regex("^[^\\s]+$", var.key_pair))
    error_message = "key_pair must be a key pair name without whitespace, or null."
  }
}

variable "external_network_name" {
  type        = string
  nullable    = false
  description = "External (provider) network: the router's gateway and the pool floating IPs come from."
  default     = "PublicStatic"

  validation {
    condition     = length(trimspace(var.external_network_name)) > 0
    error_message = "external_network_name must not be empty."
  }
}

# --- network --------------------------------------------------------------------------------------------------

variable "subnet_cidr" {
  type        = string
  nullable    = false
  description = "IPv4 CIDR of the private subnet. The cache takes host .10, the server .11; DHCP hands out from host 32 on."
  default     = "10.20.0.0/24"

  validation {
    condition     = can(regex("^\\d{1,3}(\\.\\d{1,3}){3}/\\d{1,2}$", var.subnet_cidr)) && can(cidrhost(var.subnet_cidr, 0))
    error_message = "subnet_cidr must be an IPv4 CIDR such as 10.20.0.0/24."
  }
  validation {
    condition     = try(tonumber(split("/", var.subnet_cidr)[1]) >= 16 && tonumber(split("/", var.subnet_cidr)[1]) <= 24, false)
    error_message = "subnet_cidr must have a prefix length from /16 to /24 (room for fixed hosts and a DHCP pool)."
  }
  validation {
    condition     = try(cidrhost(var.subnet_cidr, 0) == split("/", var.subnet_cidr)[0], false)
    error_message = "subnet_cidr must be a network address (10.20.0.0/24, not 10.20.0.5/24)."
  }
}

variable "dns_nameservers" {
  type        = list(string)
  nullable    = false
  description = "DNS servers handed out on the subnet. Empty: the cloud's own resolver."
  default     = []

  validation {
    condition     = alltrue([for ip in var.dns_nameservers : can(regex("^\\d{1,3}(\\.\\d{1,3}){3}$", ip)) && can(cidrhost("${ip}/32", 0))])
    error_message = "dns_nameservers must be IPv4 addresses."
  }
}

variable "ssh_allowed_cidrs" {
  type        = list(string)
  nullable    = false
  description = "CIDRs allowed to SSH (tcp/22) to the workers and the server. Empty (the default): no SSH rule at all. The whole internet (/0) is refused: use your office or bastion range."
  default     = []

  validation {
    condition     = alltrue([for c in var.ssh_allowed_cidrs : can(cidrhost(c, 0)) && length(split("/", c)) == 2])
    error_message = "ssh_allowed_cidrs must be CIDRs such as 203.0.113.0/24."
  }
  validation {
    condition     = alltrue([for c in var.ssh_allowed_cidrs : !endswith(c, "/0")])
    error_message = "ssh_allowed_cidrs must not contain 0.0.0.0/0 or ::/0: SSH is never opened to the whole internet."
  }
}

# --- the cache (Valkey or Redis) ------------------------------------------------------------------------------

variable "cache_engine" {
  type        = string
  nullable    = false
  description = "redis (the redis-server package: Ubuntu 24.04, Debian 12) or valkey (valkey-server: Debian 13, Ubuntu 24.10+)."
  default     = "redis"

  validation {
    condition     = contains(["redis", "valkey"], var.cache_engine)
    error_message = "cache_engine must be \"redis\" or \"valkey\"."
  }
}

variable "cache_flavor" {
  type        = string
  nullable    = false
  description = "Nova flavor of the cache instance."
  default     = "s1a.small"
}

variable "cache_password" {
  type        = string
  description = "Password of the cache (requirepass). null: a random 40-character one is generated (see `tofu output -raw cache_password`)."
  default     = null
  sensitive   = true

  validation {
    condition     = var.cache_password == null || can(regex("^[A-Za-z0-9._~-]{24,128}$", var.cache_password))
    error_message = "cache_password must be 24-128 characters from A-Z a-z 0-9 . _ ~ - (it goes into a URL, an env file and redis.conf unquoted)."
  }
}

variable "cache_persistence_enabled" {
  type        = bool
  nullable    = false
  description = "Keep the cache's data (AOF) on a separate Cinder volume that survives replacing the instance."
  default     = true
}

variable "cache_volume_size_gb" {
  type        = number
  nullable    = false
  description = "Size of the persistence volume in GB."
  default     = 10

  validation {
    condition     = floor(var.cache_volume_size_gb) == var.cache_volume_size_gb && var.cache_volume_size_gb >= 1 && var.cache_volume_size_gb <= 2000
    error_message = "cache_volume_size_gb must be a whole number from 1 to 2000."
  }
}

variable "cache_volume_type" {
  type        = string
  description = "Cinder volume type of the persistence volume. null: the cloud's default."
  default     = null
}

variable "cache_appendfsync" {
  type        = string
  nullable    = false
  description = "AOF fsync policy: always (no acknowledged job is lost, offload's guarantee) or everysec (at most the last second)."
  default     = "always"

  validation {
    condition     = contains(["always", "everysec"], var.cache_appendfsync)
    error_message = "cache_appendfsync must be \"always\" or \"everysec\"."
  }
}

# --- offload on the instances ---------------------------------------------------------------------------------

variable "offload_pip_spec" {
  type        = string
  nullable    = false
  description = "What `pip install` installs on the instances: a pinned requirement from your index (offload==0.1.0), a wheel URL or a VCS URL (offload @ git+https://git.example.com/you/offload@v0.1.0)."

  validation {
    condition     = can(regex("^[^\"'\\\\$`\\r\\n]+$", var.offload_pip_spec)) && length(trimspace(var.offload_pip_spec)) > 0
    error_message = "offload_pip_spec must be a non-empty pip requirement without quotes, backslashes, '$', backticks or newlines."
  }
}

variable "pip_index_url" {
  type        = string
  description = "Package index pip uses on the instances (PIP_INDEX_URL). null: pip's default."
  default     = null

  validation {
    condition     = var.pip_index_url == null || can(regex("^https://[^\\s\"'\\\\$`]+$", var.pip_index_url))
    error_message = "pip_index_url must be an https:// URL."
  }
}

# --- the dispatch workers -------------------------------------------------------------------------------------

variable "worker_count" {
  type        = number
  nullable    = false
  description = "Number of worker instances. 0 keeps the network, cache and container only."
  default     = 2

  validation {
    condition     = floor(var.worker_count) == var.worker_count && var.worker_count >= 0 && var.worker_count <= 100
    error_message = "worker_count must be a whole number from 0 to 100."
  }
}

variable "worker_processes" {
  type        = number
  nullable    = false
  description = "offload-worker@1..K units per worker instance (each one asyncio process with many remote jobs in flight)."
  default     = 2

  validation {
    condition     = floor(var.worker_processes) == var.worker_processes && var.worker_processes >= 1 && var.worker_processes <= 32
    error_message = "worker_processes must be a whole number from 1 to 32."
  }
}

variable "worker_flavor" {
  type        = string
  nullable    = false
  description = "Nova flavor of the worker instances."
  default     = "s1a.small"
}

variable "worker_floating_ips" {
  type        = bool
  nullable    = false
  description = "Give every worker a floating IP (for SSH from ssh_allowed_cidrs). Outbound traffic goes through the router either way."
  default     = false
}

variable "queue_name" {
  type        = string
  nullable    = false
  description = "The offload queue the workers serve (OFFLOAD_QUEUE)."
  default     = "gpu"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$", var.queue_name))
    error_message = "queue_name must be 1-100 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit."
  }
}

variable "ingest_list" {
  type        = string
  description = "The tutorial's producer list (QUEUE_KEY) that workers move RPUSHed jobs in from. null: no ingest."
  default     = "gpu:jobs"

  validation {
    condition     = var.ingest_list == null || can(regex("^[^\\s\"'\\\\$`]{1,200}$", var.ingest_list))
    error_message = "ingest_list must be 1-200 characters without whitespace, quotes, backslashes, '$' or backticks."
  }
}

variable "gpu_api_base" {
  type        = string
  description = "Base URL of the tutorial-style job API (POST {base}/jobs, GET {base}/jobs/{id}): the http-job backend (OFFLOAD_API_BASE). null: backends come from offload_config_yaml."
  default     = null

  validation {
    condition     = var.gpu_api_base == null || can(regex("^https?://[^\\s\"'\\\\$`]+$", var.gpu_api_base))
    error_message = "gpu_api_base must be an http(s):// URL."
  }
}

variable "gpu_api_key" {
  type        = string
  description = "API key of gpu_api_base (OFFLOAD_API_KEY)."
  default     = null
  sensitive   = true

  validation {
    condition     = var.gpu_api_key == null || can(regex("^[^\"\\\\$`\\r\\n]+$", var.gpu_api_key))
    error_message = "gpu_api_key must not contain quotes, backslashes, '$', backticks or newlines."
  }
}

variable "max_attempts" {
  type        = number
  nullable    = false
  description = "Attempts per job before it is dead-lettered (OFFLOAD_MAX_ATTEMPTS), for the env-configured queue."
  default     = 3

  validation {
    condition     = floor(var.max_attempts) == var.max_attempts && var.max_attempts >= 1 && var.max_attempts <= 100
    error_message = "max_attempts must be a whole number from 1 to 100."
  }
}

variable "daily_job_cap" {
  type        = number
  description = "Jobs submitted per UTC day across all workers (OFFLOAD_DAILY_JOB_CAP); over it jobs are held. null: no cap."
  default     = 1000

  validation {
    condition     = var.daily_job_cap == null || try(floor(var.daily_job_cap) == var.daily_job_cap && var.daily_job_cap >= 0, false)
    error_message = "daily_job_cap must be a whole number >= 0, or null."
  }
}

variable "offload_config_yaml" {
  type        = string
  description = "Contents of /etc/offload/offload.yaml (OFFLOAD_CONFIG) for backends other than http-job; reference secrets as $${VAR} and pass them in worker_extra_env. null: configured from the environment only."
  default     = null
  sensitive   = true
}

variable "worker_extra_env" {
  type        = map(string)
  nullable    = false
  description = "Extra variables for /etc/offload/worker.env (mode 0600), e.g. RUNPOD_API_KEY for offload_config_yaml."
  default     = {}
  sensitive   = true

  validation {
    condition     = alltrue([for k in keys(var.worker_extra_env) : can(regex("^[A-Z_][A-Z0-9_]*$", k))])
    error_message = "worker_extra_env keys must be upper-case environment variable names."
  }
  validation {
    condition     = alltrue([for v in values(var.worker_extra_env) : can(regex("^[^\"\\\\$`\\r\\n]*$", v))])
    error_message = "worker_extra_env values must not contain quotes, backslashes, '$', backticks or newlines."
  }
}

# --- results (object storage) ---------------------------------------------------------------------------------

variable "result_container" {
  type        = string
  nullable    = false
  description = "Object storage container (S3 bucket) for results (OFFLOAD_RESULT_BUCKET)."
  default     = "gpu-results"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.result_container))
    error_message = "result_container must be a valid S3 bucket name: 3-63 characters from a-z 0-9 . -."
  }
}

variable "result_container_force_destroy" {
  type        = bool
  nullable    = false
  description = "Let `tofu destroy` delete the container with its results in it. false: destroy fails on a non-empty container."
  default     = false
}

variable "s3_endpoint" {
  type        = string
  nullable    = false
  description = "S3 endpoint of the cloud's object storage (OFFLOAD_S3_ENDPOINT), e.g. https://s3.region.example.com."

  validation {
    condition     = can(regex("^https://[^\\s\"'\\\\$`]+$", var.s3_endpoint))
    error_message = "s3_endpoint must be an https:// URL."
  }
}

variable "s3_access_key_id" {
  type        = string
  description = "S3 access key for the results. null (with s3_secret_access_key null): EC2-style credentials are created for the deploying user."
  default     = null
  sensitive   = true

  validation {
    condition     = var.s3_access_key_id == null || can(regex("^[A-Za-z0-9+/=._-]{8,256}$", var.s3_access_key_id))
    error_message = "s3_access_key_id must be 8-256 characters from A-Z a-z 0-9 + / = . _ -."
  }
}

variable "s3_secret_access_key" {
  type        = string
  description = "S3 secret key that goes with s3_access_key_id."
  default     = null
  sensitive   = true

  validation {
    condition     = var.s3_secret_access_key == null || can(regex("^[A-Za-z0-9+/=._-]{8,256}$", var.s3_secret_access_key))
    error_message = "s3_secret_access_key must be 8-256 characters from A-Z a-z 0-9 + / = . _ -."
  }
}

# --- the offload server (optional) ----------------------------------------------------------------------------

variable "server_enabled" {
  type        = bool
  nullable    = false
  description = "Also run the offload server (HTTP API, dashboard, /metrics, autoscaler) on its own instance."
  default     = false
}

variable "server_flavor" {
  type        = string
  nullable    = false
  description = "Nova flavor of the server instance."
  default     = "s1a.small"
}

variable "server_allowed_cidrs" {
  type        = list(string)
  nullable    = false
  description = "CIDRs besides the private subnet allowed to reach the server's API. The internet (0.0.0.0/0, for rented GPU workers) is accepted only together with server_domain (TLS)."
  default     = []

  validation {
    condition     = alltrue([for c in var.server_allowed_cidrs : can(cidrhost(c, 0)) && length(split("/", c)) == 2])
    error_message = "server_allowed_cidrs must be CIDRs such as 198.51.100.0/24."
  }
}

variable "server_domain" {
  type        = string
  description = "DNS name pointing at the server's floating IP. Set: Caddy terminates TLS (Let's Encrypt) on 443 and the API listens on 127.0.0.1:8000 only. null: plain HTTP on the private address, port 8000."
  default     = null

  validation {
    condition     = var.server_domain == null || can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+[a-z]{2,63}$", var.server_domain))
    error_message = "server_domain must be a lower-case DNS name such as offload.example.com."
  }
}

variable "server_floating_ip" {
  type        = bool
  nullable    = false
  description = "Give the server a floating IP (needed for server_domain and for GPU workers outside the cloud)."
  default     = false
}

variable "server_admin_key" {
  type        = string
  description = "The server's admin API key (OFFLOAD_ADMIN_KEY). null: a random 48-character one is generated (`tofu output -raw server_admin_key`)."
  default     = null
  sensitive   = true

  validation {
    condition     = var.server_admin_key == null || can(regex("^[A-Za-z0-9._~-]{32,256}$", var.server_admin_key))
    error_message = "server_admin_key must be 32-256 characters from A-Z a-z 0-9 . _ ~ -."
  }
}
