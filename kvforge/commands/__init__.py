"""The command-line tools: ``kvforge plan``, ``kvforge demo`` and ``kvforge bench``.

:mod:`~kvforge.commands.cli` parses arguments and reports bad input as one line;
:mod:`~kvforge.commands.formatting` holds the display helpers the commands share.
"""
