"""Command-line arguments as `hs.arg` reads them: `--name value`,
`--name=value`, bare `--flag` for a boolean, JSON for lists, dicts and a
None default; `hs.args(parser)` for scripts that keep their argparse.
Every `--flag` on the command line must be an argument of the script: a
misspelt one is refused with the known names, and `--help` lists them."""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from hindsight.errors import InvalidArgumentError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _argv() -> list[str]:
    # In a Jupyter kernel, not the kernel's own arguments (the notebook has none).
    from hindsight._run import jupyter

    return jupyter.program()[1][1:]


def _flag_name(token: str) -> str | None:
    """`--lr=3` -> "lr"; None for what is not a long option (values, `-x`, `--`)."""
    if not token.startswith("--") or token == "--":
        return None
    return token[2:].split("=", 1)[0]


def parse(name: str, default: Any, argv: list[str] | None = None) -> tuple[bool, Any]:
    """(given on the command line, value) for `hs.arg(name, default)`,
    converted to the default's type."""
    argv = _argv() if argv is None else argv
    flag = f"--{name}"
    raw: str | None = None
    for i, a in enumerate(argv):
        if a == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if isinstance(default, bool) and (
                nxt is None or _flag_name(nxt) is not None or nxt.lower() not in _TRUE + _FALSE
            ):
                raw = "true"  # a bare boolean flag
            elif nxt is None:
                raise InvalidArgumentError(f"argument --{name}: expected a value after it")
            else:
                raw = nxt
        elif a.startswith(flag + "="):
            raw = a[len(flag) + 1 :]
    if raw is None:
        return False, default
    return True, convert(name, default, raw)


def convert(name: str, default: Any, raw: str) -> Any:
    want = "JSON" if default is None else type(default).__name__
    try:
        if isinstance(default, bool):
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(raw)
            return raw.lower() in _TRUE
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, str):
            return raw
        np = sys.modules.get("numpy")
        if np is not None and isinstance(default, np.generic) and default.dtype.kind in "iuf":
            return type(default)(raw)  # np.float32(0.1) stays a float32
        if default is None:
            try:
                return json.loads(raw)
            except ValueError:
                return raw  # a None default takes any text
        value = json.loads(raw)
        if isinstance(default, (list, tuple)) and isinstance(value, list):
            return type(default)(value)
        if isinstance(default, dict) and isinstance(value, dict):
            return value
        raise ValueError(f"JSON of type {type(value).__name__}")
    except ValueError as e:
        raise InvalidArgumentError(f"argument --{name}: cannot read {raw!r} as {want}") from e


@dataclass
class Known:
    """The arguments a script declared so far: `hs.arg` names with their
    defaults, and the options of parsers given to `hs.args`."""

    defaults: dict[str, Any] = field(default_factory=dict)
    parser_options: set[str] = field(default_factory=set)
    checked: bool = False

    def add_parser(self, parser: Any) -> None:
        for action in getattr(parser, "_actions", []):
            for opt in action.option_strings:
                name = _flag_name(opt)
                if name:
                    self.parser_options.add(name)
            # Subcommands (`train --lr 0.5`): their parsers' options too.
            choices = action.choices if action.option_strings == [] else None
            if isinstance(choices, dict):
                for sub in choices.values():
                    if sub is not parser:
                        self.add_parser(sub)

    def usage(self, script: str) -> str:
        lines = [f"usage: {script} [--NAME VALUE ...]", "", "arguments (hs.arg):"]
        for n, d in self.defaults.items():
            lines.append(f"  --{n} {type(d).__name__.upper() if d is not None else 'VALUE'}  (default: {d!r})")
        return "\n".join(lines)

    def check(self, script: str, argv: list[str] | None = None) -> None:
        """Refuse `--flags` that are no argument of the script (once, when
        the training loop starts, by which time arguments are declared);
        `--help` prints them and exits."""
        if self.checked or (not self.defaults and not self.parser_options):
            return
        self.checked = True
        argv = _argv() if argv is None else argv
        if ("--help" in argv or "-h" in argv) and "help" not in self.defaults and "help" not in self.parser_options:
            print(self.usage(script))
            raise SystemExit(0)
        known = set(self.defaults) | self.parser_options
        unknown = [n for t in argv if (n := _flag_name(t)) is not None and n not in known]
        if unknown:
            bad = unknown[0]
            close = difflib.get_close_matches(bad, sorted(known), n=1)
            hint = f"; did you mean --{close[0]}?" if close else ""
            raise InvalidArgumentError(
                f"unknown argument --{bad}{hint} (this script's arguments: "
                f"{', '.join('--' + k for k in sorted(known))}). Scripts that parse other flags "
                "with argparse pass the parser to hs.args(parser)."
            )
