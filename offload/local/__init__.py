"""The one-machine local stack: the embedded Valkey (`embedded`), `offload up`/`down` (`stack`) and
`offload demo` (`demo`). The package imports nothing itself: each command loads only the module it runs."""
