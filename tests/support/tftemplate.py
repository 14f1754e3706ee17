"""OpenTofu's templatefile(), for the subset of the template language deploy/opentofu/cloud-init uses, so tests
can render the cloud-init files without OpenTofu. Where a `terraform` binary exists, a test renders the same
templates with the real templatefile() and requires byte-identical output.

Supported: literal text with the `$${` and `%%{` escapes; `${EXPR}`; `%{ if EXPR }` / `%{ else }` / `%{ endif }`;
`%{ for V in EXPR }` and `%{ for K, V in EXPR }` / `%{ endfor }`; strip markers (`{~`, `~}`) with OpenTofu's
rule (the literal is cut into lines, each keeping its newline; `~}` trims the whitespace that starts the next
line-piece, `{~` the whitespace that ends the previous one). EXPR is a name, a string literal, `NAME.attr`,
`jsonencode(EXPR)` or `EXPR == EXPR` / `EXPR != EXPR`. Anything else raises TemplateError, as does a name
missing from the variables (templatefile fails the same way), so a template that strays outside the subset
fails loudly instead of rendering wrongly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_TOKEN = re.compile(r"(\$\$\{|%%\{|\$\{|%\{)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


class TemplateError(ValueError):
    pass


def jsonencode(value: Any) -> str:
    """OpenTofu's jsonencode: compact, map keys sorted, <, >, & and U+2028/9 escaped as Go's encoder does."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    for char, escape in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escape)
    return text


def _lines(text: str) -> list[str]:
    return re.findall(r"[^\n]*\n|[^\n]+", text)


def _split(template: str) -> list[tuple[str, str, bool, bool]]:
    """Tokens: ("lit", text, -, -), ("interp" | "directive", source, strip_left, strip_right)."""
    out: list[tuple[str, str, bool, bool]] = []
    pos, lit = 0, []
    while True:
        m = _TOKEN.search(template, pos)
        if not m:
            lit.append(template[pos:])
            break
        lit.append(template[pos : m.start()])
        if m.group(1) in ("$${", "%%{"):
            lit.append(m.group(1)[1:])
            pos = m.end()
            continue
        end = _closing_brace(template, m.end())
        body = template[m.end() : end]
        strip_left, strip_right = body.startswith("~"), body.endswith("~")
        body = body[1 if strip_left else 0 : len(body) - (1 if strip_right else 0)].strip()
        out.append(("lit", "".join(lit), False, False))
        lit = []
        out.append(("interp" if m.group(1) == "${" else "directive", body, strip_left, strip_right))
        pos = end + 1
    out.append(("lit", "".join(lit), False, False))
    # strip markers act on the neighbouring literals
    for i, (kind, _, left, right) in enumerate(out):
        if kind == "lit":
            continue
        if left and out[i - 1][0] == "lit":
            pieces = _lines(out[i - 1][1])
            if pieces:
                pieces[-1] = pieces[-1].rstrip()
            out[i - 1] = ("lit", "".join(pieces), False, False)
        if right and out[i + 1][0] == "lit":
            pieces = _lines(out[i + 1][1])
            if pieces:
                pieces[0] = pieces[0].lstrip()
            out[i + 1] = ("lit", "".join(pieces), False, False)
    return out


def _closing_brace(text: str, start: int) -> int:
    depth, i, quoted = 0, start, False
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            if c == "}" and depth == 0:
                return i
            depth -= 1
        i += 1
    raise TemplateError(f"unclosed template sequence at offset {start}")


class _Expr:
    def __init__(self, source: str, env: dict[str, Any]) -> None:
        self.src, self.pos, self.env = source, 0, env

    def evaluate(self) -> Any:
        value = self._comparison()
        self._space()
        if self.pos != len(self.src):
            raise TemplateError(f"unsupported expression {self.src!r}")
        return value

    def _space(self) -> None:
        while self.pos < len(self.src) and self.src[self.pos].isspace():
            self.pos += 1

    def _comparison(self) -> Any:
        left = self._operand()
        self._space()
        for op in ("==", "!="):
            if self.src.startswith(op, self.pos):
                self.pos += 2
                right = self._operand()
                return (left == right) if op == "==" else (left != right)
        return left

    def _operand(self) -> Any:
        self._space()
        if self.src.startswith('"', self.pos):
            m = re.compile(r'"((?:[^"\\$%]|\\.)*)"').match(self.src, self.pos)
            if not m:
                raise TemplateError(f"unsupported string literal in {self.src!r}")
            self.pos = m.end()
            return json.loads(m.group(0))
        m = _NAME.match(self.src, self.pos)
        if not m:
            raise TemplateError(f"unsupported expression {self.src!r}")
        self.pos = m.end()
        name = m.group(0)
        self._space()
        if self.src.startswith("(", self.pos):
            if name != "jsonencode":
                raise TemplateError(f"function {name}() is outside the supported subset")
            self.pos += 1
            arg = self._comparison()
            self._space()
            if not self.src.startswith(")", self.pos):
                raise TemplateError(f"unsupported expression {self.src!r}")
            self.pos += 1
            return jsonencode(arg)
        if name not in self.env:
            raise TemplateError(f"vars map does not contain key {name!r}")
        value = self.env[name]
        while self.src.startswith(".", self.pos):
            attr = _NAME.match(self.src, self.pos + 1)
            if not attr or not isinstance(value, dict) or attr.group(0) not in value:
                raise TemplateError(f"unsupported attribute access in {self.src!r}")
            value, self.pos = value[attr.group(0)], attr.end()
        return value


