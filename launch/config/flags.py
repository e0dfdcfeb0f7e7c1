"""Flag parsing shared by the launch commands: parsers whose errors are one line naming
the nearest flag, flags generated from a dataclass's fields and docstrings, TOML run
files (``--config``) turned into flags, and the user's modules (``--custom-import``)
imported before any parser is built."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any

from hla_sp.launch.errors import ConfigError
from hla_sp.megatron_patch.args import custom_imports, import_custom

__all__ = ["OneLineParser", "RaisingParser", "add_dataclass_flags", "expand_config",
           "field_docs", "import_user_modules", "is_number", "nearest_flag", "one_line_error",
           "plain"]


def nearest_flag(word: str, flags: typing.Iterable[str]) -> str | None:
    """The known flag closest to a misspelt one (``--seq-len`` -> ``--seq-length``)."""
    flags = list(flags)
    name = word.split("=", 1)[0]
    # a prefix of exactly one flag is the likeliest meaning; else the closest spelling
    starts = [f for f in flags if f.startswith(name)]
    if len(starts) == 1:
        return starts[0]
    close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
    return close[0] if close else None


def one_line_error(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's message with "did you mean" for each unrecognized flag, on one line."""
    if message.startswith("unrecognized arguments:"):
        flags = [f for f in parser._option_string_actions if f.startswith("--")]
        hints = []
        for word in message.split(":", 1)[1].split():
            if word.startswith("-"):
                near = nearest_flag(word, flags)
                hints.append(f"{word}: did you mean {near}?" if near else f"{word}: unknown")
        if hints:
            message += " (" + "; ".join(hints) + ")"
    return message + f" ({parser.prog} --help lists every flag)"


class OneLineParser(argparse.ArgumentParser):
    """Errors in one line with the nearest flag, not the 60-line usage argparse prints."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line_error(self, message)}\n")


class RaisingParser(argparse.ArgumentParser):
    """A parser whose errors raise :class:`ConfigError` instead of printing usage and
    exiting (for callers such as the sweep, which name their own file and key)."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(one_line_error(self, message))


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each dataclass field (the torchtitan convention)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp: Any) -> tuple[type, bool]:
    """(element type, is_list) of an annotation like ``int | None`` or ``list[str] | None``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    return tp, False


def add_dataclass_flags(parser: argparse.ArgumentParser, name: str, cls: Any,
                        aliases: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """One argument group ``name`` of flags generated from the dataclass ``cls``: a flag
    ``--field-name`` per field, its help the field's docstring, its choices
    ``cls.CHOICES``' (if any), ``aliases`` other spellings by field; a field whose
    metadata says ``hla_flag`` is left to the parser that defines it. Returns the
    destinations, every field's."""
    group = parser.add_argument_group(name, " ".join((cls.__doc__ or "").split()))
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    dests = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("hla_flag"):
            dests.append(f.name)  # defined by add_hla_args, in its own group
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, is_list = _base_type(hints[f.name])
        help_text = docs.get(f.name, "")
        dests.append(f.name)
        if tp is bool:
            # a flag on by default also takes --no-FLAG (--no-check-for-nan-in-loss-and-grad)
            group.add_argument(flag, *(aliases or {}).get(f.name, ()),
                               action=argparse.BooleanOptionalAction if f.default is True
                               else "store_true", default=f.default, help=help_text)
            continue
        default = f.default
        kw: dict[str, Any] = {"type": tp, "default": default, "help": help_text}
        if is_list:
            kw["nargs"] = "+"
        choices = getattr(cls, "CHOICES", {})
        if f.name in choices:
            kw["choices"] = list(choices[f.name])
        if default is not None and not is_list:
            kw["help"] = f"{help_text} (default: {default})"
        group.add_argument(flag, **kw)
    return dests


def _toml_values(path: str, parser: argparse.ArgumentParser) -> dict[str, tuple[str, Any]]:
    """A TOML run file's values by flag destination: ``{dest: (key, value)}``, in file
    order. Tables only group keys, so a key given twice (in two tables, or spelt with -
    and _) is refused, naming both places; an unknown key names the nearest flag."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    sections: dict[str, list[str]] = getattr(parser, "sections", {})
    items: list[tuple[str, str, Any]] = []  # (where, key, value)
    for k, v in data.items():  # tables group keys; their keys are flags like the rest
        if isinstance(v, dict):
            inner = next((kk for kk, vv in v.items() if isinstance(vv, dict)), None)
            if inner is not None:  # [model.inner]: not a key of any flag
                raise ConfigError(f"--config {path}: [{k}.{inner}]: tables nest one level "
                                  f"([{k}] holds flags, not tables); put its keys in [{k}]")
            items += [(f"[{k}]", kk, vv) for kk, vv in v.items()]
        else:
            items.append(("the top level", k, v))
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    out: dict[str, tuple[str, Any]] = {}
    seen: dict[str, str] = {}
    for where, key, value in items:
        dest = key.replace("-", "_")
        section = where[1:-1] if where.startswith("[") else None
        if section in sections:  # a section's table: [model] num_layers, [hla] decay
            dest = _section_dest(path, section, key, dest, sections)
        action = flags.get(dest)
        if action is None or dest in ("config", "help"):
            near = nearest_flag("--" + dest.replace("_", "-"),
                                [f for f in parser._option_string_actions if f != "--config"])
            hint = f"; did you mean {near.lstrip('-')}?" if near else ""
            raise ConfigError(f"--config {path}: unknown key {key!r}{hint}")
        if dest in seen:
            raise ConfigError(
                f"--config {path}: {dest} is given twice, as {seen[dest]} and as {key!r} in "
                f"{where}; expected each key once (tables only group keys), keep one")
        seen[dest] = f"{key!r} in {where}"
        out[dest] = (key, value)
    return out


def _section_dest(path: str, section: str, key: str, dest: str,
                  sections: dict[str, list[str]]) -> str:
    """The destination of ``key`` in the table ``[section]``; a key of another section
    is refused, naming the one it belongs to. In ``[hla]`` the ``hla_`` prefix of the
    flags' names may be left out (``decay`` is ``--hla-decay``)."""
    own = sections[section]
    if dest not in own and "hla_" + dest in own:
        dest = "hla_" + dest
    if dest in own:
        return dest
    home = [s for s, dests in sections.items() if dest in dests or "hla_" + dest in dests]
    if home:
        raise ConfigError(f"--config {path}: [{section}] {key}: expected in [{home[0]}], "
                          f"not in [{section}]; move it there (or to the top level)")
    return dest  # unknown everywhere: the caller names the nearest flag


