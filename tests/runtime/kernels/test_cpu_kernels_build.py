"""Building and loading llmc's CPU kernel library (runtime/kernels/cpu_kernels.py): the switch that turns it off or
pins an instruction set, and the fallbacks that name what is missing (a compiler, a source) instead of failing a
build or a served model. What the kernels compute: test_cpu_kernels.py."""

import logging

import pytest

from llmc.runtime.kernels import cpu_kernels

KERNELS = cpu_kernels.load()
ISAS = KERNELS.isas if KERNELS else ("avx2",)  # every kernel this CPU runs (AVX512 hosts run both)
needs_kernel = pytest.mark.skipif(KERNELS is None, reason="llmc's CPU kernel needs AVX2 + FMA or AVX512-VNNI, and a "
                                                          "C compiler (see the log)")


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.library() is None
    finally:
        monkeypatch.delenv(cpu_kernels.SWITCH)
        cpu_kernels.load.cache_clear()


@needs_kernel
def test_the_switch_pins_an_instruction_set_and_refuses_one_the_cpu_lacks(monkeypatch, caplog):
    try:
        monkeypatch.setenv(cpu_kernels.SWITCH, ISAS[-1])
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load().isa == ISAS[-1]
        monkeypatch.setenv(cpu_kernels.SWITCH, "neon")
        cpu_kernels.load.cache_clear()
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert cpu_kernels.load() is None
        assert "LLMC_CPU_KERNELS=neon" in caplog.text and ISAS[0] in caplog.text
    finally:
        monkeypatch.delenv(cpu_kernels.SWITCH)
        cpu_kernels.load.cache_clear()


def test_a_missing_compiler_falls_back_with_a_warning_that_names_it(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "llmc-no-such-cc")
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))  # nothing prebuilt here
    (tmp_path / "cpu_kernels.c").write_text("/* a source no library was built from */\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", tmp_path / "cpu_kernels.c")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (tmp_path / "cpu_kernels.c",))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert cpu_kernels.library() is None
        assert "llmc-no-such-cc" in caplog.text and "set CC" in caplog.text
        assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written
    finally:
        cpu_kernels.load.cache_clear()


def test_a_compile_error_is_reported_with_the_compilers_message(monkeypatch, tmp_path):
    source = tmp_path / "cpu_kernels.c"
    source.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source,))
    with pytest.raises(RuntimeError, match="failed on cpu_kernels.c"):
        cpu_kernels.build(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))


def test_a_missing_source_falls_back_instead_of_failing(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "SOURCES", (tmp_path / "gone.c",))
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.library() is None
    finally:
        cpu_kernels.load.cache_clear()
