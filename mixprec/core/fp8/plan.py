"""Temporary: removed at merge (old path of :mod:`mixprec.fp8.plan`)."""

from mixprec.fp8.plan import fp8_plan  # noqa: F401  temporary
