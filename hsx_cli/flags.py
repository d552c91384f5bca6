"""Flags: each declared once, with its HSX_* variable, default, range and help in one place.

A ``Flag`` becomes an argparse argument whose help ends in ``[HSX_NAME; default D]``
(so ``--help`` lists the variable of every flag), and ``resolve`` turns parsed
arguments into one frozen mapping of values: the flag if given, else the first
environment variable set, else the default; then the type, choices and range are
checked, and a wrong value is a ``ConfigError`` naming the flag (or variable).
This is the only place hsx reads its settings from the environment, except
secrets (``secret``), which are never flags.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hsx.errors import ConfigError

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_bool(text: str) -> bool:
    if text.strip().lower() in TRUE:
        return True
    if text.strip().lower() in FALSE:
        return False
    raise ValueError(f"expected one of {'/'.join(TRUE)} or {'/'.join(FALSE[:-1])}")


@dataclass(frozen=True)
class Flag:
    """One command-line flag and its environment fallback.

    ``type``: str, int, float or bool; a bool flag is a switch (``--burst``) whose variable reads
    1/true/yes or 0/false/no. ``env``: the variable, by default ``HSX_`` + the flag's name in upper
    case with ``_`` for ``-`` (``--spool-dir`` -> ``HSX_SPOOL_DIR``); ``aliases`` are read after it.
    ``min``/``max`` bound the value inclusively, ``above`` exclusively. ``repeat``: the flag may be
    given several times; its variable is comma-separated. A name without a leading ``-`` is a positional
    argument (str, int or float; may be left out on the line when its variable or default gives it).
    """

    name: str
    help: str
    type: Callable = str
    default: object = None
    env: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    above: float | None = None
    repeat: bool = False
    required: bool = False
    metavar: str | None = None
    short: str | None = None          # e.g. "-v"
    show_default: bool = True
    validate: Callable | None = None  # validate(value, from_argv): raise ConfigError if wrong

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env_name(self) -> str:
        return self.env or "HSX_" + self.dest.upper()

    def help_text(self) -> str:
        names = ", ".join((self.env_name,) + self.aliases)
        tail = names
        if self.required:
            tail += "; required"
        elif self.show_default and self.default not in (None, False, ()):
            tail += f"; default {self.default}"
        return f"{self.help} [{tail}]".replace("%", "%%")

    def add_to(self, parser) -> None:
        if not self.name.startswith("-"):   # a positional argument (e.g. `hsx show RUN [SAMPLE]`), optional on
            parser.add_argument(self.name, nargs="?", default=None, help=self.help_text(),  # the line: the
                                type=_argparse_type(self), metavar=self.metavar or self.dest.upper())  # variable
            return                                                                       # may give it
        names = [self.short, self.name] if self.short else [self.name]
        kw: dict = {"dest": self.dest, "default": None, "help": self.help_text()}
        if self.type is bool:
            kw["action"] = "store_true"
        else:
            kw["action"] = "append" if self.repeat else "store"
            kw["type"] = _argparse_type(self)
            if self.choices:
                kw["choices"] = self.choices
            if self.metavar:
                kw["metavar"] = self.metavar
        parser.add_argument(*names, **kw)

    def value(self, given) -> object:
        """The flag's value from ``given`` (parsed argument or None), the environment, or the default."""
        if given is not None and given is not False:
            value, source = given, self.name
        else:
            source = next((n for n in (self.env_name,) + self.aliases if os.environ.get(n) is not None), None)
            if source is None:
                if self.required:
                    raise ConfigError(f"{self.name} is required (or set {self.env_name})")
                return [] if self.repeat and self.default is None else self.default
            value = self._from_env(source, os.environ[source])
        for item in (value if self.repeat else [value]):
            self._check(item, source)
            if self.validate is not None and item is not None:
                self.validate(item, source == self.name)
        return value

    def _from_env(self, name: str, raw: str):
        try:
            if self.type is bool:
                return parse_bool(raw)
            if self.repeat:
                return [self.type(x.strip()) for x in raw.split(",") if x.strip()]
            return self.type(raw)
        except ValueError as exc:
            raise ConfigError(f"{name}={raw!r}: {exc}") from None

    def _check(self, value, source: str) -> None:
        if value is None or self.type is bool:
            return
        if self.choices and value not in self.choices:
            raise ConfigError(f"{source} {value!r}: choose one of {', '.join(map(str, self.choices))}")
        problem = range_problem(value, self.min, self.max, self.above)
        if problem:
            raise ConfigError(f"{source} {value}: {problem}")


def range_problem(value, low=None, high=None, above=None) -> str | None:
    if above is not None and not value > above:
        return f"must be greater than {_num(above)}"
    if low is not None and value < low:
        return f"must be at least {_num(low)}"
    if high is not None and value > high:
        return f"must be at most {_num(high)}"
    return None


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _argparse_type(flag: Flag):
    base = flag.type

    def convert(text: str):
        try:
            return base(text)
        except ValueError:
            import argparse

            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {getattr(base, '__name__', 'value')}") from None

    convert.__name__ = getattr(base, "__name__", "value")
    return convert


def resolve(flags, args) -> Mapping[str, object]:
    """Frozen {dest: value} of ``flags`` from parsed ``args`` + environment + defaults (see module doc)."""
    return MappingProxyType({f.dest: f.value(getattr(args, f.dest, None)) for f in flags})


def secret(name: str) -> str | None:
    """A secret from the environment only (never a flag, never logged): tokens, passwords."""
    return os.environ.get(name) or None
