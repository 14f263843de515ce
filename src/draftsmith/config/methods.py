"""The drafting methods' options as the configs and the CLI read them (each method's options model is in its package,
the union and OPTIONS in the registry, draftsmith.methods): flags and YAML stay flat (`--method dflash --block-size
8`, or `method: dflash` beside `block_size: 8`); the resolved config nests them (`method: {name: dflash, block_size:
8, ...}`); both read back. An option of another method is refused in one line that says which options the chosen
method takes.
"""

from __future__ import annotations

from draftsmith.methods import DEFAULT_METHOD, OPTIONS
from draftsmith.methods.options import MethodOptions

# Every method's option names, each with the methods that take it (the CLI has one flag per name)
OPTION_NAMES: dict[str, list[str]] = {}
for _name, _cls in OPTIONS.items():
    for _field in _cls.model_fields:
        if _field != "name":
            OPTION_NAMES.setdefault(_field, []).append(_name)


def fold_options(data: dict[str, object]) -> dict[str, object]:
    """The config's input with `method` a mapping: its name (a string, a mapping's `name`, or the default) and the
    method's options given flat beside it (flags, a flat YAML file, an older checkpoint's flat record) moved in, a
    flat one overriding a nested one as a flag overrides a file. A flat option of another method is refused."""
    given = data.get("method", DEFAULT_METHOD)
    if isinstance(given, MethodOptions):
        given = given.model_dump()
    nested = dict(given) if isinstance(given, dict) else {"name": given}
    name = nested.setdefault("name", DEFAULT_METHOD)
    flat = {k: data[k] for k in OPTION_NAMES if k in data}
    if name not in OPTIONS:  # the union's own error names the choices
        return {**{k: v for k, v in data.items() if k not in flat}, "method": nested}
    takes = OPTIONS[name].model_fields
    for key in flat:
        if key not in takes:
            mine = ", ".join("--" + k.replace("_", "-") for k in takes if k != "name") or "no options"
            owners = " / ".join(OPTION_NAMES[key])
            raise ValueError(
                f"--{key.replace('_', '-')} is an option of --method {owners}; --method {name} takes {mine}"
            )
    return {**{k: v for k, v in data.items() if k not in flat}, "method": {**nested, **flat}}


def flat_options(dumped: dict[str, object]) -> dict[str, object]:
    """A dumped config with `method` back to its name and its options beside it (the flat form flags and older
    checkpoints use), for comparing two runs' hyper-parameters key by key."""
    method = dumped.get("method")
    if not isinstance(method, dict):
        return dict(dumped)
    options = {k: v for k, v in method.items() if k != "name"}
    return {**dumped, **options, "method": method.get("name")}


def option_default(key: str) -> object:
    """The default of an option every method that takes it agrees on; None where they differ (each says its own)."""
    defaults = {repr(OPTIONS[name].model_fields[key].default) for name in OPTION_NAMES[key]}
    return OPTIONS[OPTION_NAMES[key][0]].model_fields[key].default if len(defaults) == 1 else None


def option_help(key: str) -> str:
    """One flag's help for an option several methods may take: each distinct description, with its methods (and
    its default where the methods' defaults differ)."""
    texts: dict[str, list[str]] = {}
    for name in OPTION_NAMES[key]:
        field = OPTIONS[name].model_fields[key]
        shown = f" [default: {field.default}]" if option_default(key) is None and field.default is not None else ""
        texts.setdefault((field.description or "") + shown, []).append(name)
    return " ".join(f"{' / '.join(names)}: {text}" for text, names in texts.items())
