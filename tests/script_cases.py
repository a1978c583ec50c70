"""Run one algorithm script once per command line, all in one Python process, each as ``python algos/NAME.py
FLAGS`` would run it (the script's own code, as ``__main__``), and write each one's exit status, standard output
and standard error as JSON.

The bad-input tests use it: a bad flag stops a script before anything large is allocated, so one interpreter
(one import of torch and the games, about 3 s) serves a whole table of cases instead of one each. A command line
that is not stopped within --seconds is reported as accepted (exit status None), not left to train.

    python tests/script_cases.py algos/dqn.py CASES.json OUT.json   # CASES.json: a list of argument lists
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import signal
import sys
import traceback
import warnings


class StillRunning(BaseException):
    """raised by the alarm when a command line was accepted and the script went on"""


def run_case(script: str, argv: list[str], seconds: int) -> dict:
    out, err = io.StringIO(), io.StringIO()
    status: int | None = 0

    def too_long(signum, frame):
        raise StillRunning

    signal.signal(signal.SIGALRM, too_long)
    sys.argv = [script, *argv]
    # warnings are shown afresh for each case, as in a new process
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        signal.alarm(seconds)
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:  # as the interpreter turns SystemExit into an exit status
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except StillRunning:
            status = None
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            signal.alarm(0)
    return {"argv": argv, "status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script")
    parser.add_argument("cases", help="a JSON file: a list of argument lists")
    parser.add_argument("out", help="where the JSON list of results goes")
    parser.add_argument("--seconds", type=int, default=60, help="how long a case may run before it counts as accepted")
    options = parser.parse_args()
    with open(options.cases) as file:
        cases = json.load(file)
    results = [run_case(options.script, argv, options.seconds) for argv in cases]
    with open(options.out, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main()
