"""Every warning class mixprec emits, in one public place.

    import warnings
    from mixprec.warnings import MixprecPerformanceWarning, MixprecWarning

    warnings.simplefilter("ignore", MixprecPerformanceWarning)  # slow-path notices only
    warnings.simplefilter("error", MixprecWarning)  # or: every mixprec warning an error

:class:`MixprecWarning` is the base of them all (a ``UserWarning``);
:class:`MixprecNumericsWarning` is also a ``RuntimeWarning``. :mod:`mixprec.amp` mirrors
``torch.amp`` and warns with torch's classes.
"""

from mixprec._core._warnings import (
    MixprecNumericsWarning,
    MixprecPerformanceWarning,
    MixprecWarning,
)

__all__ = ["MixprecNumericsWarning", "MixprecPerformanceWarning", "MixprecWarning"]
