"""Reading a config (YAML recipe, resources file, dotted overrides) into a stage's root model, the
first mistake as one :class:`ConfigError` line naming the key, and writing it back out (redacted)."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.config.sections import ConfigError, Float
from pipeline.config.stages import Config, StageConfig
from pipeline.secrets import has_secret, redact, restore


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------
def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.constructor.ConstructorError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else "?"
        raise ConfigError(f"{path}:{line}: YAML tag not allowed ({e.problem}); plain values only") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        parent = _read_yaml((path.parent / str(base)).resolve())
        data = _deep_merge(parent, data)
    return data


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # a plain string that YAML can't parse, e.g. "a: b"
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _deep_merge({}, data)
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {} if nxt is None else nxt
                node[p] = nxt
            node = nxt
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(parts)}: cannot set a key under a non-section value")
        node[parts[-1]] = value
    return data


RESOURCE_SECTIONS = ("cluster", "hardware")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple = (),
                *, resources: str | os.PathLike | None = None, world_size: int | None = None,
                schema: type[StageConfig] = Config) -> Config:
    """YAML recipe [+ a resources file] + dotted overrides → a validated ``schema`` (the stage's root).

    ``resources``: a file holding only ``cluster:``/``hardware:`` (configs/cluster/*.yaml), merged
    over the recipe and under the overrides.
    ``world_size``: check batch divisibility against it (default: the cluster section's
    nodes × tasks_per_node, or $WORLD_SIZE when set by a launcher).
    """
    data = _read_yaml(Path(path)) if path else {}
    if resources:
        res = _read_yaml(Path(resources))
        extra = sorted(set(res) - set(RESOURCE_SECTIONS))
        if extra:
            raise ConfigError(f"{resources}: {extra[0]}: a resources file holds only cluster: and hardware:")
        data = _deep_merge(data, res)
    return build(schema, apply_overrides(data, list(overrides)), world_size=world_size)


def build(schema: type[StageConfig], data: Any, *, world_size: int | None = None):
    """Validate plain data as ``schema``; the first mistake as one :class:`ConfigError` line."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a section (mapping), got {data!r}")
    try:
        return schema.model_validate(data, context={"world_size": world_size})
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
        raise ConfigError(_one_line(schema, first)) from None


def _field_at(schema: type[BaseModel], loc: tuple) -> tuple[type[BaseModel] | None, Any]:
    """(the section holding the key at ``loc``, the key's FieldInfo or None)."""
    model, info = schema, None
    for i, part in enumerate(loc):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None, None
        name = next((n for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if name is None:
            return model, None
        info = model.model_fields[name]
        if i == len(loc) - 1:
            return model, info
        model = info.annotation
    return model, info


def _key(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out


def _bound(info, name: str):
    """The bound ``name`` (gt, ge, le) as the field declares it (0, not pydantic's 0.0)."""
    for m in getattr(info, "metadata", []):
        if hasattr(m, name):
            return getattr(m, name)
    return None


def _one_line(schema: type[BaseModel], err: dict) -> str:
    loc, kind, got = tuple(err["loc"]), err["type"], err.get("input")
    key = _key(loc)
    if kind == "vitp_check":
        return err["ctx"]["message"]
    if kind == "extra_forbidden":
        section = _field_at(schema, loc[:-1])[1].annotation if loc[:-1] else schema
        names = [f.alias or n for n, f in section.model_fields.items()]
        prefix = _key(loc[:-1]) + "." if loc[:-1] else ""
        close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid: {', '.join(names)})"
        return f"{key}: unknown key{hint}"
    if kind == "model_type":
        return f"{key or 'config'}: expected a section (mapping), got {got!r}"
    if kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        name = {"greater_than": "gt", "greater_than_equal": "ge", "less_than_equal": "le", "less_than": "lt"}[kind]
        sign = {"gt": ">", "ge": ">=", "le": "<=", "lt": "<"}[name]
        info = _field_at(schema, loc)[1]
        bound = _bound(info, name)
        if isinstance(got, int) and any(a in (float, Float) for a in (getattr(info, "annotation", None),
                                                                      *get_args(getattr(info, "annotation", None)))):
            got = float(got)  # as the field holds it: "got 0.0"
        return f"{key}: must be {sign} {err['ctx'][name] if bound is None else bound}; got {got}"
    return f"{key}: {err['msg']}"  # vitp_type, vitp_choice: the field type's own words


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------
def to_dict(cfg, *, secrets: bool = False) -> dict:
    """Config → plain nested dict, with YAML key names. Every string is redacted (pipeline/secrets.py:
    URI userinfo and token-like query values masked) unless ``secrets=True``: what this returns gets
    written (config.yaml, manifests, MLflow params, the job's pickle), the secret stays in memory."""
    return _map_strings(cfg.model_dump(by_alias=True), (lambda s: s) if secrets else redact)


def _map_strings(data, fn):
    if isinstance(data, dict):
        return {k: _map_strings(v, fn) for k, v in data.items()}
    if isinstance(data, list):
        return [_map_strings(v, fn) for v in data]
    return fn(data)


def secret_values(cfg) -> list[str]:
    """The config's secret-bearing strings, in clear (for pipeline.secrets.remember)."""
    def walk(v):
        if isinstance(v, dict):
            return [x for w in v.values() for x in walk(w)]
        if isinstance(v, list):
            return [x for w in v for x in walk(w)]
        return [v] if isinstance(v, str) and has_secret(v) else []

    return walk(to_dict(cfg, secrets=True))


def from_dict(data: dict, *, world_size: int | None = None, schema: type[StageConfig] = Config):
    """A config from :func:`to_dict`'s output; redacted values get their secret back where this
    process knows it (pipeline.secrets.restore)."""
    return build(schema, _map_strings(data, restore), world_size=world_size)


def to_yaml(cfg: StageConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _flat(d: dict, prefix: str = "", out: dict | None = None) -> dict[str, Any]:
    out = {} if out is None else out
    for k, v in d.items():
        if isinstance(v, dict) and v:
            _flat(v, f"{prefix}{k}.", out)
        else:
            out[f"{prefix}{k}"] = v
    return out


def flatten(cfg: StageConfig) -> dict[str, Any]:
    """Dotted keys → values, e.g. for MLflow params."""
    return _flat(to_dict(cfg))


@dataclass(frozen=True)
class Resolved:
    """A config as a run records it, resolved once (secrets redacted): ``yaml``, the text of the run
    dir's ``config.yaml``, and ``params``, its dotted keys (MLflow params, the checkpoint manifest)."""

    yaml: str
    params: dict[str, Any]

    def write(self, run_dir: str | os.PathLike) -> Path:
        """Write ``config.yaml`` into ``run_dir``, atomically."""
        from pipeline.files import atomic_write

        return atomic_write(Path(run_dir) / "config.yaml", self.yaml)


def resolve(cfg: StageConfig) -> Resolved:
    data = to_dict(cfg)
    return Resolved(yaml.safe_dump(data, sort_keys=False), _flat(data))


def write_resolved(cfg: StageConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``config.yaml`` (the resolved config) into ``run_dir``, atomically."""
    return resolve(cfg).write(run_dir)
