"""The command-line tools: ``kvforge plan``, ``kvforge demo`` and ``kvforge bench``.

:mod:`~kvforge.cli.main` loads plugins and runs one command; :mod:`~kvforge.cli.args` parses
the command line and builds the model its options name; :mod:`~kvforge.cli.plan`,
:mod:`~kvforge.cli.demo` (with :mod:`~kvforge.cli.demo_sizing`,
:mod:`~kvforge.cli.demo_report` and :mod:`~kvforge.cli.demo_prefix`) and
:mod:`~kvforge.cli.bench` are the commands; :mod:`~kvforge.cli.formatting` holds the display
helpers and input checks they share, :mod:`~kvforge.cli.remotes` the rules of the remote tiers
``demo --tier`` and ``bench --tiers --remote`` take, and :mod:`~kvforge.cli.specs_file` the
checks of a ``plan --vllm-specs`` file.
"""
