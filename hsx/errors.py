"""Expected failures: a person can act on the message alone.

Anything raised as an ``HsxError`` is printed by the CLI as one line and exits 2
(a wrong setting, an unreachable service, a run that does not exist, data that
does not fit). Any other exception is a bug: the CLI exits 1 and shows the
traceback with ``-v`` or ``HSX_DEBUG=1``.
"""

from __future__ import annotations


class HsxError(Exception):
    """An expected failure; the message says what was wrong and what to do."""


class ConfigError(HsxError, ValueError):
    """A setting is missing or wrong; the message names it."""


class NotPlanned(HsxError, LookupError):
    """A job names a batch its run's plan does not hold: a permanent error (a dead letter), never retried. The
    worker's and the uploader's jobs raise this one class."""
