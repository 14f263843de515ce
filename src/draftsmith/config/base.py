"""The configs' common ground: the base every stage config shares, the CLI's list and JSON parsing, loading a YAML
file under the flags with one-line errors, the resolved config each stage writes, a stage's result."""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_text

RESOLVED_CONFIG_NAME = "config.yaml"


class StageConfig(BaseModel):
    """Base of every stage config: unknown keys are errors, so a typo in YAML is caught."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @classmethod
    def flag_fields(cls) -> dict[str, FieldInfo]:
        """The options the CLI makes flags of, in order (a config whose input is flatter than its fields says so)."""
        return dict(cls.model_fields)


def _split_list(value: object) -> object:
    """Accept "2,15,27" from the command line as well as a YAML list."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


T = TypeVar("T")
# a list option: "2,15,27" on the command line, a list in YAML (`Split[list[int]]`, `Split[list[int] | None]`)
Split = Annotated[T, BeforeValidator(_split_list)]


def _json_object(value: object) -> object:
    """Accept '{"thinking": true}' from the command line as well as a YAML mapping."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as err:
            raise ValueError(f"not a JSON object: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("a JSON object is needed, like '{\"thinking\": true}'")
    return value


# the chat template options of prepare, regenerate and evaluate: '{"thinking": true}' on the command line
ChatTemplateKwargs = Annotated[
    dict[str, Any], BeforeValidator(_json_object), Field(json_schema_extra={"json_flag": True})
]


def load_config(cls: type[StageConfig], config_file: Path | None, overrides: Mapping[str, object]) -> StageConfig:
    """YAML file first, then the CLI flags that were given (None means not given).

    Every mistake is one line: the file and the line / column of a YAML error, the file and the key of a value
    from the file that is unknown or wrong, the `--option` of a wrong flag."""
    flags = {k: v for k, v in overrides.items() if v is not None}
    if config_file is None:
        return validate_config(cls, flags)
    loaded = _read_yaml(Path(config_file))
    try:
        return cls.model_validate({**loaded, **flags})
    except ValidationError as err:
        first = err.errors()[0]
        if first["loc"] and str(first["loc"][0]) in flags:  # the flag's value is wrong, not the file's
            raise _one_line(cls, err, "") from None
        if not first["loc"]:  # the config's own check across options: its message says what is wrong
            raise _one_line(cls, err, f"{config_file}: ") from None
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
            close = difflib.get_close_matches(key, list(cls.model_fields), n=1)
            raise DraftsmithError(
                f"{config_file}: key {key}: not an option of `draftsmith "
                f"{cls.__name__.removesuffix('Config').lower()}`" + (f"; did you mean {close[0]}?" if close else "")
            ) from None
        raise DraftsmithError(f"{config_file}: key {key}: {_reason(err)}") from None


def _read_yaml(path: Path) -> dict[str, object]:
    if path.is_dir():
        raise DraftsmithError(f"{path}: is a directory, not a YAML config file (--config)")
    if not path.is_file():
        raise DraftsmithError(f"{path}: config file does not exist (--config)")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise DraftsmithError(f"{path}: not UTF-8 text (byte {err.start}); a config is a YAML file") from None
    except OSError as err:
        raise DraftsmithError(f"{path}: cannot read the config file ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise DraftsmithError(f"{path}: {where}not valid YAML ({problem})".replace("\n", " ")) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise DraftsmithError(
            f"{path}: expected a mapping of option: value at the top level, found a {type(loaded).__name__}"
        )
    return loaded


def _reason(err: ValidationError) -> str:
    """`Input should be a valid integer (got 'abc')`, and how many more problems there are."""
    first = err.errors()[0]
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    more = len(err.errors()) - 1
    return f"{first['msg']} (got {got})" + (f"; and {more} more" if more else "")


def _one_line(cls: type[StageConfig], err: ValidationError, where: str) -> DraftsmithError:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    if not loc:  # the config's own check across options: its message says what is wrong
        return DraftsmithError(f"{where}{first['msg'].removeprefix('Value error, ')}")
    method_option = len(loc) == 3 and loc[0] == "method"  # method.<name>.<option>: the method's option, a flag
    option = ".".join(loc[2:] if method_option else loc)
    option = f"--{option.replace('_', '-')}" if option in cls.model_fields or method_option else option
    return DraftsmithError(f"{where}option {option}: {_reason(err)}")


def validate_config(cls: type[StageConfig], data: Mapping[str, object], where: str = "") -> StageConfig:
    """`cls(**data)`, or a one-line error naming the option; `where` prefixes it (file, recipe section)."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise _one_line(cls, err, where) from None


def save_resolved_config(cfg: StageConfig, directory: Path) -> None:
    """Every stage writes the config it actually ran with beside its output."""
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    atomic_write_text(Path(directory) / RESOLVED_CONFIG_NAME, text)


ResultT = TypeVar("ResultT", bound=BaseModel)


class StageResult(BaseModel, Generic[ResultT]):
    """What a stage's `run` returns: where its output is, what it measured (typed: `result`) and a short summary of
    it the CLI prints as a table (display labels: for people, not for code)."""

    stage: str
    output: Path
    result: ResultT | None = None
    summary: dict[str, object] = Field(default_factory=dict)
    # Shell commands for the user to copy (e.g. how to serve the draft): printed in full below the table, unwrapped.
    commands: dict[str, str] = Field(default_factory=dict)
