"""The config schema's building blocks: frozen pydantic models, typed fields that declare
their range once, and the translation of validation errors into ``ConfigError``.

A field's description, type, default and range are declared once, on the model (see
extproc/config.py and extproc/control/config.py). Validation, the environment loader,
docs/configuration.md and the JSON Schema (``prefix-router config-schema``) all read them
from there, so none of them can drift from the others.
"""

from __future__ import annotations

import enum
import ipaddress
import math
import ssl
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Self

import annotated_types
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from extproc.errors import ConfigError
from extproc.picker.hosts import parse_host_address

LogLevel = typing.Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[str, ...] = typing.get_args(LogLevel)


class FrozenModel(BaseModel):
    """A validated, immutable settings value: unknown fields are errors, and setting an
    attribute raises AttributeError, as on a frozen dataclass. Build one from outside
    input with ``validated`` (errors become ConfigError); the constructor, for code,
    raises pydantic's ValidationError."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated again (unlike ``model_copy``)."""
        return validated(type(self), {**dict(self), **changes})


def _invalid(allowed: str) -> PydanticCustomError:
    # The message is what is allowed; the field and the value come from the error's place.
    return PydanticCustomError("config", "{allowed}", {"allowed": allowed})


def finite(value: float) -> float:
    if not math.isfinite(value):
        raise _invalid("a finite number")
    return float(value)


# A float or an int (not a bool or a string), kept as a float; a field adds its range with
# ``described(..., ge=low, le=high)``. Integers are pydantic's StrictInt (not a bool, a
# float or a string).
Number = Annotated[float, Strict(), AfterValidator(finite)]


def _address(value: Any) -> str:
    if not isinstance(value, str):
        raise _invalid("an ip:port string")
    try:
        return parse_host_address(value)
    except ValueError as error:
        raise _invalid(f"ip:port ({error})") from None


# Where a Unix socket path may live: sun_path holds 108 bytes, one of them the final NUL.
MAX_SOCKET_PATH_BYTES = 107
UNIX_PREFIX = "unix:"
LOOPBACK_NET = ipaddress.IPv4Network("127.0.0.0/8")


def socket_path(address: str) -> str | None:
    """The path of a ``unix:/path`` listen address, or None for ``ip:port``."""
    return address[len(UNIX_PREFIX) :] if address.startswith(UNIX_PREFIX) else None


def parse_listen_address(text: str) -> str:
    """``ip:port`` (normalised) or ``unix:/absolute/path``; raise ValueError naming the
    problem."""
    path = socket_path(text.strip())
    if path is None:
        return parse_host_address(text)
    if not path.startswith("/"):
        raise ValueError(f"{text!r}: a Unix socket path must be absolute (unix:/run/router.sock)")
    if len(path.encode()) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"{text!r}: a Unix socket path holds at most 107 bytes")
    return UNIX_PREFIX + path


def _listen_address(value: Any) -> str:
    if not isinstance(value, str):
        raise _invalid("an ip:port or unix:/path string")
    try:
        return parse_listen_address(value)
    except ValueError as error:
        raise _invalid(f"ip:port or unix:/absolute/path ({error})") from None


IPC_PREFIX = "ipc://"
TCP_PREFIX = "tcp://"
LOOPBACK_ENDPOINT = "ipc:///absolute/path or tcp://127.x.x.x:port (loopback)"


def parse_loopback_endpoint(text: str) -> str:
    """A ZMQ endpoint on this machine: ``ipc:///absolute/path`` or ``tcp://127.x.x.x:port``;
    raise ValueError naming the problem. Nothing off the machine: what travels there is
    neither authenticated nor encrypted."""
    if text.startswith(IPC_PREFIX):
        path = text[len(IPC_PREFIX) :]
        if not path.startswith("/"):
            raise ValueError(f"{text!r}: an ipc path must be absolute (ipc:///run/x)")
        if len(path.encode()) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"{text!r}: an ipc path holds at most 107 bytes")
        return text
    if text.startswith(TCP_PREFIX):
        host, _, port = text[len(TCP_PREFIX) :].rpartition(":")
        try:
            loopback = ipaddress.IPv4Address(host) in LOOPBACK_NET
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"{text!r}: a tcp endpoint must be on 127.0.0.0/8 (loopback)")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r}: the port must be 1 to 65535")
        return f"{TCP_PREFIX}{host}:{int(port)}"
    raise ValueError(f"{text!r}: neither ipc:// nor tcp://")


