"""`pageserve serve --config FILE`, as vLLM's: a YAML mapping of flag names (with or without
`--`, hyphens or underscores) to values. They are parsed as the flags would be and become the
parser's defaults, so that a flag given on the command line too takes the command line's value
(a flag given several times, such as --api-key, takes the file's values and the command line's)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


class ConfigFileError(ValueError):
    pass


def config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--config's file, the arguments without it); (None, argv) without the flag. One file at most."""
    found, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg == "--config" or arg.startswith("--config="):
            if found is not None:
                raise ConfigFileError("--config is given twice: give one file")
            if arg == "--config":
                if i + 1 == len(argv):
                    raise ConfigFileError("--config needs a file")
                i += 1
            found = argv[i] if arg == "--config" else arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return found, rest


def apply_config(path: str, parser: argparse.ArgumentParser) -> None:
    """Make the file's values `parser`'s defaults. ConfigFileError naming the file and the key
    for a key that is no flag of it or a value of the wrong kind; argparse's own error (naming
    the flag) for a value the flag does not take."""
    args = config_args(path, parser)
    given, unset = parser.parse_args(args), parser.parse_args([])
    parser.set_defaults(**{k: v for k, v in vars(given).items() if getattr(unset, k, None) != v})


def config_args(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The file's flags as arguments `parser` takes; ConfigFileError naming the file and key for
    a key that is no flag of it or a value of the wrong kind."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigFileError(f"--config {path}: {' '.join(str(e).split())}") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigFileError(f"--config {path}: the file must be a mapping of flag names to values, "
                              f"not a {type(values).__name__}")
    flags = {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    args: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).removeprefix("--").replace("_", "-")
        action = flags.get(flag)
        if action is None or flag == "--config" or flag == "--help":
            from pageserve.app.vllm_flags import NOT_TAKEN

            why = f"is vLLM's: {NOT_TAKEN[flag]}" if flag in NOT_TAKEN else "is not a flag of pageserve serve"
            raise ConfigFileError(f"--config {path}: {key!r} {why}")
        try:
            args += _arguments(flag, action, value)
        except ConfigFileError as e:
            raise ConfigFileError(f"--config {path}: {key}: {e}") from None
    return args


def _arguments(flag: str, action: argparse.Action, value) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):  # the key may be its --no- form
        _check(isinstance(value, bool), "true or false")
        positive = action.option_strings[0]
        return [positive if value == (flag == positive) else "--no-" + positive[2:]]
    if action.nargs == 0:  # an on-switch
        _check(isinstance(value, bool), "true or false")
        return [flag] if value else []
    many = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    items = value if isinstance(value, list) else [value]
    _check(many or not isinstance(value, list), "one value, not a list")
    _check(bool(items), "at least one value")
    texts = [_text(v) for v in items]
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={text}" for text in texts]
    if not many:  # one value, which may start with "-"
        return [f"{flag}={texts[0]}"]
    return [flag, *texts]


def _text(value) -> str:
    if isinstance(value, (dict, list)):  # a JSON flag's value (--speculative-config, --limit-mm-per-prompt)
        return json.dumps(value)
    _check(not isinstance(value, bool), "a value, not true or false (YAML reads yes, no, on and off as those: "
                                        "quote them)")
    _check(value is not None, "a value")
    return str(value)


def _check(ok: bool, wanted: str) -> None:
    if not ok:
        raise ConfigFileError(f"wants {wanted}")
