"""offload.yaml, ${ENV} references, env overrides, the tutorial's env names, and errors that name the field."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload.backends import create_backend
from offload.config import config_file, load_settings, parse_rate
from offload.errors import ConfigError
from offload.storage import S3StorageSettings

# the offload.yaml example of the docs (how-to: Configure offload.yaml and each provider)
CONFIG_PAGE = Path(__file__).parents[2] / "docs" / "how-to" / "configuration.md"
HTTP_JOB = "{kind: http-job, base_url: 'http://gpu'}"
SECRETS = {
    name: f"secret-{name.lower()}"
    for name in (
        "OFFLOAD_REDIS_URL",
        "S3_ACCESS_KEY",
        "S3_SECRET_KEY",
        "GPU_API_KEY",
        "RUNPOD_API_KEY",
        "REPLICATE_API_TOKEN",
        "FAL_KEY",
        "OPENAI_API_KEY",
    )
}


def docs_yaml(tmp_path: Path) -> Path:
    block = re.search(r"```yaml\n(.*?)```", CONFIG_PAGE.read_text(), re.S)  # the page's first example
    assert block, "the docs' offload.yaml example is missing"
    path = tmp_path / "offload.yaml"
    path.write_text(block.group(1))
    return path


def test_the_docs_example_is_valid_and_builds_every_backend(tmp_path: Path) -> None:
    settings = load_settings(docs_yaml(tmp_path), env=SECRETS)
    assert settings.queue("gpu").daily_job_cap == 1000
    assert isinstance(settings.storage, S3StorageSettings) and settings.storage.secret_access_key is not None
    assert settings.storage.secret_access_key.get_secret_value() == "secret-s3_secret_key"
    assert "secret-s3_secret_key" not in repr(settings)  # secrets stay masked in reprs and logs
    for name, backend in settings.backends.items():
        built = create_backend(name, backend)
        assert built.name == name


def test_missing_env_reference_names_field_and_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in SECRETS.items() if k != "FAL_KEY"}
    with pytest.raises(ConfigError, match=r"backends\.fal-flux\.api_key: environment variable FAL_KEY is not set"):
        load_settings(docs_yaml(tmp_path), env=env)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("queues: {gpu: {backend: nope}}", r"queues\.gpu\.backend: no backend named 'nope'"),
        (f"backends: {{b: {HTTP_JOB}}}\nqueues: {{gpu: {{backend: b, concurrency: 0}}}}", r"queues\.gpu\.concurrency"),
        ("backends: {b: {kind: http-job}}", r"backends\.b\.base_url: Field required"),
        ("backends: {b: {kind: runpod, endpiont_id: e}}", r"backends\.b\.endpiont_id: unknown setting"),
        ("backends: {b: {kind: replicate, model: sdxl}}", r"backends\.b: model must look like owner/name"),
        ("backends: {b: {base_url: 'http://h'}}", r"backends\.b\.kind: Field required"),
        ("storage: {kind: s3, bucket: b, access_key_id: ak}", r"storage: access_key_id and secret_access_key"),
        ("storage: {kind: s3, bucket: b, max_threads: 0}", r"storage\.max_threads"),
        ("storage: {kind: local, bucket: b}", r"storage\.bucket: unknown setting"),
        ("backends: {b: {kind: teleport}}", r"backends\.b\.kind"),
        (f"backends: {{b: {{{HTTP_JOB[1:-1]}, rate_limit: fast}}}}", r"backends\.b\.rate_limit"),
        ("storage: {kind: s3}", r"storage\.bucket"),
        ("storage: {kind: s3, bucket: b, endpoint_ulr: x}", r"storage\.endpoint_ulr"),
        (f"backends: {{b: {HTTP_JOB}}}\nqueues: {{'bad name': {{backend: b}}}}", r"invalid queue name"),
        ("- just\n- a list", r"top level must be a mapping"),
        ("queues: [unclosed", r"not valid YAML"),
    ],
)
def test_bad_config_names_the_offending_field(tmp_path: Path, yaml_text: str, message: str) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load_settings(path, env={})


def test_tutorial_env_file_alone_configures_the_pipeline(tmp_path: Path) -> None:
    env = {
        "REDIS_URL": "redis://:pw@10.20.0.5:6379/0",
        "QUEUE_KEY": "gpu:jobs",
        "GPU_API_BASE": "https://gpu/v1",
        "GPU_API_KEY": "k",
        "S3_ENDPOINT": "https://s3",
        "AWS_ACCESS_KEY_ID": "ak",
        "AWS_SECRET_ACCESS_KEY": "sk",
        "RESULT_BUCKET": "gpu-results",
        "MAX_ATTEMPTS": "5",
        "DAILY_JOB_CAP": "1000",
        "POLL_INTERVAL": "5",
        "POLL_TIMEOUT": "600",
    }
    empty = tmp_path / "empty.yaml"  # named, so no ./offload.yaml or local stack config is read
    empty.write_text("")
    s = load_settings(None, env={**env, "OFFLOAD_CONFIG": str(empty)})
    q = s.queue("gpu-jobs")
    assert (q.ingest_list, q.max_attempts, q.daily_job_cap, q.poll_interval) == ("gpu:jobs", 5, 1000, 5.0)
    assert s.backends["gpu"].kind == "http-job" and s.backends["gpu"].base_url == "https://gpu/v1"
    assert isinstance(s.storage, S3StorageSettings)
    assert (s.storage.kind, s.storage.bucket, s.storage.endpoint_url) == ("s3", "gpu-results", "https://s3")
    assert s.redis_url == env["REDIS_URL"]
    # OFFLOAD_* names win over the tutorial's
    s2 = load_settings(None, env={**env, "OFFLOAD_CONFIG": str(empty), "OFFLOAD_DAILY_JOB_CAP": "7"})
    assert s2.queue("gpu-jobs").daily_job_cap == 7


def test_rates() -> None:
    assert parse_rate("20/s") == 20 and parse_rate("600/min") == 10 and parse_rate("3600/hour") == 1
    with pytest.raises(ValueError, match="rate limit must look like"):
        parse_rate("20 per second")


def test_config_check_command(tmp_path: Path) -> None:
    good = subprocess.run(
        [sys.executable, "-m", "offload", "config", "check", "--config", str(docs_yaml(tmp_path))],
        capture_output=True,
        text=True,
        env={**SECRETS, "PATH": "/usr/bin"},
        timeout=60,
    )
    assert good.returncode == 0 and good.stdout.startswith("ok:"), good.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("queues: {gpu: {backend: nope}}")
    out = subprocess.run(
        [sys.executable, "-m", "offload", "config", "check", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and out.stderr.startswith("error: queues.gpu.backend") and "Traceback" not in out.stderr


# -- which file: --config, else OFFLOAD_CONFIG, else ./offload.yaml, else the local stack's (the docs' order) --


def _yaml(path: Path, queue: str) -> Path:
    path.write_text(f"queues: {{{queue}: {{}}}}\n")
    return path


def test_config_file_precedence_matches_the_docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    home = tmp_path / ".offload"
    home.mkdir()
    env = {"OFFLOAD_HOME": str(home)}
    assert config_file(None, env) is None and load_settings(None, env).queues == {}
    stack = _yaml(home / "offload.yaml", "from_stack")
    assert config_file(None, env) == stack.resolve()
    _yaml(tmp_path / "offload.yaml", "from_cwd")
    assert config_file(None, env) == Path("offload.yaml")
    named = _yaml(tmp_path / "named.yaml", "from_env")
    env["OFFLOAD_CONFIG"] = str(named)
    assert config_file(None, env) == named
    given = _yaml(tmp_path / "given.yaml", "from_flag")
    assert config_file(given, env) == given
    assert list(load_settings(given, env).queues) == ["from_flag"]
    assert list(load_settings(None, env).queues) == ["from_env"]


def test_a_named_config_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--config: config file .*nope.yaml does not exist$"):
        config_file(tmp_path / "nope.yaml", {})
    with pytest.raises(ConfigError, match=r"^OFFLOAD_CONFIG: config file .*typo.yaml does not exist$"):
        load_settings(None, {"OFFLOAD_CONFIG": str(tmp_path / "typo.yaml")})


def test_the_stack_config_gets_its_s3_secret_however_it_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    home = tmp_path / ".offload"
    home.mkdir()
    (home / "s3-credentials.json").write_text('{"access_key_id": "ak", "secret_access_key": "stack-secret"}')
    (home / "offload.yaml").write_text(
        "storage: {kind: s3, bucket: results, access_key_id: ak, secret_access_key: '${OFFLOAD_S3_SECRET}'}\n"
    )
    env = {"OFFLOAD_HOME": str(home)}
    for path in (None, home / "offload.yaml"):
        storage = load_settings(path, {**env, "OFFLOAD_CONFIG": ""}).storage
        assert isinstance(storage, S3StorageSettings)
        secret = storage.secret_access_key
        assert secret is not None and secret.get_secret_value() == "stack-secret"
    other = tmp_path / "other.yaml"
    other.write_text((home / "offload.yaml").read_text())
    with pytest.raises(ConfigError, match="OFFLOAD_S3_SECRET is not set"):  # only the stack's own file
        load_settings(other, env)


def test_config_check_reads_offload_config_before_the_local_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the CLI used the local stack's config whenever ./offload.yaml was missing, ignoring
    OFFLOAD_CONFIG, although the docs put OFFLOAD_CONFIG first."""
    from typer.testing import CliRunner

    from offload.cli.app import app

    monkeypatch.chdir(tmp_path)
    home = tmp_path / ".offload"
    home.mkdir()
    _yaml(home / "offload.yaml", "from_stack")
    named = _yaml(tmp_path / "named.yaml", "from_env")
    result = CliRunner().invoke(app, ["config", "check"], env={"OFFLOAD_HOME": str(home), "OFFLOAD_CONFIG": str(named)})
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "ok: storage local, backends none, queues from_env -> None\n"
    result = CliRunner().invoke(
        app, ["config", "check", "--json"], env={"OFFLOAD_HOME": str(home), "OFFLOAD_CONFIG": None}
    )
    assert result.exit_code == 0, result.stderr
    assert '"config":"' + str(home.resolve() / "offload.yaml") + '"' in result.stdout


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("storage: just-a-string", r"^storage: must be a mapping of settings, got str$"),
        ("backends: {b: [1, 2]}", r"^backends\.b: must be a mapping of settings, got list$"),
        ("backends: {b: {kind: fal, app: a, base_url: 'admin:hunter2@fal.example'}}", r"^backends\.b\.base_url: must"),
        ("backends: {b: {kind: runpod, endpoint_id: e, webhook_url: 'hunter2'}}", r"^backends\.b\.webhook_url: must"),
        ("storage: {kind: s3, bucket: b, endpoint_url: 'key:hunter2@s3'}", r"^storage\.endpoint_url: must"),
    ],
)
def test_a_hostile_block_is_named_and_no_value_is_echoed(tmp_path: Path, yaml_text: str, message: str) -> None:
    """A URL without its scheme may still carry user:password@, so its value never reaches the error line."""
    path = tmp_path / "offload.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_settings(path, env={})
    assert "hunter2" not in str(caught.value)


