"""Temporary: removed at merge (old path of :mod:`mixprec.fp8.config`)."""

from mixprec.fp8.config import FP8Config, as_fp8_config  # noqa: F401  temporary
