"""The ``mixprec`` command line: ``demo`` (the main job), ``bench``, ``check`` and ``report``.

* :mod:`~mixprec.cli.commands` -- argument parsing and the commands;
* :mod:`~mixprec.cli.demo` -- fp32 against mixed precision on MNIST-1D, side by side;
* :mod:`~mixprec.cli.progress` -- a progress bar (rich) or plain lines.

The benchmark harness behind ``mixprec bench`` lives in :mod:`mixprec.bench`.
"""

from mixprec.cli.commands import main

__all__ = ["main"]
