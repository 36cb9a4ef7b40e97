"""One error hierarchy for the whole project.

Lower layers raise these; only the edges (the CLI, the ext_proc stream) translate them
into exit codes, gRPC statuses or HTTP responses.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(RouterError):
    """A configuration value is missing, malformed or out of range.

    The message names the field, the bad value and what is allowed, so an operator can fix
    the file without reading code. The CLI maps it to exit code 2.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid config: {field}={value!r}: allowed {allowed}")


class NoHostsError(RouterError):
    """The published host set is empty, so no upstream can be chosen."""


class StreamAborted(RouterError):
    """The router cannot answer this request. Its ext_proc stream ends with a gRPC error,
    and Envoy's failure mode decides, as when the router is down: override-host places the
    request by its fallback policy (counted by Envoy as ``failure_mode_allowed``),
    original-dst answers 503 (``status_on_error``). The router never picks a 503 itself."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class ReplayError(RouterError):
    """A traffic log cannot be replayed as asked (no records, a block size it cannot
    give). The CLI maps it to exit code 1."""


class MissingExtraError(RouterError):
    """A command needs a module that an optional extra of the package installs, and that
    extra is not installed (``bench``: the benchmarks and ``replay --out``). The message
    names the module and the pip command; the CLI maps it to exit code 1."""

    def __init__(self, module: str, extra: str, needed_by: str) -> None:
        self.module = module
        self.extra = extra
        super().__init__(
            f"{needed_by} needs {module}, which is not installed: "
            f"pip install 'envoy-prefix-router[{extra}]'"
        )


class MissingHarnessError(RouterError):
    """A harness command (``bench``) runs where the package was installed without the
    benchmark harness (``extproc/bench``, ``extproc/cli/bench``): the router's image, which
    holds the runtime only. No extra installs it; the message says to run it from a source
    checkout. The CLI maps it to exit code 1."""

    def __init__(self, module: str, needed_by: str) -> None:
        self.module = module
        super().__init__(
            f"{needed_by}: the benchmark harness ({module}) is not installed in this image; "
            "run it from a source checkout: pip install -e '.[bench]'"
        )
