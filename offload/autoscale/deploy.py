"""Deployment from git: what a queue's `deployment` block means and the shell script that carries it out on the
rented machine, so one generic worker image (or this host, for the `local` provider) serves any repository.

The script clones one branch (shallow), changes into `code_path`, runs `setup_cmd` in the same shell (so a
`. .venv/bin/activate` in it holds for what follows), then runs the worker: `python -m offload worker --handler
<handler>` (the queue comes from OFFLOAD_QUEUE) or the user's own `startup_cmd`. RunPod and Vast.ai receive it
as the container's start command (`sh -c <script>`); the `local` provider runs it in a work directory of its
own per instance.

Credentials for a private repository never appear in the queue block, the script, argv or `.git/config`: the
block names a credential kept encrypted in the vault (`git_credential`), the machine receives it in its
environment (OFFLOAD_GIT_TOKEN, OFFLOAD_GIT_USERNAME), and git reads it through a one-shot credential helper
given with `-c` for the clone only.
"""

from __future__ import annotations

import re
import shlex
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BRANCH = re.compile(r"^(?!-)(?!.*\.\.)[A-Za-z0-9._/+-]{1,200}$")
HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
SCHEMES = ("https", "http", "ssh", "git", "file")
TOKEN_ENV = "OFFLOAD_GIT_TOKEN"
USER_ENV = "OFFLOAD_GIT_USERNAME"
# git asks the helper for a username and password; both come from the environment at clone time
_HELPER = '!f() { echo "username=${OFFLOAD_GIT_USERNAME:-x-access-token}"; echo "password=${OFFLOAD_GIT_TOKEN}"; }; f'


class Deployment(BaseModel):
    """`deployment:` of a queue: put the user's code on the machine and start serving the queue from it."""

    model_config = ConfigDict(extra="forbid")

    git_url: str = Field(..., description="https://, ssh://, git:// or file:// URL of the repository")
    branch: str = Field("main", description="the branch (or tag) to clone")
    code_path: str | None = Field(None, description="directory inside the repository to run from")
    setup_cmd: str | None = Field(None, description="shell command run once in code_path before the worker")
    handler: str | None = Field(None, description="module:function served with `offload worker --handler`")
    startup_cmd: str | None = Field(None, description="shell command that serves the queue (instead of handler)")
    git_credential: str | None = Field(None, description="name of a vault credential for a private repository")

    @field_validator("git_url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"git_url must be a {', '.join(s + '://' for s in SCHEMES)} URL")
        if parts.password or (parts.username and parts.scheme in ("http", "https")):
            raise ValueError(
                "git_url must not carry credentials: store the token in the vault "
                "(offload autoscale credentials set NAME) and name it in git_credential"
            )
        return v

    @field_validator("branch")
    @classmethod
    def _branch(cls, v: str) -> str:
        if not BRANCH.match(v):
            raise ValueError(f"branch {v!r} is not a valid branch name")
        return v

    @field_validator("code_path")
    @classmethod
    def _code_path(cls, v: str | None) -> str | None:
        if v is not None and (v.startswith("/") or ".." in v.split("/") or not v.strip()):
            raise ValueError("code_path must be a relative path inside the repository")
        return v

    @field_validator("handler")
    @classmethod
    def _handler(cls, v: str | None) -> str | None:
        if v is not None and not HANDLER.match(v):
            raise ValueError(f"handler {v!r} must look like package.module:function")
        return v

    @model_validator(mode="after")
    def _one_way_to_start(self) -> Deployment:
        if (self.handler is None) == (self.startup_cmd is None):
            raise ValueError("set exactly one of handler or startup_cmd")
        return self


def git_host(url: str) -> str:
    """The host a git URL sends credentials to, lowercased ("" for file:// URLs, which have none)."""
    return (urlsplit(url).hostname or "").lower()


def script(d: Deployment) -> str:
    """The POSIX shell script that deploys and starts the worker. OFFLOAD_WORKDIR (set by the local provider)
    chooses where the clone goes; OFFLOAD_PYTHON the interpreter that runs `-m offload` (default python3, after
    setup_cmd, so a virtualenv it activated is the one used)."""
    helper = shlex.quote("credential.helper=" + _HELPER)
    auth = f'if [ -n "${{{TOKEN_ENV}:-}}" ]; then set -- -c credential.helper= -c {helper}; else set --; fi'
    clone = [
        "git",
        '"$@"',
        "clone",
        "--quiet",
        "--depth",
        "1",
        "--single-branch",
        "--branch",
        shlex.quote(d.branch),
        "--",
        shlex.quote(d.git_url),
        '"$dir"',
    ]
    target = '"$dir"' if not d.code_path else f'"$dir"/{shlex.quote(d.code_path)}'
    lines = [
        "set -eu",
        'dir="${OFFLOAD_WORKDIR:-$HOME/offload-app}/repo"',
        'if [ ! -d "$dir/.git" ]; then',
        '  rm -rf "$dir"',
        f"  {auth}",
        "  " + " ".join(clone),
        "fi",
        f"cd {target}",
    ]
    if d.setup_cmd:
        lines.append(d.setup_cmd)
    if d.handler:
        lines.append(f'exec "${{OFFLOAD_PYTHON:-python3}}" -m offload worker --handler {shlex.quote(d.handler)}')
    else:
        assert d.startup_cmd is not None
        lines.append(f"exec sh -c {shlex.quote(d.startup_cmd)}")
    return "\n".join(lines) + "\n"


def start_command(d: Deployment) -> list[str]:
    """What a container receives as its start command (RunPod `dockerStartCmd`, Vast.ai `args`)."""
    return ["sh", "-c", script(d)]
