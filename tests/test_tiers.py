"""The unit tier (`pytest -m "not e2e"`): tests that start a program are marked e2e by tests/conftest.py; and the
tests that read one run share a worker under pytest-xdist."""

from __future__ import annotations

import os

import pytest
from conftest import _runs_a_program, run_python


def _helper_that_runs_a_script():
    return run_python("algos/dqn.py", "--help")


def _pure_helper(x):
    return x + 1


def test_a_test_that_runs_a_program_through_a_helper_is_end_to_end():
    def test_like():
        return _helper_that_runs_a_script()

    assert _runs_a_program(test_like, set())


def test_a_test_of_pure_code_is_a_unit_test():
    def test_like():
        return _pure_helper(1) == 2

    assert not _runs_a_program(test_like, set())


@pytest.fixture(scope="session", params=["a"])
def shared_value(request) -> str:
    return request.param


def test_the_tests_that_read_one_run_are_sent_to_one_worker(request, shared_value):
    """Under ``--dist loadgroup``, conftest's group must reach pytest-xdist's scheduler as the nodeid's "@group"
    suffix, or each worker makes the shared runs again. Each of these once dropped the groups silently (the whole
    suite ran the toy and Breakout runs up to twice): marks set after pytest-xdist's own hook had read them, a
    group name with "]" (xdist reads a group only after the nodeid's last "]"), and pytest 9, which ignores the
    suffix pytest-xdist 3.8 writes (hence pytest<9 in the test extra)."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not request.config.getvalue("loadgroup"):
        pytest.skip("not under pytest-xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@test_tiers shared_value a"), request.node.nodeid
