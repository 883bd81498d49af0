"""``python -m mixprec``: the ``mixprec`` command, for environments without the console script."""

from mixprec.cli.commands import main

raise SystemExit(main())
