"""Write docs/configuration.md from the settings the services really parse.

    python tools/config_reference.py           # (re)write docs/configuration.md
    python tools/config_reference.py --check   # exit 1 if docs/configuration.md differs from what would be written

The target, draft and gateway take their settings from the pydantic-settings classes in tandem/config.py (CLI flags
through pydantic-settings' CliApp, environment variables through each class's env_prefix); the stack launcher
(tandem/stack.py) has an argparse parser of its own. Both are read as they are, so the reference follows the code:
nothing here names a setting. The output depends on nothing but the code (no dates, no environment, no machine).
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import operator
import os
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "configuration.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (section title, settings class in tandem.config, command that runs it)
SERVICES = [
    ("Target service", "TargetSettings", "python -m services.target"),
    ("Draft service", "DraftSettings", "python -m services.draft"),
    ("Gateway", "GatewaySettings", "python -m services.gateway"),
]
STACK = ("Stack launcher (`make run`)", "tandem.stack", "python -m tandem.stack")
HEADER = "| flag | environment variable | type | default | description |\n|---|---|---|---|---|"


# ---- Markdown helpers ------------------------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, no column breaks, no HTML tags, no stray emphasis."""
    text = " ".join(str(text).split())
    for char, escaped in (("\\", "\\\\"), ("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
        text = text.replace(char, escaped)
    return text


def code(text: str) -> str:
    """Inline code, safe inside a table cell (a pipe would still end the cell)."""
    return "`" + str(text).replace("|", "\\|") + "`"


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


# ---- pydantic-settings classes ---------------------------------------------------------------------------------------


def is_optional(annotation: object) -> tuple[object, bool]:
    """(the annotation without None, whether None was allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) < len(typing.get_args(annotation)):
            return functools.reduce(operator.or_, args), True
    return annotation, False


def type_name(annotation: object) -> str:
    inner, _ = is_optional(annotation)
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        return "one of " + ", ".join(code(v) for v in typing.get_args(inner))
    if origin in (list, tuple, set, frozenset):
        (item,) = typing.get_args(inner)[:1] or (str,)
        return f"list of {type_name(item)} (JSON in the environment)"
    if origin is dict:
        return "mapping (JSON)"
    if inner is Path or (isinstance(inner, type) and issubclass(inner, os.PathLike)):
        return "path"
    if isinstance(inner, type):
        return inner.__name__
    return cell(str(inner).replace("typing.", ""))


def bounds(metadata: list) -> str:
    """', 0 to 65535' / ', at least 1' / ', above 0' from the field's annotated-types constraints."""
    low = high = None
    for m in metadata:
        for attr, kind in (("ge", "min"), ("gt", "above"), ("le", "max"), ("lt", "below")):
            value = getattr(m, attr, None)
            if value is None:
                continue
            if kind in ("min", "above"):
                low = (kind, value)
            else:
                high = (kind, value)
    if low and high and low[0] == "min" and high[0] == "max":
        return f", {low[1]} to {high[1]}"
    words = []
    if low:
        words.append(("at least " if low[0] == "min" else "above ") + str(low[1]))
    if high:
        words.append(("at most " if high[0] == "max" else "below ") + str(high[1]))
    return (", " + ", ".join(words)) if words else ""


def default_text(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, (list, tuple, set, dict)) and not value:
        return "empty"
    if isinstance(value, Path):
        return code(value.as_posix())
    return code(value)


def flag_names(name: str, annotation: object, config: dict) -> list[str]:
    flag = name.replace("_", "-") if config.get("cli_kebab_case") else name
    inner, _ = is_optional(annotation)
    if inner is bool and config.get("cli_implicit_flags"):
        return [f"--{flag}", f"--no-{flag}"]
    return [f"--{flag}"]


def settings_section(title: str, class_name: str, command: str) -> list[str]:
    import tandem.config as config_module

    cls = getattr(config_module, class_name)
    config = dict(cls.model_config)
    prefix = config.get("env_prefix", "")
    lines = [f"## {title}", "", f"`{command} --help`; settings class `tandem.config.{class_name}`."]
    notes = []
    if prefix:
        notes.append(f"Every flag is also the environment variable `{prefix}<NAME>`.")
    if config.get("env_ignore_empty"):
        notes.append("An empty variable counts as unset (its default applies).")
    if notes:
        lines[-1] += " " + " ".join(notes)
    lines[-1] = wrap(lines[-1])
    lines += ["", HEADER]
    for name, field in cls.model_fields.items():
        env = (prefix + name).upper() if not config.get("case_sensitive") else prefix + name
        default = field.default_factory() if field.default_factory is not None else field.default
        lines.append(
            row(
                ", ".join(code(f) for f in flag_names(name, field.annotation, config)),
                code(env),
                type_name(field.annotation) + bounds(field.metadata),
                default_text(default),
                cell(field.description or ""),
            )
        )
    return [*lines, ""]


# ---- the stack launcher's argparse parser ----------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def environment_defaults(module: types.ModuleType) -> dict[str, str]:
    """{option string: environment variable} for add_argument calls whose default reads os.environ / os.getenv."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args):
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        for keyword in node.keywords:
            if keyword.arg != "default":
                continue
            for inner in ast.walk(keyword.value):
                if (
                    isinstance(inner, ast.Call)
                    and getattr(inner.func, "attr", None) in ("get", "getenv")
                    and inner.args
                    and isinstance(inner.args[0], ast.Constant)
                ):
                    found[first.value] = inner.args[0].value
    return found


@contextmanager
def without_environment(names: list[str]) -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def captured_parser(module: types.ModuleType, env_names: list[str]) -> argparse.ArgumentParser:
    """The parser `module.main` builds, taken at parse_args (so main never goes on to start anything)."""

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> typing.NoReturn:
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        with without_environment(env_names):
            module.main([])
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{module.__name__}.main() never parsed its arguments")


def argparse_type(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(code(c) for c in action.choices)
    if action.nargs == 0:
        return "flag"
    if action.type is None:
        return "str"
    if action.type is Path:
        return "path"
    return getattr(action.type, "__name__", str(action.type))


def stack_section(title: str, module_name: str, command: str) -> list[str]:
    import importlib

    module = importlib.import_module(module_name)
    env_of = environment_defaults(module)
    parser = captured_parser(module, sorted(set(env_of.values())))
    intro = (
        f"`{command} --help`: starts the target, the draft and the gateway as processes on this machine with these"
        " options; every other setting comes from the services' environment variables above (a flag the launcher"
        " passes wins over its variable)."
    )
    lines = [f"## {title}", "", wrap(intro), "", HEADER]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        env = next((env_of[o] for o in action.option_strings if o in env_of), None)
        default = None if action.nargs == 0 and action.default is False else action.default
        lines.append(
            row(
                ", ".join(code(o) for o in action.option_strings),
                code(env) if env else "",
                argparse_type(action),
                default_text(default) if action.nargs != 0 else "off",
                cell(action.help or ""),
            )
        )
    return [*lines, ""]


# ---- the document ----------------------------------------------------------------------------------------------------


def wrap(text: str) -> str:
    """A prose paragraph wrapped at 120 columns (never inside a word or a code span's hyphenated name)."""
    return textwrap.fill(text, width=120, break_long_words=False, break_on_hyphens=False)


def render() -> str:
    lines = [
        "<!-- Generated by tools/config_reference.py from tandem/config.py and tandem/stack.py."
        " Do not edit: run `make docs`. -->",
        "",
        "# Configuration reference",
        "",
        wrap(
            "Every setting of every service, as its `--help` lists it. A flag on the command line wins over the"
            " environment variable, which wins over the default. Flags are kebab-case, variables upper case with the"
            " service's prefix; a boolean takes `--name` / `--no-name` on the command line and `true` / `false` in"
            " the environment. The co-located gateway (`--colocate`) loads its models with the target's and the"
            " draft's environment variables."
        ),
        "",
    ]
    lines += [f"- [{title}](#{anchor(title)})" for title, _, _ in [*SERVICES, STACK]]
    lines.append("")
    for title, class_name, command in SERVICES:
        lines += settings_section(title, class_name, command)
    lines += stack_section(*STACK)
    return "\n".join(lines).rstrip("\n") + "\n"


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not what would be written")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="file to write or check")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else None
        if current != text:
            name = args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output
            state = "is missing" if current is None else "is out of date with the settings in the code"
            print(f"{name} {state}: run `make docs` to regenerate it", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