def _loopback_endpoint(value: Any) -> str:
    if not isinstance(value, str):
        raise _invalid(f"a string, {LOOPBACK_ENDPOINT}")
    try:
        return parse_loopback_endpoint(value)
    except ValueError as error:
        raise _invalid(f"{LOOPBACK_ENDPOINT} ({error})") from None


def _dns_name(value: Any) -> str:
    host, _, port = str(value).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _invalid("host:port with a port from 1 to 65535")
    return str(value)


def _absolute_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
        raise _invalid("an absolute file path")
    return value


def _pem_file(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _invalid("a path to a PEM file")
    try:
        with open(value, "rb") as file:
            text = file.read(1_048_576)
    except OSError as error:
        raise _invalid(f"a readable PEM file ({error.strerror})") from None
    if b"-----BEGIN " not in text:
        raise _invalid("a PEM file (no -----BEGIN line in it)")
    return value


def key_pair_problem(cert_file: str, key_file: str) -> str | None:
    """Why ``key_file`` is not the private key of the certificate in ``cert_file``, or
    None. Checked at load: with a mismatched pair gRPC only says it failed to bind."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as error:
        return f"the private key of the certificate in {cert_file} ({error})"
    return None


def ca_problem(ca_file: str) -> str | None:
    """Why ``ca_file`` is not a bundle of CA certificates, or None."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(ca_file)
    except (ssl.SSLError, OSError) as error:
        return f"a PEM bundle of CA certificates ({error})"
    return None


# An IP literal and a port, normalised ("[::1]:08000" -> "[::1]:8000").
Address = Annotated[str, BeforeValidator(_address)]
# An Address, or a Unix socket: ``unix:/absolute/path``.
ListenAddress = Annotated[str, BeforeValidator(_listen_address)]
# A ZMQ endpoint on this machine (the decision exchange's): ipc:// or tcp:// on loopback.
LoopbackEndpoint = Annotated[str, BeforeValidator(_loopback_endpoint)]
# A DNS name and a port.
DnsName = Annotated[str, BeforeValidator(_dns_name)]
# An HTTP header name as Envoy hands it to ext_proc: lower case, token characters only, not
# a pseudo-header.
HeaderName = Annotated[str, Strict(), Field(pattern=r"^[a-z0-9!#$%&'*+.^_`|~-]+$", max_length=128)]
Name = Annotated[str, Strict(), Field(min_length=1)]
# A file that exists, can be read and holds PEM (a certificate, a key or a CA bundle). It
# is read again when the process starts: a restart picks up a renewed certificate.
PemFile = Annotated[str, BeforeValidator(_pem_file)]
# A file this process writes: an absolute path (its folder is made if missing).
AbsolutePath = Annotated[str, BeforeValidator(_absolute_path)]
PEM_FILE = "a path to a readable PEM file"


def described(
    text: str,
    default: Any = ...,
    *,
    allowed: str | None = None,
    at_most: str | None = None,
    restart: bool = False,
    **kwargs: Any,
) -> Any:
    """A field's description; ``allowed`` says in words what no type states (ip:port),
    and ``at_most`` names a sibling field whose value bounds this one (a timeout within
    its interval: the model checks it with ``check_at_most``). ``restart``: a running
    process keeps the value it started with, and a reload of the file leaves it alone
    (``restart_fields``)."""
    extra: dict[str, Any] = {
        **({"x-allowed": allowed} if allowed else {}),
        **({"x-at-most": at_most} if at_most else {}),
        **({"x-restart": True} if restart else {}),
    }
    return Field(default, description=text, json_schema_extra=extra or None, **kwargs)


def check_at_most(
    model: type[BaseModel], name: str, value: float, data: Mapping[str, Any]
) -> float:
    field = model.model_fields[name]
    sibling = sibling_bound(field)
    limit = data.get(sibling) if sibling else None
    if limit is not None and value > limit:
        raise _invalid(f"{allowed_text(field)} ({sibling} is {limit:g})")
    return value


def check_key_pair(config: BaseModel, cert: str, key: str) -> None:
    """ConfigError unless the fields ``cert`` and ``key`` are both null, or both set to a
    certificate and its own private key."""
    cert_file, key_file = getattr(config, cert), getattr(config, key)
    if cert_file is None and key_file is None:
        return
    if cert_file is None or key_file is None:
        missing, given = (key, cert) if key_file is None else (cert, key)
        raise ConfigError(missing, None, f"a PEM file when {given} is set (they go together)")
    problem = key_pair_problem(cert_file, key_file)
    if problem is not None:
        raise ConfigError(key, key_file, problem)


def check_ca(config: BaseModel, field: str) -> None:
    """ConfigError unless the field ``field`` is null or a bundle of CA certificates."""
    ca_file = getattr(config, field)
    problem = None if ca_file is None else ca_problem(ca_file)
    if problem is not None:
        raise ConfigError(field, ca_file, problem)


def check_needs(config: BaseModel, field: str, needed: str, why: str) -> None:
    """ConfigError if the field ``field`` is set while ``needed`` is null."""
    value = getattr(config, field)
    if value is not None and getattr(config, needed) is None:
        raise ConfigError(field, value, f"null unless {needed} is set ({why})")


# --- reading a model's declarations -----------------------------------------------------


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), type(None) in typing.get_args(hint)
    return hint, False


