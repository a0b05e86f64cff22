"""The command-line tools: ``kvforge plan``, ``kvforge demo`` and ``kvforge bench``.

:mod:`~kvforge.cli.main` parses arguments and reports bad input as one line;
:mod:`~kvforge.cli.formatting` holds the display helpers the commands share.
"""
