"""A queue's routing settings (`backends:`, `route:`, `weights:`, `inputs:`, `health:`; docs/how-to/routing.md):
the models offload/config.py's QueueSettings composes, and the checks no single model can make (references to
the configured backends, a backend's own `health:` over its queue's), each naming its field."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, Protocol, Self

from pydantic import Field, GetJsonSchemaHandler, field_validator, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from offload.backends.settings import HealthSettings
from offload.errors import ConfigError
from offload.input_maps import Template, imported
from offload.input_maps import check as check_template
from offload.schema import NonEmpty, Strict
from offload.suggest import closest, did_you_mean

RouteKind = Literal["fallback", "weighted", "cheapest"]
InputMap = Callable[[Any], Any]


class InputMapSettings(Strict):
    """One backend's input mapping: `function` (`module:function`, also written as the bare string) or `template`
    (that input as JSON, `{"$input": "path"}` copying a field of the job input: offload/input_maps.py)."""

    function: NonEmpty | None = Field(None, description="module:function, called with the job input")
    template: Any = Field(None, description='the backend\'s input as JSON; {"$input": "prompt"} copies `prompt`')

    @model_validator(mode="before")
    @classmethod
    def _bare(cls, v: Any) -> Any:
        return {"function": v} if isinstance(v, str) else v

    @classmethod
    def __get_pydantic_json_schema__(cls, core: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The bare `module:function` string too, for editors checking offload.yaml against the schema."""
        return {"anyOf": [{"type": "string", "minLength": 1}, handler.resolve_ref_schema(handler(core))]}

    @field_validator("template")
    @classmethod
    def _checked(cls, v: Any) -> Any:
        if found := list(check_template(v)):
            raise ValueError("; ".join(found))
        return v

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.function is None) == (self.template is None):
            raise ValueError("set either function (module:function) or template, not both")
        return self


class RoutedQueue(Protocol):
    """What the checks read of a queue (offload.config.QueueSettings)."""

    @property
    def backend(self) -> str | None: ...
    @property
    def backends(self) -> list[str] | None: ...
    @property
    def route(self) -> RouteKind: ...
    @property
    def weights(self) -> dict[str, float] | None: ...
    @property
    def inputs(self) -> dict[str, InputMapSettings] | None: ...
    @property
    def health(self) -> HealthSettings: ...
    @property
    def route_backends(self) -> list[str]: ...
    @property
    def served_backends(self) -> list[str]: ...


def route_problems(where: str, q: RoutedQueue, known: Mapping[str, Any]) -> Iterator[ConfigError]:
    """A routed queue's problems (docs/how-to/routing.md), each naming its field."""
    names = q.backends or []
    if q.backends is not None and q.backend is not None:
        yield ConfigError(f"{where}.backends: set either backend (one) or backends (several), not both")
    for name in names:
        if name not in known:
            yield ConfigError(
                f"{where}.backends: no backend named {name!r} is configured{did_you_mean(closest(name, known))}"
            )
    if len(set(names)) != len(names):
        yield ConfigError(f"{where}.backends: each backend may be named once")
    yield from _weight_problems(where, q, names)
    served = q.served_backends
    for name, spec in (q.inputs or {}).items():
        if name not in served:
            yield ConfigError(f"{where}.inputs.{name}: not one of the queue's backends ({', '.join(served)})")
        try:
            input_map(spec)
        except ConfigError as exc:
            yield ConfigError(f"{where}.inputs.{name}: {exc}")
    if q.health.max_cool_down_s < q.health.cool_down_s:
        yield ConfigError(f"{where}.health.max_cool_down_s: must be at least cool_down_s ({q.health.cool_down_s})")
    for name in served:
        own = getattr(known.get(name), "health", None)
        if isinstance(own, HealthSettings) and (h := own.over(q.health)).max_cool_down_s < h.cool_down_s:
            yield ConfigError(
                f"backends.{name}.health.max_cool_down_s: must be at least cool_down_s ({h.cool_down_s}, with "
                f"{where}.health under it), got {h.max_cool_down_s}"
            )


def _weight_problems(where: str, q: RoutedQueue, names: list[str]) -> Iterator[ConfigError]:
    if q.route == "weighted":
        if not q.weights:
            yield ConfigError(
                f"{where}.weights: required with route: weighted (e.g. {{{', '.join(f'{n}: 1' for n in names)}}})"
            )
        for name in names:
            if q.weights and name not in q.weights:
                yield ConfigError(f"{where}.weights.{name}: missing (every backend of the queue needs a share)")
    elif q.weights is not None:
        yield ConfigError(f"{where}.weights: only read with route: weighted (route is {q.route})")
    for name, share in (q.weights or {}).items():
        if name not in names:
            yield ConfigError(f"{where}.weights.{name}: not one of the queue's backends ({', '.join(names)})")
        elif share <= 0:
            yield ConfigError(f"{where}.weights.{name}: must be greater than 0, got {share}")


def input_map(spec: str | InputMapSettings) -> InputMap:
    """A per-backend input mapping: the template, or the function `module:function` names; a ConfigError says why
    not."""
    if isinstance(spec, InputMapSettings) and spec.template is not None:
        return Template(spec.template)
    path = spec.function if isinstance(spec, InputMapSettings) else spec
    assert path is not None
    try:
        return imported(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