def _constraints(field: FieldInfo) -> Iterator[Any]:
    """Every metadata object of a field, including those inside an Optional[Annotated]."""
    yield from field.metadata
    inner, _ = _unwrap_optional(field.annotation)
    if typing.get_origin(inner) is Annotated:
        for item in typing.get_args(inner)[1:]:
            yield item
            if isinstance(item, FieldInfo):
                yield from item.metadata


def base_type(field: FieldInfo) -> tuple[Any, bool]:
    """The field's value type without Optional or Annotated, and whether null is allowed."""
    inner, optional = _unwrap_optional(field.annotation)
    if typing.get_origin(inner) is Annotated:
        inner = typing.get_args(inner)[0]
    return inner, optional


def bounds(field: FieldInfo) -> tuple[float, float] | None:
    low = high = None
    for item in _constraints(field):
        if isinstance(item, annotated_types.Ge):
            low = item.ge
        elif isinstance(item, annotated_types.Le):
            high = item.le
    return None if low is None or high is None else (low, high)  # type: ignore[return-value]


def needs_restart(field: FieldInfo) -> bool:
    """Whether a running process keeps the value it started with (``described(restart=)``)."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("x-restart") is True


def restart_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``model`` that only a restart changes: the one list a config reload
    checks against."""
    return tuple(name for name, field in model.model_fields.items() if needs_restart(field))


def sibling_bound(field: FieldInfo) -> str | None:
    """The name of the field whose value is this one's upper bound, if any."""
    extra = field.json_schema_extra
    return extra.get("x-at-most") if isinstance(extra, dict) else None  # type: ignore[return-value]


def range_text(field: FieldInfo, name: Callable[[str], str] = str) -> str | None:
    """A field's range as ``low to high`` (``low to <sibling>`` when another field bounds
    it, that field's name written by ``name``), or None for a field with no range."""
    kind, optional = base_type(field)
    limits = bounds(field)
    sibling = sibling_bound(field)
    if sibling:
        text = f"{limits[0] if limits else 0:g} to {name(sibling)}"
    elif limits:
        low, high = limits
        text = f"{low} to {high}" if kind is int else f"{low:g} to {high:g}"
    else:
        return None
    return text + (", or null" if optional else "")


def choice_values(field: FieldInfo) -> tuple[str, ...] | None:
    """The values an enum or Literal field takes, or None for any other field."""
    kind, _ = base_type(field)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return tuple(str(m.value) for m in kind)
    if typing.get_origin(kind) is typing.Literal:
        return typing.get_args(kind)
    return None


def allowed_text(field: FieldInfo) -> str:
    """What a field accepts, in words, for errors."""
    kind, _ = base_type(field)
    extra = field.json_schema_extra
    if isinstance(extra, dict) and extra.get("x-allowed") and kind in (int, float):
        return str(extra["x-allowed"])  # a number or words (workers: 1-64, or auto)
    limits = range_text(field)
    if limits is not None:
        return ("an integer from " if kind is int else "a number from ") + limits
    values = choice_values(field)
    if values is not None:
        return "one of " + ", ".join(values)
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return "a mapping"
    if isinstance(extra, dict) and extra.get("x-allowed"):
        text = str(extra["x-allowed"])
        if typing.get_origin(kind) is tuple:
            return f"a list of {text}"
        if typing.get_origin(kind) in (dict, Mapping):
            return f"a mapping of {text}"
        return text
    return "a " + {str: "string", int: "integer", float: "number", bool: "boolean"}.get(
        kind, "value"
    )


