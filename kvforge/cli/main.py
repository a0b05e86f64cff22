"""``kvforge plan | demo | bench``: the command-line front door.

:func:`main` loads plugins, parses the command line (:mod:`~kvforge.cli.args`) and runs one
command: :mod:`~kvforge.cli.plan`, :mod:`~kvforge.cli.demo` or :mod:`~kvforge.cli.bench`.

Every command reports bad input as one line on stderr and exit code 2, never a traceback:
input is checked up front (option values by their argparse types, output paths before any
work, options against the model they describe). Only ``ValueError`` (``UsageError`` and
pydantic's errors included) and ``FileNotFoundError`` are input errors; any other exception
escaping a command is a bug in kvforge and keeps its traceback.

Plugins: at start the CLI imports every entry point of the group ``kvforge.backends``
(:func:`~kvforge.models.plugins.load_plugins`) and every ``--plugin MODULE``; what they
register is then known to ``--config`` (model types) and ``--backend`` (backends). A plugin
that fails to load in any way (not found, a refused registration, a crash, ``sys.exit()``)
is one line on stderr and exit code 2, and registers nothing; with ``--help`` it is a
one-line warning and the help is printed all the same.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvforge.cli.args import build_parser, plugin_parser
from kvforge.cli.formatting import one_line
from kvforge.models.plugins import PluginError, load_plugin_module, load_plugins

__all__ = ["main"]


def _wants_help(argv: Sequence[str]) -> bool:
    options = argv[: argv.index("--")] if "--" in argv else argv
    return any(a in ("-h", "--help") for a in options)


def _load_plugins(argv: list[str]) -> int | None:
    """Import the installed plugins and those of ``--plugin``; an exit code on failure.

    With ``--help`` a failure is a warning: the help of what did load is still useful.
    """
    try:
        known, _ = plugin_parser().parse_known_args(argv)
    except SystemExit as exc:  # e.g. --plugin without a value: argparse printed one line
        return int(exc.code or 0)
    help_only = _wants_help(argv)
    loads = [("", load_plugins)] + [(m, lambda m=m: load_plugin_module(m)) for m in known.plugin]
    for module, load in loads:
        try:
            load()
        except (PluginError, ValueError, TypeError) as exc:
            # PluginError carries any failure of the plugin itself; ValueError / TypeError
            # are a bad --plugin name (empty), refused before importing anything.
            where = "" if isinstance(exc, PluginError) else f"--plugin {module!r}: "
            if help_only:
                print(f"kvforge: warning: {where}{one_line(exc)}", file=sys.stderr)
                continue
            print(f"kvforge: error: {where}{one_line(exc)}", file=sys.stderr)
            return 2
    return None


def _run(args: argparse.Namespace) -> int:
    # imported on use: `kvforge plan` never loads the demo's or the benchmark's modules
    if args.command == "plan":
        from kvforge.cli.plan import cmd_plan

        return cmd_plan(args)
    if args.command == "demo":
        from kvforge.cli.demo import cmd_demo

        return cmd_demo(args)
    from kvforge.cli.bench import cmd_bench

    return cmd_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvforge`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    failed = _load_plugins(argv)
    if failed is not None:
        return failed
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (exit 2) and --help (exit 0) as return codes
        return int(exc.code or 0)
    try:
        return int(_run(args))
    except (ValueError, FileNotFoundError) as exc:
        # Input errors only (UsageError and pydantic's ValidationError are ValueErrors). A
        # TypeError, KeyError, ... escaping a command is a bug: it keeps its traceback.
        print(f"kvforge {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
