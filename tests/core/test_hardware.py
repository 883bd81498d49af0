"""Tests for mixprec._core.hardware: detection rules on faked inputs, this machine, warnings."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mixprec._core import hardware as hw
from mixprec._core.hardware import DtypeSupport, HardwareReport, MixprecPerformanceWarning

REPO = Path(__file__).resolve().parents[2]


def _cpu_report(*flags: str) -> HardwareReport:
    return HardwareReport("cpu", "fake CPU", tuple(flags), hw._cpu_support(frozenset(flags)))


@pytest.fixture(autouse=True)
def _fresh_warnings():
    hw._reset_warnings()
    yield
    hw._reset_warnings()


# --- CPU rules on faked flags --------------------------------------------------------------


def test_cpu_no_flags_bf16_slow_and_best_is_fp32():
    report = _cpu_report()
    bf16, fp16 = report.dtypes["bfloat16"], report.dtypes["float16"]
    assert bf16.supported and not bf16.fast
    assert fp16.supported and not fp16.fast
    assert bf16.dtype is torch.bfloat16 and fp16.dtype is torch.float16
    assert "no AVX512_BF16/AMX-BF16" in bf16.reason
    assert "no AVX512_FP16/AMX-FP16" in fp16.reason
    assert report.best_dtype is torch.float32


def test_cpu_avx512_bf16_only_bf16_fast():
    report = _cpu_report("avx512f", "avx512_bf16")
    assert report.dtypes["bfloat16"].fast
    assert "AVX512_BF16" in report.dtypes["bfloat16"].reason
    assert not report.dtypes["float16"].fast
    assert report.best_dtype is torch.bfloat16


def test_cpu_amx_bf16_reason_names_amx():
    report = _cpu_report("avx512_bf16", "amx_tile", "amx_bf16")
    assert report.dtypes["bfloat16"].fast
    assert "AMX-BF16" in report.dtypes["bfloat16"].reason


def test_cpu_amx_fp16_fp16_fast():
    report = _cpu_report("amx_tile", "amx_fp16")
    assert report.dtypes["float16"].fast
    assert "AMX-FP16" in report.dtypes["float16"].reason
    assert report.best_dtype is torch.float16  # bf16 not fast with these flags alone
    both = _cpu_report("amx_bf16", "amx_fp16")
    assert both.best_dtype is torch.bfloat16  # bf16 preferred when both are fast


def test_cpu_avx512_fp16_alone_not_fast():
    fp16 = _cpu_report("avx512f", "avx512_fp16").dtypes["float16"]
    assert fp16.supported and not fp16.fast
    assert "AVX512_FP16 present" in fp16.reason


def test_parse_cpuinfo():
    text = (
        "processor\t: 0\nmodel name\t: Fake CPU @ 3GHz\nflags\t\t: fpu avx512f amx_bf16\n"
        "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n"
    )
    assert hw._parse_cpuinfo(text) == ("Fake CPU @ 3GHz", frozenset({"fpu", "avx512f", "amx_bf16"}))
    assert hw._parse_cpuinfo("") == ("", frozenset())


# --- CUDA rules on faked capabilities ------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "bf16_supported", "fp16_fast", "bf16_fast", "best"),
    [
        ((6, 1), False, False, False, torch.float32),
        ((7, 0), True, True, False, torch.float16),
        ((7, 5), True, True, False, torch.float16),
        ((8, 0), True, True, True, torch.bfloat16),
        ((9, 0), True, True, True, torch.bfloat16),
    ],
)
def test_cuda_rules(capability, bf16_supported, fp16_fast, bf16_fast, best):
    dtypes = hw._cuda_support(capability, bf16_supported)
    assert dtypes["float16"].supported
    assert dtypes["float16"].fast is fp16_fast
    assert dtypes["bfloat16"].supported is bf16_supported
    assert dtypes["bfloat16"].fast is bf16_fast
    report = HardwareReport("cuda:0", "fake GPU", (f"sm_{capability[0]}{capability[1]}",), dtypes)
    assert report.best_dtype is best


def test_cuda_reasons():
    assert hw._cuda_support((7, 5), True)["bfloat16"].reason == (
        "compute capability 7.5 < 8.0: no bf16 tensor cores"
    )
    assert "7.0 >= 7.0" in hw._cuda_support((7, 0), True)["float16"].reason
    assert "is_bf16_supported() is False" in hw._cuda_support((6, 1), False)["bfloat16"].reason
    # Capability alone is not enough: bf16 must also be supported to be fast.
    assert not hw._cuda_support((8, 0), False)["bfloat16"].fast


def test_other_devices_not_characterised():
    report = hw.check("mps", verbose=False)
    assert report.device == "mps"
    for support in report.dtypes.values():
        assert support.supported and not support.fast
        assert "not characterised" in support.reason
    assert report.best_dtype is torch.float32
    assert hw.default_dtype("mps") is torch.bfloat16


# --- this machine --------------------------------------------------------------------------


def test_this_machine_cpu():
    """Whatever this CPU is (the CI machine changes; AVX2-only ones included, where bf16 is not
    fast): the report follows its usable flags."""
    report = hw.check("cpu", verbose=False)
    assert report.device == "cpu"
    assert report.name
    fast_bf16 = bool({"avx512_bf16", "amx_bf16"} & set(report.features))
    assert report.dtypes["bfloat16"].supported
    assert report.dtypes["bfloat16"].fast == fast_bf16
    assert report.best_dtype is (
        torch.bfloat16
        if fast_bf16
        else torch.float16
        if report.dtypes["float16"].fast
        else torch.float32
    )
    if "amx_bf16" in report.features:
        assert "AMX-BF16" in report.dtypes["bfloat16"].reason
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":
        assert not fast_bf16  # the cap takes the bf16 units away


def test_check_accepts_str_device_and_none_and_caches():
    a = hw.check("cpu", verbose=False)
    assert hw.check(torch.device("cpu"), verbose=False) is a
    assert hw.check("cpu:0", verbose=False) is a
    if not torch.cuda.is_available():
        assert hw.check(verbose=False) is a
    assert isinstance(a.dtypes["bfloat16"], DtypeSupport)


def test_check_verbose_prints_table(capsys):
    report = hw.check("cpu", verbose=True)
    out = capsys.readouterr().out
    assert out.strip() == str(report)
    assert hw.check("cpu", verbose=False) is report
    assert capsys.readouterr().out == ""


def test_str_contains_dtype_names():
    text = str(_cpu_report("avx512_bf16"))
    assert "bfloat16" in text and "float16" in text
    assert "best dtype: torch.bfloat16" in text
    assert len(text.splitlines()) >= 5


def test_report_is_frozen():
    report = _cpu_report()
    with pytest.raises(AttributeError):
        report.device = "cuda"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        report.dtypes["float16"].fast = True  # type: ignore[misc]


# --- devices ---------------------------------------------------------------------------------


def test_bad_device_string():
    with pytest.raises(ValueError, match=r"'tpu9'.*expected None, a torch.device.*'cpu'"):
        hw.check("tpu9", verbose=False)


def test_bad_device_type():
    with pytest.raises(TypeError, match="got float"):
        hw.check(1.5, verbose=False)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_unavailable():
    with pytest.raises(RuntimeError, match="is_available"):
        hw.check("cuda", verbose=False)


# --- default_dtype -------------------------------------------------------------------------


def test_default_dtype_cpu():
    assert hw.default_dtype("cpu") is torch.bfloat16


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        ((6, 1), torch.float16),
        ((7, 0), torch.float16),
        ((7, 5), torch.float16),
        ((8, 0), torch.bfloat16),
        ((9, 0), torch.bfloat16),
    ],
)
def test_default_dtype_cuda_faked(monkeypatch, capability, expected):
    dtypes = hw._cuda_support(capability, capability >= (8, 0))
    fake = HardwareReport("cuda:0", "fake GPU", (), dtypes)
    monkeypatch.setattr(hw, "_resolve_device", lambda device: "cuda:0")
    monkeypatch.setattr(hw, "_report", lambda device: fake)
    assert hw.default_dtype("cuda") is expected


# --- warn_if_slow --------------------------------------------------------------------------


def _fake_cpu(monkeypatch, *flags: str) -> None:
    fake = _cpu_report(*flags)
    monkeypatch.setattr(hw, "_report", lambda device: fake)


def test_warn_once(monkeypatch):
    _fake_cpu(monkeypatch)  # no bf16/fp16 units: both slow, nothing to suggest but fp32
    with pytest.warns(MixprecPerformanceWarning) as record:
        hw.warn_if_slow(torch.float16, "cpu")
    message = str(record[0].message)
    assert "torch.float16" in message and "cpu" in message
    assert "no AVX512_FP16/AMX-FP16" in message
    assert "Suggested alternative: torch.float32" in message
    assert record[0].filename == __file__  # stacklevel points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hw.warn_if_slow(torch.float16, "cpu")
        hw.warn_if_slow(torch.float16, torch.device("cpu"))
    with pytest.warns(MixprecPerformanceWarning):  # a different dtype warns on its own
        hw.warn_if_slow(torch.bfloat16, "cpu")
    hw._reset_warnings()
    with pytest.warns(MixprecPerformanceWarning):
        hw.warn_if_slow(torch.float16, "cpu")


def test_warn_suggests_default_dtype(monkeypatch):
    _fake_cpu(monkeypatch, "avx512_fp16", "amx_bf16")
    with pytest.warns(MixprecPerformanceWarning, match="Suggested alternative: torch.bfloat16"):
        hw.warn_if_slow(torch.float16, "cpu")


def test_no_warning_when_fast_or_not_16_bit(monkeypatch):
    _fake_cpu(monkeypatch, "amx_bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hw.warn_if_slow(torch.bfloat16, "cpu")
        hw.warn_if_slow(torch.float32, "cpu")
        hw.warn_if_slow(torch.float64, "cpu")


def test_warning_category_is_user_warning():
    assert issubclass(MixprecPerformanceWarning, UserWarning)


# --- import does not touch CUDA ------------------------------------------------------------


def test_import_does_not_initialize_cuda():
    code = (
        "import torch, torch.cuda\n"
        "calls = []\n"
        "def trap(*a, **k):\n"
        "    calls.append('cuda init')\n"
        "    raise RuntimeError('CUDA touched at import')\n"
        "torch.cuda._lazy_init = trap\n"
        "torch.cuda.init = trap\n"
        "import mixprec._core.hardware\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialized'\n"
        "assert not calls, calls\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_an_isa_cap_below_bf16_makes_bf16_slow():
    from mixprec._core.hardware import _cpu_support, _usable_flags

    flags = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert _usable_flags(flags, "") == flags
    assert _usable_flags(flags, "avx512_core_amx") == flags
    capped = _usable_flags(flags, "AVX2")
    assert capped == frozenset({"avx2", "avx512f"})
    assert not _cpu_support(capped)["bfloat16"].fast and _cpu_support(flags)["bfloat16"].fast