# --- validation -------------------------------------------------------------------------

M = typing.TypeVar("M", bound=BaseModel)


def _place(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """An error's location as the field's name in the file: ``health.timeout_s``,
    ``hosts[1]``, ``zones['vllm-1:8000']``."""
    text = ""
    current: Any = model
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(current, type) and issubclass(current, BaseModel) and isinstance(part, str):
            text += f".{part}" if text else part
            field = current.model_fields.get(part)
            current = base_type(field)[0] if field is not None else None
        else:  # an entry of a list or a mapping
            text += f"[{part}]" if isinstance(part, int) else f"[{part!r}]"
            current = None
    return text


def _field_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> FieldInfo | None:
    field = None
    current: Any = model
    for part in loc:
        if isinstance(part, int) or part == "[key]":
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            break
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current, _ = base_type(field)
    return field


def _known_fields(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    current: Any = model
    for part in loc[:-1]:
        field = current.model_fields.get(str(part))
        if field is None:
            break
        current, _ = base_type(field)
    return list(current.model_fields)


def config_error(error: ValidationError, model: type[BaseModel]) -> ConfigError:
    """The first error of a validation, as a ConfigError naming the field, the value and
    what is allowed."""
    first = error.errors()[0]
    loc = tuple(first["loc"])
    if first["type"] == "extra_forbidden":
        known = ", ".join(_known_fields(model, loc))
        return ConfigError(_place(model, loc), first["input"], f"a known field: {known}")
    if first["type"] == "config":
        return ConfigError(_place(model, loc), first["input"], str(first["ctx"]["allowed"]))
    field = _field_at(model, loc)
    if first["type"] == "model_type" or field is None:
        return ConfigError(_place(model, loc) or model.__name__, first["input"], "a mapping")
    if any(isinstance(part, int) for part in loc):  # an entry of a list
        extra = field.json_schema_extra
        allowed = extra.get("x-allowed") if isinstance(extra, dict) else None
        return ConfigError(_place(model, loc), first["input"], str(allowed or "a valid entry"))
    return ConfigError(_place(model, loc), first["input"], allowed_text(field))


def validated(model: type[M], values: Mapping[str, Any]) -> M:
    """``model`` from ``values``, or ConfigError naming the first bad field."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as error:
        raise config_error(error, model) from None


# --- sources: files and the environment -------------------------------------------------


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ConfigError on a missing or malformed file."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError("config file", str(path), f"a readable file ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise ConfigError("config file", str(path), f"valid YAML ({error})") from None
    except UnicodeDecodeError as error:
        raise ConfigError("config file", str(path), f"UTF-8 text ({error.reason})") from None
    except RecursionError:
        raise ConfigError("config file", str(path), "YAML nested less deeply") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError("config file", str(path), "a YAML mapping of field: value")
    return loaded


_NULL_WORDS = ("", "none", "null", "off")
# An environment variable is a string: these spell a true/false field (YAML's own words).
_BOOL_WORDS = {
    "true": True, "1": True, "yes": True, "on": True,
    "false": False, "0": False, "no": False, "off": False,
}  # fmt: skip


def env_values(model: type[BaseModel], env: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """The fields of ``model`` set in ``env`` as ``<prefix><FIELD>``, each string converted
    to its field's type (lists comma-separated, ``off`` or ``null`` for an optional field);
    the model validates the result."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        raw = env.get(prefix + name.upper())
        if raw is None:
            continue
        kind, optional = base_type(field)
        if optional and raw.strip().lower() in _NULL_WORDS:
            values[name] = None
        elif typing.get_origin(kind) is tuple:
            values[name] = tuple(p for p in (p.strip() for p in raw.split(",")) if p)
        elif kind is bool:
            word = raw.strip().lower()
            if word not in _BOOL_WORDS:
                raise ConfigError(name, raw, "true or false (also 1/0, yes/no, on/off)")
            values[name] = _BOOL_WORDS[word]
        elif kind in (int, float):
            try:
                values[name] = kind(raw)
            except ValueError:
                # A field that reads words of its own (workers: auto) takes them as given.
                if not any(isinstance(c, BeforeValidator) for c in _constraints(field)):
                    raise ConfigError(name, raw, allowed_text(field)) from None
                values[name] = raw.strip()
        else:
            values[name] = raw
    return values