def _string(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value
    if value is None:
        raise TemplateError("interpolating null")
    raise TemplateError(f"cannot interpolate a {type(value).__name__}")


def _run(
    tokens: list[tuple[str, str, bool, bool]], i: int, env: dict[str, Any], out: list[str] | None, stop: tuple[str, ...]
) -> tuple[int, str]:
    """Render tokens from i until a directive named in `stop`; returns (index of it, its keyword)."""
    while i < len(tokens):
        kind, text, _, _ = tokens[i]
        if kind == "lit":
            if out is not None:
                out.append(text)
        elif kind == "interp":
            if out is not None:
                out.append(_string(_Expr(text, env).evaluate()))
        else:
            word = text.split(None, 1)[0]
            if word in stop:
                return i, word
            if word == "if":
                i = _run_if(tokens, i, text, env, out)
            elif word == "for":
                i = _run_for(tokens, i, text, env, out)
            else:
                raise TemplateError(f"unexpected directive {text!r}")
        i += 1
    if stop:
        raise TemplateError(f"missing %{{ {stop[-1]} }}")
    return i, ""


def _run_if(
    tokens: list[tuple[str, str, bool, bool]], i: int, text: str, env: dict[str, Any], out: list[str] | None
) -> int:
    """An `if` directive at i (and its `else`): the index of its `endif`."""
    cond = _Expr(text[2:], env).evaluate() if out is not None else False
    if out is not None and not isinstance(cond, bool):
        raise TemplateError(f"if condition is not a bool: {text!r}")
    j, kw = _run(tokens, i + 1, env, out if cond else None, ("else", "endif"))
    if kw == "else":
        j, kw = _run(tokens, j + 1, env, None if cond else out, ("endif",))
    return j


def _run_for(
    tokens: list[tuple[str, str, bool, bool]], i: int, text: str, env: dict[str, Any], out: list[str] | None
) -> int:
    """A `for` directive at i, its body rendered once per item: the index of its `endfor`."""
    m = re.fullmatch(r"for\s+([A-Za-z_]\w*)(?:\s*,\s*([A-Za-z_]\w*))?\s+in\s+(.+)", text, re.S)
    if not m:
        raise TemplateError(f"unsupported for directive {text!r}")
    first, second, source = m.groups()
    if out is None:
        end, _ = _run(tokens, i + 1, env, None, ("endfor",))
        return end
    seq = _Expr(source, env).evaluate()
    pairs = sorted(seq.items()) if isinstance(seq, dict) else list(enumerate(seq))
    found = None
    for key, value in pairs:
        scope = dict(env)
        if second:
            scope[first], scope[second] = key, value
        else:
            scope[first] = value
        found, _ = _run(tokens, i + 1, scope, out, ("endfor",))
    if found is None:
        found, _ = _run(tokens, i + 1, env, None, ("endfor",))
    return found


def render(template: str, variables: dict[str, Any]) -> str:
    out: list[str] = []
    _run(_split(template), 0, dict(variables), out, ())
    return "".join(out)


def templatefile(path: str | Path, variables: dict[str, Any]) -> str:
    return render(Path(path).read_text(), variables)


def referenced_names(template: str) -> set[str]:
    """Top-level variable names a template reads (loop variables excluded)."""
    names: set[str] = set()
    bound: set[str] = set()
    for kind, text, _, _ in _split(template):
        if kind == "lit":
            continue
        if kind == "directive" and text.startswith("for "):
            m = re.fullmatch(r"for\s+([A-Za-z_]\w*)(?:\s*,\s*([A-Za-z_]\w*))?\s+in\s+(.+)", text, re.S)
            if m:
                bound.update(n for n in m.groups()[:2] if n)
                text = m.group(3)
        elif kind == "directive":
            text = text.split(None, 1)[1] if " " in text else ""
        text = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
        for m2 in _NAME.finditer(text):
            after = text[m2.end() :].lstrip()
            before = text[: m2.start()].rstrip()
            if after.startswith("(") or before.endswith("."):
                continue
            names.add(m2.group(0))
    return names - bound
