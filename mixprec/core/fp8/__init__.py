"""Temporary: removed at merge. The old path of :mod:`mixprec.fp8`, kept only for
``mixprec/core/initialize.py`` and ``mixprec/__init__.py`` until they import the new one."""

from mixprec.fp8 import layers  # noqa: F401  temporary: removed at merge
