"""``python -m mixprec.cli``: the ``mixprec`` command without the console script."""

from mixprec.cli.commands import main

raise SystemExit(main())
