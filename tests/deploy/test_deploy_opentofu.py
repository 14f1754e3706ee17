"""The OpenTofu module in deploy/opentofu: it parses, its variables are typed, described, validated and safe by
default, no security group opens the cache or SSH to the world, checkov finds nothing it does not waive with a
reason, and the cloud-init files render (as templatefile() would) into valid cloud-config.

OpenTofu itself is not installable here (not on PyPI, Debian or npm) and `tofu/terraform validate` needs the
OpenStack provider from a registry this machine cannot reach. Where a `terraform` binary exists, the tests that
need no provider use it for real: `fmt -check`, the variable validation rules (a plan of variables.tf alone) and
templatefile() itself. checkov and cloud-init's schema checker come from `.venv-checkov` (`make deploy-tools`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml
from support.tftemplate import TemplateError, referenced_names, render, templatefile

from offload.queue.keyspace import QUEUE_NAME_RE

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "deploy" / "opentofu"
CLOUD_INIT = MODULE / "cloud-init"
TOOLS = ROOT / ".venv-checkov"
TERRAFORM = shutil.which("tofu") or shutil.which("terraform")
needs_terraform = pytest.mark.skipif(TERRAFORM is None, reason="neither tofu nor terraform is on PATH")

SENSITIVE = {
    "cache_password",
    "gpu_api_key",
    "offload_config_yaml",
    "worker_extra_env",
    "s3_access_key_id",
    "s3_secret_access_key",
    "server_admin_key",
}
REQUIRED = {"offload_pip_spec", "s3_endpoint"}
# every waiver checkov may report, with the file it must sit in; a new one needs a reason here and in the code
WAIVERS = {"CKV_DOCKER_2": "deploy/image/Dockerfile", "CKV_DOCKER_7": "deploy/image/Dockerfile"}


def _parse(path: Path) -> dict[str, Any]:
    options = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)
    with path.open() as f:
        return hcl2.load(f, serialization_options=options)


def _blocks(kind: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for tf in sorted(MODULE.glob("*.tf")):
        out.extend(_parse(tf).get(kind, []))
    return out


def _variables() -> dict[str, dict[str, Any]]:
    return {name: body for block in _blocks("variable") for name, body in block.items()}


def _resources(rtype: str) -> dict[str, dict[str, Any]]:
    return {
        name: body
        for block in _blocks("resource")
        for t, named in block.items()
        if t == rtype
        for name, body in named.items()
    }


def _unwrap(expr: str) -> str:
    m = re.fullmatch(r"\$\{(.*)\}", expr.strip(), re.S)
    return m.group(1).strip() if m else expr


# --- the module parses, and its variables are what the docs promise ---------------------------------------------


def test_every_tf_file_parses() -> None:
    files = sorted(p.name for p in MODULE.glob("*.tf"))
    assert files == [
        "cache.tf",
        "locals.tf",
        "network.tf",
        "outputs.tf",
        "server.tf",
        "storage.tf",
        "variables.tf",
        "versions.tf",
        "workers.tf",
    ]
    for tf in MODULE.glob("*.tf"):
        assert _parse(tf), tf
    example = _parse(MODULE / "terraform.tfvars.example")
    unknown = set(example) - set(_variables())
    assert not unknown, f"terraform.tfvars.example sets variables the module does not have: {unknown}"
    assert set(example) >= REQUIRED, "the example must set every required variable"


def test_every_variable_is_typed_described_and_secrets_are_sensitive() -> None:
    variables = _variables()
    assert len(variables) >= 35
    for name, body in variables.items():
        assert body.get("type"), f"{name} has no type"
        assert len(body.get("description", "")) > 20, f"{name} has no real description"
    sensitive = {name for name, body in variables.items() if body.get("sensitive") is True}
    assert sensitive == SENSITIVE
    looks_secret = {n for n in variables if re.search(r"password|secret|_key$|token", n)}
    assert looks_secret <= sensitive, looks_secret - sensitive
    required = {name for name, body in variables.items() if "default" not in body}
    assert required == REQUIRED


def test_defaults_are_the_tutorials_and_safe() -> None:
    v: dict[str, Any] = {name: body.get("default") for name, body in _variables().items()}
    assert v["subnet_cidr"] == "10.20.0.0/24"
    assert v["ssh_allowed_cidrs"] == []  # no SSH rule at all unless asked for
    assert v["server_allowed_cidrs"] == []  # the API stays on the private network
    assert v["worker_floating_ips"] is False and v["server_floating_ip"] is False
    assert v["server_enabled"] is False and v["server_domain"] is None
    assert v["cache_persistence_enabled"] is True  # queued jobs survive a cache restart (the tutorial's advice)
    assert v["cache_appendfsync"] == "always"  # offload's zero-loss guarantee
    assert v["cache_password"] is None and v["server_admin_key"] is None  # generated, never a default secret
    assert v["result_container"] == "gpu-results" and v["result_container_force_destroy"] is False
    assert v["ingest_list"] == "gpu:jobs" and v["queue_name"] == "gpu"
    assert (v["max_attempts"], v["daily_job_cap"]) == (3, 1000)
    assert v["image_name"] == "Ubuntu-24.04" and v["cache_engine"] == "redis"
    assert v["worker_count"] >= 1 and v["worker_processes"] >= 1


def test_validation_rules_exist_and_match_offload() -> None:
    variables = _variables()
    validated = {name for name, body in variables.items() if body.get("validation")}
    must = {
        "name_prefix",
        "subnet_cidr",
        "ssh_allowed_cidrs",
        "cache_engine",
        "cache_password",
        "cache_volume_size_gb",
        "cache_appendfsync",
        "offload_pip_spec",
        "worker_count",
        "worker_processes",
        "queue_name",
        "ingest_list",
        "gpu_api_base",
        "gpu_api_key",
        "max_attempts",
        "daily_job_cap",
        "worker_extra_env",
        "result_container",
        "s3_endpoint",
        "s3_access_key_id",
        "s3_secret_access_key",
        "server_allowed_cidrs",
        "server_domain",
        "server_admin_key",
        "pip_index_url",
        "dns_nameservers",
    }
    assert must <= validated, must - validated
    for name in validated:
        for rule in variables[name]["validation"]:
            assert rule["condition"] and len(rule["error_message"]) > 15, name
    # the queue-name rule is offload's own
    cond = variables["queue_name"]["validation"][0]["condition"]
    pattern = re.search(r'regex\("(.+?)", var\.queue_name\)', cond)
    assert pattern is not None
    assert pattern.group(1) == QUEUE_NAME_RE.pattern
    assert any("/0" in r["condition"] for r in variables["ssh_allowed_cidrs"]["validation"])


# --- nothing open to the world ------------------------------------------------------------------------------------


def test_no_security_group_opens_the_cache_or_ssh_to_the_world() -> None:
    rules = _resources("openstack_networking_secgroup_rule_v2")
    assert set(rules) == {"cache_from_subnet", "workers_ssh", "server"}
    variables = _variables()
    for name, rule in rules.items():
        assert rule["direction"] == "ingress"
        # OpenStack reads a rule without a remote prefix or group as "from anywhere"
        assert rule.get("remote_ip_prefix") or rule.get("remote_group_id"), name
        assert "0.0.0.0/0" not in json.dumps(rule) and "::/0" not in json.dumps(rule), name
    cache = rules["cache_from_subnet"]
    assert (cache["port_range_min"], cache["port_range_max"]) == (6379, 6379)
    assert _unwrap(cache["remote_ip_prefix"]) == "var.subnet_cidr"
    ssh = rules["workers_ssh"]
    assert (ssh["port_range_min"], ssh["port_range_max"]) == (22, 22)
    assert _unwrap(ssh["for_each"]) == "toset(var.ssh_allowed_cidrs)"
    assert _unwrap(ssh["remote_ip_prefix"]) == "each.value"
    assert variables["ssh_allowed_cidrs"]["default"] == []
    # the server's rules come from the subnet and server_allowed_cidrs only, and the internet needs TLS
    server = rules["server"]
    assert _unwrap(server["for_each"]) == "local.server_rules"
    preconditions = server["lifecycle"][0]["precondition"]
    assert any("server_domain" in p["condition"] and "server_public" in p["condition"] for p in preconditions)
    locals_src = (MODULE / "server.tf").read_text()
    assert "var.server_allowed_cidrs" in locals_src and "var.subnet_cidr" in locals_src
    # every port carries explicit security groups; nothing relies on the project's "default" group
    for name, port in _resources("openstack_networking_port_v2").items():
        assert port.get("security_group_ids"), name
    for name, inst in _resources("openstack_compute_instance_v2").items():
        assert "security_groups" not in inst, f"{name}: groups belong on its port"
        assert "port" in json.dumps(inst["network"]), name
    # the cache has no floating IP at all
    assert set(_resources("openstack_networking_floatingip_v2")) == {"workers", "server"}


# --- checkov ------------------------------------------------------------------------------------------------------


def _checkov(target: Path, *frameworks: str) -> list[dict[str, Any]]:
    checkov = TOOLS / "bin" / "checkov"
    if not checkov.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{checkov} is missing: `make test` builds it (make deploy-tools)")
        pytest.skip(f"{checkov} is missing: run `make deploy-tools`")
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false", "LOG_LEVEL": "ERROR"}
    out = subprocess.run(
        [str(checkov), "-d", str(target), "--framework", *frameworks, "--skip-download", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=target,
    )
    assert out.returncode in (0, 1), out.stderr[-3000:]
    doc = json.loads(out.stdout) if out.stdout.strip() else []
    reports = doc if isinstance(doc, list) else [doc]
    return [r for r in reports if "results" in r]


def test_checkov_passes_with_every_waiver_reasoned() -> None:
    started = time.monotonic()
    reports = _checkov(ROOT / "deploy", "terraform", "dockerfile", "secrets")
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"checkov took {elapsed:.0f} s"
    by_type = {r["check_type"]: r for r in reports}
    assert {"terraform", "dockerfile"} <= set(by_type)
    failed = [(c["check_id"], c["resource"], c["file_path"]) for r in reports for c in r["results"]["failed_checks"]]
    assert failed == []
    for r in reports:
        assert r["summary"]["parsing_errors"] == 0, r["check_type"]
    # the rules that matter here did run, and passed, on the resources they guard
    passed = {(c["check_id"], c["resource"].split("[")[0]) for c in by_type["terraform"]["results"]["passed_checks"]}
    for resource in (
        "openstack_networking_secgroup_rule_v2.cache_from_subnet",
        "openstack_networking_secgroup_rule_v2.workers_ssh",
    ):
        assert ("CKV_OPENSTACK_2", resource) in passed  # no SSH from 0.0.0.0/0
    assert ("CKV_OPENSTACK_4", "openstack_compute_instance_v2.cache") in passed  # no admin password on instances
    docker_passed = {c["check_id"] for c in by_type["dockerfile"]["results"]["passed_checks"]}
    assert {"CKV_DOCKER_3", "CKV_DOCKER_8"} <= docker_passed  # a user is created; the last USER is not root
    # every skip is one of the known waivers, in its file, with a reason written next to it
    for r in reports:
        for c in r["results"]["skipped_checks"]:
            assert c["check_id"] in WAIVERS, c["check_id"]
            source = (ROOT / WAIVERS[c["check_id"]]).read_text()
            m = re.search(rf"#\s*checkov:skip={c['check_id']}:(.+)", source)
            assert m and len(m.group(1).strip()) > 30, f"{c['check_id']} is waived without a reason"


def test_checkov_would_catch_ssh_open_to_the_world_and_a_baked_in_key(tmp_path: Path) -> None:
    """The scan is live: the same module with SSH defaulting to the internet, and a key in a file, fail it."""
    copy = tmp_path / "opentofu"
    shutil.copytree(MODULE, copy, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    variables = (copy / "variables.tf").read_text()
    marker = "CIDRs allowed to SSH"
    head, tail = variables.split(marker, 1)
    tail = tail.replace("default     = []", 'default     = ["0.0.0.0/0"]', 1)
    (copy / "variables.tf").write_text(head + marker + tail)
    (copy / "leak.tf").write_text('locals {\n  leaked = "AKIAIOSFODNN7EXAMPLE"\n}\n')
    reports = _checkov(copy, "terraform", "secrets")
    failed = {(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]}
    assert ("CKV_OPENSTACK_2", 'openstack_networking_secgroup_rule_v2.workers_ssh["0.0.0.0/0"]') in failed
    assert any(check == "CKV_SECRET_2" for check, _ in failed)


# --- cloud-init ---------------------------------------------------------------------------------------------------

ENV_FILE_VARS = {
    "OFFLOAD_REDIS_URL": "redis://:Zq3x9Lr2Vt8Wm1Np6Ks4Jh7Gf5Dc0BaYuEoIiAaSs@10.20.0.10:6379/0",
    "OFFLOAD_REDIS_CONNECT_TIMEOUT": "120",
    "OFFLOAD_QUEUE": "gpu",
    "OFFLOAD_QUEUE_KEY": "gpu:jobs",
    "OFFLOAD_API_BASE": "https://gpu.example.com/v1?a=1&b=<2>",
    "OFFLOAD_API_KEY": "sk-live-0123456789",
    "OFFLOAD_RESULT_BUCKET": "gpu-results",
    "OFFLOAD_S3_ENDPOINT": "https://s3.example.com",
    "OFFLOAD_S3_ACCESS_KEY_ID": "0123456789abcdef0123456789abcdef",
    "OFFLOAD_S3_SECRET_ACCESS_KEY": "fedcba9876543210fedcba9876543210",
    "OFFLOAD_MAX_ATTEMPTS": "3",
    "OFFLOAD_DAILY_JOB_CAP": "1000",
}
METADATA_GUARD = "command -v iptables >/dev/null 2>&1 || exit 0; iptables -w -C OUTPUT -d 169.254.169.254/32"
PIP = "/opt/offload/venv/bin/pip install --no-cache-dir 'offload @ git+https://git.example.com/o/offload@v0.1.0'"
OFFLOAD_YAML = "queues:\n  gpu: {backend: sdxl}\nbackends:\n  sdxl: {kind: runpod, api_key: '${RUNPOD_API_KEY}'}\n"


def _env_file(env: dict[str, str]) -> str:
    return templatefile(CLOUD_INIT / "offload.env.tftpl", {"env": env})


def _cache_vars(engine: str = "redis", volume: bool = True) -> dict[str, Any]:
    conf = {"redis": "/etc/redis/redis.conf", "valkey": "/etc/valkey/valkey.conf"}[engine]
    return {
        "engine": engine,
        "package": f"{engine}-server",
        "service": f"{engine}-server",
        "user": engine,
        "main_conf": conf,
        "override_conf": str(Path(conf).parent / "offload.conf"),
        "data_dir": f"/var/lib/{engine}",
        "bind_ip": "10.20.0.10",
        "password": "Zq3x9Lr2Vt8Wm1Np6Ks4Jh7Gf5Dc0BaYuEoIiAaSs",
        "appendfsync": "always",
        "volume_id": "4f6a1c2e-9b7d-4e3f-8a21-0c5d6e7f8a9b" if volume else "",
        "volume_script": (CLOUD_INIT / "cache-volume.sh").read_text(),
    }


def _worker_vars(config_yaml: str = "", processes: int = 3) -> dict[str, Any]:
    return {
        "env_file": _env_file(ENV_FILE_VARS),
        "unit": (ROOT / "deploy/systemd/offload-worker@.service").read_text(),
        "config_yaml": config_yaml,
        "pip_install": PIP,
        "metadata_guard": METADATA_GUARD,
        "units": [f"offload-worker@{i}.service" for i in range(1, processes + 1)],
    }


def _server_vars(domain: str = "") -> dict[str, Any]:
    host = "127.0.0.1" if domain else "10.20.0.11"
    env = {**ENV_FILE_VARS, "OFFLOAD_ADMIN_KEY": "a" * 48, "OFFLOAD_SERVER_HOST": host}
    return {
        "env_file": _env_file(env),
        "unit": (ROOT / "deploy/systemd/offload-server.service").read_text(),
        "config_yaml": OFFLOAD_YAML,
        "pip_install": PIP,
        "metadata_guard": METADATA_GUARD,
        "domain": domain,
    }


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "cache-redis-volume": ("cache.yaml.tftpl", _cache_vars()),
    "cache-valkey-no-volume": ("cache.yaml.tftpl", _cache_vars("valkey", volume=False)),
    "worker": ("worker.yaml.tftpl", _worker_vars()),
    "worker-with-offload-yaml": ("worker.yaml.tftpl", _worker_vars(OFFLOAD_YAML, processes=1)),
    "server-tls": ("server.yaml.tftpl", _server_vars("offload.example.com")),
    "server-private": ("server.yaml.tftpl", _server_vars()),
}


def _render(case: str) -> str:
    template, variables = CASES[case]
    return templatefile(CLOUD_INIT / template, variables)


def _file(doc: dict[str, Any], path: str) -> dict[str, Any]:
    matches: list[dict[str, Any]] = [f for f in doc.get("write_files", []) if f["path"] == path]
    assert len(matches) == 1, f"{path} written {len(matches)} times"
    return matches[0]


def _templatefile_calls(source: str) -> list[tuple[str, set[str]]]:
    """(template name, keys of the vars object) for every templatefile() call, nested ones included."""
    calls = []
    for m in re.finditer(r'templatefile\("\$\{path\.module\}/cloud-init/([\w.-]+)", \{', source):
        depth, i, top = 1, m.end(), []
        while depth:
            c = source[i]
            depth += {"{": 1, "(": 1, "[": 1, "}": -1, ")": -1, "]": -1}.get(c, 0)
            top.append(c if depth == 1 else " ")
            i += 1
        calls.append((m.group(1), set(re.findall(r"(?:^|[\n{,])\s*(\w+)\s*=", "".join(top)))))
    return calls


def test_templatefile_calls_pass_exactly_the_variables_each_template_reads() -> None:
    source = "\n".join(p.read_text() for p in MODULE.glob("*.tf"))
    calls = _templatefile_calls(source)
    for name, keys in calls:
        assert keys == referenced_names((CLOUD_INIT / name).read_text()), name
    assert {name for name, _ in calls} == {p.name for p in CLOUD_INIT.glob("*.tftpl")}
    assert len(calls) == 5  # cache, worker, server, and the env file for workers and for the server
    for template, variables in CASES.values():  # the test's own variables are complete too
        assert set(variables) == referenced_names((CLOUD_INIT / template).read_text())
    with pytest.raises(TemplateError, match="does not contain key"):
        templatefile(CLOUD_INIT / "worker.yaml.tftpl", {k: v for k, v in _worker_vars().items() if k != "units"})


def _assignment(line: str) -> tuple[str, str]:
    """NAME="value" of an environment file, the only form it may hold."""
    match = re.fullmatch(r'([A-Z0-9_]+)="([^"]*)"', line)
    assert match is not None, line
    return match[1], match[2]


def test_env_file_is_exactly_the_settings_quoted() -> None:
    text = _env_file(ENV_FILE_VARS)
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    parsed = dict(_assignment(line) for line in lines)
    assert parsed == ENV_FILE_VARS
    assert [k for k in parsed] == sorted(parsed)  # OpenTofu iterates a map in key order


@pytest.mark.parametrize("case", sorted(CASES))
def test_cloud_init_renders_to_cloud_config_with_required_keys(case: str) -> None:
    text = _render(case)
    assert text.startswith("#cloud-config\n")
    doc = yaml.safe_load(text)
    assert isinstance(doc, dict) and doc["package_update"] is True and doc["packages"]
    runcmd = [c if isinstance(c, list) else ["sh", "-c", c] for c in doc["runcmd"]]
    flat = [" ".join(map(str, c)) for c in runcmd]
    variables = CASES[case][1]
    if case.startswith("cache"):
        assert doc["packages"] == [variables["package"]]
        conf = _file(doc, variables["override_conf"])
        assert conf["permissions"] == "0640" and conf["defer"] is True
        assert conf["owner"] == f"{variables['user']}:{variables['user']}"
        settings = dict(line.split(" ", 1) for line in conf["content"].splitlines() if line and line[0] != "#")
        assert settings["bind"] == "10.20.0.10 127.0.0.1"  # the private address, never 0.0.0.0
        assert settings["requirepass"] == variables["password"]
        assert settings["appendonly"] == "yes" and settings["appendfsync"] == "always"
        assert settings["maxmemory-policy"] == "noeviction" and settings["protected-mode"] == "yes"
        assert f"include {variables['override_conf']}" in " ".join(flat)
        assert flat[-1] == f"systemctl restart {variables['service']}"
        has_volume = any("offload-cache-volume" in c for c in flat)
        assert has_volume == bool(variables["volume_id"])
        if has_volume:
            script = _file(doc, "/usr/local/sbin/offload-cache-volume")
            assert script["content"] == variables["volume_script"] and script["permissions"] == "0755"
            dropin = _file(doc, f"/etc/systemd/system/{variables['service']}.service.d/offload-volume.conf")
            assert f"RequiresMountsFor={variables['data_dir']}" in dropin["content"]
            assert flat.index(next(c for c in flat if "offload-cache-volume" in c)) < len(flat) - 1
        return
    kind = "worker" if case.startswith("worker") else "server"
    env = _file(doc, f"/etc/offload/{kind}.env")
    assert env["permissions"] == "0600" and env["owner"] == "root:root"
    assert env["content"] == variables["env_file"]
    assert "OFFLOAD_REDIS_URL=" in env["content"]
    unit_path = (
        "/etc/systemd/system/offload-worker@.service"
        if kind == "worker"
        else "/etc/systemd/system/offload-server.service"
    )
    assert _file(doc, unit_path)["content"] == variables["unit"]
    assert {"python3-venv", "git", "iptables"} <= set(doc["packages"])
    assert {
        "name": "offload",
        "system": True,
        "homedir": "/var/lib/offload",
        "shell": "/usr/sbin/nologin",
        "lock_passwd": True,
    } in doc["users"] and "default" in doc["users"]
    assert runcmd[0] == ["sh", "-c", METADATA_GUARD] and doc["bootcmd"] == [["sh", "-c", METADATA_GUARD]]
    assert ["python3", "-m", "venv", "/opt/offload/venv"] in runcmd and ["sh", "-c", PIP] in runcmd
    assert flat.index("systemctl daemon-reload") > flat.index(f"sh -c {PIP}")
    if variables["config_yaml"]:
        cfg = _file(doc, "/etc/offload/offload.yaml")
        assert cfg["content"] == variables["config_yaml"] and cfg["permissions"] == "0640" and cfg["defer"] is True
    else:
        assert all(f["path"] != "/etc/offload/offload.yaml" for f in doc["write_files"])
    if kind == "worker":
        assert runcmd[-1] == ["systemctl", "enable", "--now", *variables["units"]]
        return
    assert ["systemctl", "enable", "--now", "offload-server.service"] in runcmd
    if variables["domain"]:
        assert "caddy" in doc["packages"]
        assert _file(doc, "/etc/caddy/Caddyfile")["content"].startswith("offload.example.com {\n")
        assert "reverse_proxy 127.0.0.1:8000" in _file(doc, "/etc/caddy/Caddyfile")["content"]
    else:
        assert "caddy" not in doc["packages"]


def _cloud_init_schema(path: Path) -> subprocess.CompletedProcess[str]:
    site = TOOLS / "cloud-init" / "usr" / "lib" / "python3" / "dist-packages"
    if not (site / "cloudinit").is_dir():
        if os.environ.get("CI") and shutil.which("apt-get"):
            pytest.fail(f"{site} is missing: `make deploy-tools` unpacks Debian's cloud-init there")
        pytest.skip("Debian's cloud-init package is not unpacked in .venv-checkov (make deploy-tools)")
    return subprocess.run(
        [str(TOOLS / "bin" / "python"), "-m", "cloudinit.cmd.main", "schema", "--config-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(site)},
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_cloud_init_passes_cloud_inits_own_schema(case: str, tmp_path: Path) -> None:
    path = tmp_path / f"{case}.yaml"
    path.write_text(_render(case))
    out = _cloud_init_schema(path)
    assert out.returncode == 0 and "Valid cloud-config" in out.stdout, out.stdout + out.stderr


def test_cloud_init_schema_check_rejects_a_broken_config(tmp_path: Path) -> None:
    broken = (
        _render("worker")
        .replace('permissions: "0600"', "permissions: [0600]")
        .replace("lock_passwd: true", "lock_passwd: sometimes")
    )
    path = tmp_path / "broken.yaml"
    path.write_text(broken)
    out = _cloud_init_schema(path)
    assert out.returncode != 0
    assert "write_files.0.permissions" in out.stderr + out.stdout


def test_shell_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck") or str(ROOT / ".venv" / "bin" / "shellcheck")
    scripts = [CLOUD_INIT / "cache-volume.sh", ROOT / "deploy" / "image" / "entrypoint.sh"]
    out = subprocess.run([shellcheck, "--shell=sh", *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# --- with a real terraform binary (no provider needed) -----------------------------------------------------------


def _tf(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    assert TERRAFORM is not None
    env = {
        **os.environ,
        "CHECKPOINT_DISABLE": "1",
        "TF_IN_AUTOMATION": "1",
        "TF_INPUT": "0",
        "TF_CLI_CONFIG_FILE": os.devnull,
        "TF_DATA_DIR": str(cwd / ".terraform"),
        "NO_COLOR": "1",
    }
    return subprocess.run([TERRAFORM, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


@needs_terraform
def test_tf_files_are_canonically_formatted(tmp_path: Path) -> None:
    shutil.copytree(MODULE, tmp_path / "m", ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    shutil.copy(MODULE / "terraform.tfvars.example", tmp_path / "m" / "example.tfvars")
    out = _tf(["fmt", "-check", "-recursive", "-diff", "-no-color", "."], tmp_path / "m")
    assert out.returncode == 0, out.stdout + out.stderr


@needs_terraform
def test_python_renderer_matches_the_real_templatefile(tmp_path: Path) -> None:
    outputs = "\n".join(
        f'output "{case}" {{\n  value = templatefile("{CLOUD_INIT / template}", jsondecode(file("{case}.json")))\n}}'
        for case, (template, _) in CASES.items()
    )
    (tmp_path / "main.tf").write_text(outputs + "\n")
    for case, (_, variables) in CASES.items():
        (tmp_path / f"{case}.json").write_text(json.dumps(variables))
    env_vars = {"env": ENV_FILE_VARS}
    (tmp_path / "env.json").write_text(json.dumps(env_vars))
    env_template = CLOUD_INIT / "offload.env.tftpl"
    (tmp_path / "env.tf").write_text(
        f'output "env" {{\n  value = templatefile("{env_template}", jsondecode(file("env.json")))\n}}\n'
    )
    for step in (["init", "-backend=false", "-no-color"], ["apply", "-auto-approve", "-no-color"]):
        out = _tf(step, tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
    out = _tf(["output", "-json"], tmp_path)
    real = {name: o["value"] for name, o in json.loads(out.stdout).items()}
    for case in CASES:
        assert _render(case) == real[case], case
    assert _env_file(ENV_FILE_VARS) == real["env"]


VALID = {"offload_pip_spec": "offload==0.1.0", "s3_endpoint": "https://s3.example.com"}
BAD_VALUES: list[tuple[str, Any, str]] = [
    ("ssh_allowed_cidrs", ["0.0.0.0/0"], "never opened to the whole internet"),
    ("ssh_allowed_cidrs", ["::/0"], "never opened to the whole internet"),
    ("ssh_allowed_cidrs", ["not-a-cidr"], "must be CIDRs"),
    ("subnet_cidr", "10.20.0.5/24", "network address"),
    ("subnet_cidr", "10.20.0.0/28", "/16 to /24"),
    ("cache_password", "short", "24-128 characters"),
    ("cache_password", "a" * 30 + "@", "24-128 characters"),
    ("cache_engine", "memcached", "redis"),
    ("cache_appendfsync", "no", "always"),
    ("cache_volume_size_gb", 0, "1 to 2000"),
    ("worker_count", 1.5, "whole number"),
    ("worker_processes", 0, "1 to 32"),
    ("queue_name", "bad name", "queue_name"),
    ("s3_endpoint", "http://s3.example.com", "https://"),
    ("result_container", "Bad_Bucket", "S3 bucket name"),
    ("gpu_api_key", 'sk-"quoted"', "must not contain"),
    ("worker_extra_env", {"lower": "x"}, "upper-case"),
    ("worker_extra_env", {"OK": "a$b"}, "must not contain"),
    ("offload_pip_spec", "offload\nrm -rf /", "non-empty pip requirement"),
    ("server_domain", "Not A Domain", "DNS name"),
    ("server_admin_key", "too-short", "32-256"),
    ("daily_job_cap", -1, "whole number"),
    ("name_prefix", "Offload_Prod", "name_prefix"),
]


@pytest.fixture(scope="module")
def variables_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """variables.tf alone is a module with no provider: terraform evaluates its validation rules offline."""
    root = tmp_path_factory.mktemp("vars")
    shutil.copy(MODULE / "variables.tf", root / "variables.tf")
    out = _tf(["init", "-backend=false", "-no-color"], root)
    assert out.returncode == 0, out.stdout + out.stderr
    return root


def _plan(root: Path, values: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    (root / "test.tfvars.json").write_text(json.dumps(values))
    return _tf(["plan", "-no-color", "-lock=false", "-var-file=test.tfvars.json"], root)


@needs_terraform
def test_terraform_accepts_the_defaults_and_the_example(variables_only: Path) -> None:
    out = _plan(variables_only, VALID)
    assert out.returncode == 0, out.stdout + out.stderr
    example = _tf(
        ["plan", "-no-color", "-lock=false", f"-var-file={MODULE / 'terraform.tfvars.example'}"], variables_only
    )
    assert example.returncode == 0, example.stdout + example.stderr
    good = {
        **VALID,
        "ssh_allowed_cidrs": ["203.0.113.0/24", "2001:db8::/32"],
        "cache_engine": "valkey",
        "worker_extra_env": {"RUNPOD_API_KEY": "rp_123"},
        "daily_job_cap": None,
        "ingest_list": None,
        "server_domain": "offload.example.com",
        "server_allowed_cidrs": ["0.0.0.0/0"],
    }
    out = _plan(variables_only, good)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_terraform
@pytest.mark.parametrize(("name", "value", "message"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v, _ in BAD_VALUES])
def test_terraform_rejects_bad_values(variables_only: Path, name: str, value: Any, message: str) -> None:
    out = _plan(variables_only, {**VALID, name: value})
    assert out.returncode != 0, f"{name}={value!r} was accepted"
    text = re.sub(r"\s+", " ", out.stderr + out.stdout)
    assert "Invalid value for variable" in text and message in text, text[-1500:]


@needs_terraform
def test_terraform_requires_the_required_variables(variables_only: Path) -> None:
    out = _plan(variables_only, {})
    assert out.returncode != 0
    for name in REQUIRED:
        assert name in out.stderr + out.stdout


# --- outputs and docs agree ---------------------------------------------------------------------------------------


def test_outputs_cover_the_tutorials_values_and_secrets_are_sensitive() -> None:
    outputs = {name: body for block in _blocks("output") for name, body in block.items()}
    assert {
        "cache_private_ip",
        "network_name",
        "worker_private_ips",
        "worker_floating_ips",
        "server_url",
        "result_container",
        "redis_url",
        "cache_password",
        "server_admin_key",
    } <= set(outputs)
    for name, body in outputs.items():
        secret = re.search(r"password|secret|_key$|redis_url|access_key", name) is not None
        assert (body.get("sensitive") is True) == secret, name
        assert body.get("description"), name
    docs = (ROOT / "docs" / "deploy.md").read_text()
    used = set(re.findall(r"tofu output(?: -raw| -json)? ([a-z0-9_]+)", docs))
    assert used and used <= set(outputs), used - set(outputs)
    assert "deploy.md" in (ROOT / "mkdocs.yml").read_text()  # on the docs site's menu


def test_cache_ip_and_pool_do_not_overlap() -> None:
    src = (MODULE / "locals.tf").read_text() + (MODULE / "network.tf").read_text()
    fixed = [int(n) for n in re.findall(r"cidrhost\(var\.subnet_cidr, (\d+)\)", src)]
    assert sorted(fixed) == [10, 11, 32]  # cache, server, start of the DHCP pool
    assert re.search(r"start = cidrhost\(var\.subnet_cidr, 32\)", src)


def test_render_rejects_what_it_does_not_support() -> None:
    with pytest.raises(TemplateError, match="outside the supported subset"):
        render("${upper(x)}", {"x": "a"})
    with pytest.raises(TemplateError, match="missing"):
        render("%{ if x }a", {"x": True})
