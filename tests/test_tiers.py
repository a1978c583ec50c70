"""The unit tier (`pytest -m "not e2e"`): tests that start a program are marked e2e by tests/conftest.py."""

from __future__ import annotations

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
