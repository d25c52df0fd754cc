"""The kernels build here, and a build that fails is named: the suite cannot pass without them (tests/compiled.py),
and what it reports is the compiler's error, not ninja's last line."""
import pytest

from specdecode import kernels as compiled

from tests.compiled import SKIP_VARIABLE, kernels_or_skip

NINJA_OUTPUT = """Error building extension 'specdecode_quant_0123': [1/3] c++ -MMD -MF quant.o.d -O3 -march=native -c quant.cpp
FAILED: quant.o
quant.cpp:412:5: error: 'vpdpbusd' was not declared in this scope
  412 |     vpdpbusd(acc, a, b);
      |     ^~~~~~~~
ninja: build stopped: subcommand failed.
"""


def test_the_kernels_build_here():
    assert kernels_or_skip() is compiled.quant() is not None


@pytest.fixture
def broken_build(monkeypatch, tmp_path):
    """quant() building afresh into an empty folder, with a compiler that fails as a bad C++ edit would (a fresh
    cache of quant for the test; the process's own, holding the real build, comes back after it)."""
    import functools

    from torch.utils import cpp_extension

    def fail(**kwargs):
        raise RuntimeError(NINJA_OUTPUT)

    monkeypatch.setenv("SPECDECODE_KERNELS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(compiled, "_failure", None)
    monkeypatch.setattr(compiled, "quant", functools.cache(compiled.quant.__wrapped__))


def test_a_failed_build_names_the_compiler_error(broken_build, monkeypatch):
    assert compiled.quant() is None
    assert compiled.failure() == "RuntimeError: quant.cpp:412:5: error: 'vpdpbusd' was not declared in this scope"
    monkeypatch.delenv(SKIP_VARIABLE, raising=False)
    with pytest.raises(pytest.fail.Exception, match="did not build: RuntimeError: quant.cpp:412:5: error: 'vpdpbusd'"):
        kernels_or_skip()
    monkeypatch.setenv(SKIP_VARIABLE, "1")  # a machine without a compiler, said explicitly: the tests skip
    with pytest.raises(pytest.skip.Exception, match="not built here"):
        kernels_or_skip()
