"""`hsx`: one command, a sub-command per role or tool, all listed in COMMANDS.

Each sub-command is a unit (hsx_cli/<name>.py): its flags (each with its HSX_*
variable, shown in --help), a frozen config built from them by one helper
(hsx_cli.flags.resolve), and ``run(config)``. Credentials are never flags.
Expected failures (hsx.errors.HsxError) print one line and exit 2; anything else
is a bug: exit 1, with the traceback under -v or HSX_DEBUG=1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from redis.exceptions import OutOfMemoryError

from hsx import __version__, life
from hsx.errors import HsxError
from hsx.printable import PrintableFormatter, printable
from hsx_cli import dashboard, demo, evaluate, export, inspect, produce, reset, retry_failed, run, show, status, upload, verify, worker
from hsx_cli.command import Command
from hsx_cli.flags import Flag, resolve

COMMANDS: tuple[Command, ...] = (
    run.COMMAND,
    produce.COMMAND, inspect.COMMAND, worker.COMMAND, upload.COMMAND, status.COMMAND, retry_failed.COMMAND, reset.COMMAND,
    dashboard.COMMAND, verify.COMMAND, show.COMMAND, export.COMMAND, evaluate.COMMAND, demo.DEMO, demo.ASSETS,
)
VERBOSE = Flag("--verbose", "debug logging, and the traceback of an unexpected error", type=bool, short="-v",
               env="HSX_DEBUG")
NOISY_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer", "rq.worker", "httpx", "filelock", "huggingface_hub")

log = logging.getLogger("hsx")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hsx", allow_abbrev=False, description="Extract hidden states from a target LLM into S3, "
                                "for training speculative-decoding drafters. Roles meet in Redis.",
                                epilog="Every flag falls back to the HSX_* variable named in its help.")
    p.add_argument("--version", action="version", version=f"hsx {__version__}")
    VERBOSE.add_to(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        s = sub.add_parser(command.name, help=command.help, description=command.description, allow_abbrev=False)
        for flag in command.flags:
            flag.add_to(s)
        s.set_defaults(hsx_command=command)
    return p


def _quiet_libraries(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)   # log lines carry sample ids and row text: shown, never obeyed
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:  # huggingface_hub logs through its own handler AND ours: every retry line twice. Keep ours only.
        from huggingface_hub.utils import logging as hub_logging

        hub_root = hub_logging.get_logger()
        for handler in list(hub_root.handlers):
            hub_root.removeHandler(handler)
        hub_root.propagate = True
    except ImportError:
        pass
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _unknown_flags(command: Command, extra: list[str]) -> str:
    """One line naming the flags argparse did not know, each with its nearest real flag when one is close."""
    import difflib

    names = [f.name for f in command.flags] + ["--help", VERBOSE.name]
    parts = []
    for arg in extra:
        if not arg.startswith("-"):
            continue
        flag = arg.split("=", 1)[0]
        near = difflib.get_close_matches(flag, names, n=1, cutoff=0.6)
        parts.append(f"{flag} (did you mean {near[0]}?)" if near else flag)
    return (f"hsx {command.name}: error: unknown flag{'s' if len(parts) > 1 else ''} {', '.join(parts) or ' '.join(extra)}"
            f"; flags are never abbreviated (hsx {command.name} --help lists them)")


# Roles a scheduler (Kubernetes, SLURM, compose, `hsx run`) may stop at any moment, loading included.
STOPPABLE_WHILE_STARTING = ("worker", "upload")


class StoppedWhileStarting(BaseException):   # not an Exception: no `except Exception` on the way swallows it
    """SIGTERM / SIGINT before the role took its first job: nothing is held, so it exits 0 and says so."""


def _stop_while_starting(signum, frame) -> None:
    raise StoppedWhileStarting(signal.Signals(signum).name)


class Terminated(BaseException):   # not an Exception: no `except Exception` on the way swallows it
    """SIGTERM to a command with no stop of its own: raised where it stands, so it unwinds as Ctrl-C does."""


def _terminate(signum, frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def _install_start_handlers(command: Command) -> None:
    """Until rq's work loop installs its own (hsx/fleet/role.py restores these after it), a role's first SIGTERM
    ends it at once with exit 0: importing torch and loading a model take seconds to minutes, and a pod evicted
    then (KEDA scaling down) died by the signal's default action (exit -15) instead of stopping.
    Every other command (`hsx run` sets its own on top) unwinds on SIGTERM as on Ctrl-C, its `finally`s and
    `with`s run: a producer stopped by `hsx run`, compose or a scheduler died by the default action, holding its
    run's lock for 30 s (the same command again, at once, was refused) and leaving a plan window's temp file in a
    local store (the complete run then verified "GAPS FOUND")."""
    if command.name in STOPPABLE_WHILE_STARTING:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _stop_while_starting)
    else:
        signal.signal(signal.SIGTERM, _terminate)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    command: Command = args.hsx_command
    life.rq_without_pickle()  # this process's entry: rq's default serializer reads JSON only (architecture.md, rule 5)
    if extra:
        print(_unknown_flags(command, extra), file=sys.stderr)
        return 2
    try:
        verbose = bool(VERBOSE.value(args.verbose))
    except HsxError as exc:
        print(f"hsx: error: {printable(exc, lines=True)}", file=sys.stderr)
        return 2
    _quiet_libraries(verbose)
    _install_start_handlers(command)
    try:
        cfg = command.config(resolve(command.flags, args))
        return command.run(cfg) or 0
    except StoppedWhileStarting as exc:
        print(f"hsx {command.name}: stopped while starting ({exc}): no job was taken", file=sys.stderr)
        return 0
    except HsxError as exc:
        if verbose:
            log.debug("expected error", exc_info=True)
        print(f"hsx {command.name}: error: {printable(exc, lines=True)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hsx {command.name}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"hsx {command.name}: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    except OutOfMemoryError as exc:  # a command's write (roles ride it out: hsx/redisconn.py)
        print(f"hsx {command.name}: error: Redis refuses writes: its memory is at maxmemory with maxmemory-policy "
              f"noeviction ({exc}); raise its maxmemory (CONFIG SET maxmemory) or free memory, then run this again",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # `hsx status | head`: the reader has all it wanted; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:  # a bug, or a case hsx does not know yet: keep the evidence
        if verbose:
            import traceback

            traceback.print_exc()
        print(f"hsx {command.name}: unexpected error: {type(exc).__name__}: {printable(exc, lines=True)}"
              + ("" if verbose else " (run with -v or HSX_DEBUG=1 for the traceback)"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