def test_typed_blocks_are_what_the_settings_hold(tmp_path: Path) -> None:
    """Every block is its kind's model after loading (nothing left as a dict to check again later), and the
    secrets stay SecretStr until the one place that sends them."""
    from offload.autoscale.alert_settings import AlertSettings
    from offload.autoscale.settings import ServerSide
    from offload.backends.settings import (
        FalSettings,
        HttpJobSettings,
        OpenAIBatchSettings,
        OpenAISettings,
        ReplicateSettings,
        RunPodSettings,
    )
    from offload.storage.settings import S3StorageSettings

    path = docs_yaml(tmp_path)
    path.write_text(path.read_text() + "autoscaler: {worker_key: wk-secret-1}\nalerts: {cooldown: 60}\n")
    settings = load_settings(path, env=SECRETS)
    kinds = {name: type(b) for name, b in settings.backends.items()}
    assert set(kinds.values()) == {
        HttpJobSettings,
        RunPodSettings,
        ReplicateSettings,
        FalSettings,
        OpenAISettings,
        OpenAIBatchSettings,
    }
    assert isinstance(settings.storage, S3StorageSettings)
    assert isinstance(settings.autoscaler, ServerSide) and isinstance(settings.alerts, AlertSettings)
    runpod = settings.backends["sdxl"]
    assert isinstance(runpod, RunPodSettings) and runpod.base_url == "https://api.runpod.ai/v2"
    assert runpod.http()["api_key"] == "secret-runpod_api_key"
    plain = {SECRETS["OFFLOAD_REDIS_URL"], SECRETS["S3_ACCESS_KEY"]}  # a URL and a key id are no secrets
    for secret in {*SECRETS.values(), "wk-secret-1"} - plain:
        assert secret not in repr(settings)
