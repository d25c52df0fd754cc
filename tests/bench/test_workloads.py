"""The shipped code workloads are what their generators make from the list of standard-library files beside them
(workloads/heldout.json), so a change to either shows here."""
import json
import sysconfig
from pathlib import Path

import pytest

from specdecode.bench import agentic_workload, workloads

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def files():
    made_on = json.loads((workloads.WORKLOAD_DIR / "heldout.json").read_text())["corpus"]
    if Path(made_on).name != STDLIB.name:
        pytest.skip(f"the workloads were made from {made_on}; this interpreter's library is {STDLIB}")
    return workloads.heldout_files()


def test_code_workloads_are_rebuilt_from_the_file_list(files):
    prompts = workloads.build_prompts(files, STDLIB)
    for name in workloads.WORKLOADS:
        assert prompts[name] == workloads.load_workload(name), name


def test_agentic_workload_is_rebuilt_from_the_file_list(files):
    assert agentic_workload.build(files, STDLIB) == agentic_workload.load()
