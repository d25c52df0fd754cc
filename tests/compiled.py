"""The compiled kernels, for the tests that need them. Where they do not build, such a test fails naming the build
error: a C++ edit that does not compile must not turn the kernel and paged tests into skips and the suite green
(the product would then run dequantized weights unnoticed). A machine without a compiler says so explicitly with
SPECDECODE_SKIP_KERNELS=1, and those tests skip; .ci/run never sets it."""
import os

import pytest

from specdecode import kernels as compiled

SKIP_VARIABLE = "SPECDECODE_SKIP_KERNELS"


def kernels_or_skip():
    """The compiled module; else a skip under SPECDECODE_SKIP_KERNELS=1, and a failure naming the build error
    without it."""
    module = compiled.quant()
    if module is not None:
        return module
    if os.environ.get(SKIP_VARIABLE) == "1":
        pytest.skip(f"the quantized kernels are not built here ({SKIP_VARIABLE}=1): {compiled.failure()}")
    pytest.fail(f"the quantized kernels did not build: {compiled.failure()} (on a machine without a C++ compiler, "
                f"{SKIP_VARIABLE}=1 skips the tests that need them)", pytrace=False)