def _toml_tokens(path: str, values: dict[str, tuple[str, Any]],
                 parser: argparse.ArgumentParser) -> list[str]:
    """TOML values as command-line tokens (``seq_length = 4096`` -> ``--seq-length=4096``).
    A value is always a value: scalars go as ``--flag=VALUE``, and a list element that
    reads as a flag is refused, so that no value can add a flag of its own."""
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    out: list[str] = []
    for dest, (key, value) in values.items():
        action = flags[dest]
        flag = action.option_strings[0]
        switch = action.nargs == 0  # store_true, or a --x / --no-x pair
        if switch and not isinstance(value, bool):
            raise ConfigError(f"--config {path}: {key}: expected true or false, got {value!r}")
        if not switch and isinstance(value, bool):
            raise ConfigError(f"--config {path}: {key}: expected a value "
                              f"({_type_name(action)}), got {str(value).lower()}")
        if action.type in (int, float) and isinstance(value, str):
            raise ConfigError(f"--config {path}: {key}: expected {_type_name(action)}, got "
                              f"the string {value!r}; write it without quotes")
        if isinstance(value, bool):
            if isinstance(action, argparse._StoreTrueAction):
                out += [flag] if value else []
                continue
            # a --hla-x / --no-hla-x pair: the flag for this value
            want = "--" + ("" if value else "no-") + dest.replace("_", "-")
            if want not in parser._option_string_actions:
                raise ConfigError(f"--config {path}: {key} takes a value, got {value!r}")
            out.append(want)
        elif isinstance(value, list):
            for v in value:
                if isinstance(v, (list, dict, bool)):
                    raise ConfigError(f"--config {path}: {key}: expected a list of plain "
                                      f"values, got an element {v!r}")
                if str(v).startswith("-") and not is_number(str(v)):
                    raise ConfigError(
                        f"--config {path}: {key}: expected values, got {str(v)!r}, which reads "
                        f"as a flag; give each flag as a key of its own")
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            raise ConfigError(f"--config {path}: {key}: tables nest one level, got a table")
        else:
            out.append(f"{flag}={value}")  # one token: the value cannot be read as a flag
    try:  # the values too, while the file can still be named
        parser.parse_args(out)
    except (ConfigError, SystemExit) as e:
        raise ConfigError(f"--config {path}: {e}") from None
    return out


def _type_name(action: argparse.Action) -> str:
    """What a flag's value is, in words (``an integer``)."""
    return {int: "an integer", float: "a number", str: "a string"}.get(
        action.type, getattr(action.type, "__name__", "a value"))  # type: ignore[arg-type]


def is_number(text: str) -> bool:
    """Whether a command-line word reads as a number (``-1e-3`` is a value, not a flag)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def expand_config(argv: list[str],
                  make_parser: Callable[[], argparse.ArgumentParser]) -> list[str]:
    """``argv`` with every ``--config FILE`` replaced by the files' flags, put first so
    that the command line's own flags override them (argparse keeps the last value).
    Several files merge in the order given, a later file's value replacing an earlier
    one's (a ``false`` included). ``make_parser``: the command's parser, raising
    :class:`ConfigError` (built only when a file is given), against which every key and
    value is checked."""
    paths: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--config" or a.startswith("--config="):
            path = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            if not path or (path.startswith("-") and "=" not in a):
                raise ConfigError("--config: expected a TOML file, got nothing")
            paths.append(path)
            i += 1 if "=" in a else 2
            continue
        rest.append(a)
        i += 1
    if not paths:
        return argv
    parser = make_parser()
    merged: dict[str, tuple[str, Any]] = {}
    for path in paths:
        values = _toml_values(path, parser)
        _toml_tokens(path, values, parser)  # each file's values checked under its own name
        for dest, kv in values.items():
            merged.pop(dest, None)  # the later file's value, in its place in the order
            merged[dest] = kv
    return [*_toml_tokens(" + ".join(paths), merged, parser), *rest]


def import_user_modules(argv: list[str]) -> None:
    """Import the modules ``argv`` names with ``--custom-import`` (torchtitan's
    ``experimental.custom_import``); a failure is a :class:`ConfigError` naming one."""
    try:
        import_custom(custom_imports(argv))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def plain(doc: str) -> str:
    """A docstring as a terminal shows it: ``x`` and :mod:`x` as x (command helps)."""
    import re

    return re.sub(r":\w+:`([^`]*)`", r"\1", doc).replace("``", "")
