"""Temporary: removed at merge (old path of :mod:`mixprec.fp8.choice`)."""

from mixprec.fp8.choice import FP8Plan  # noqa: F401  temporary
