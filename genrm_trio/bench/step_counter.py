"""Count a server's trio task steps, for the side-by-side bench (``--side steps=1``).

A task step is one run of a task between two schedule points: what trio's scheduler does per
request, a count that the machine's speed and load do not change (two runs of the same code on
the same load give the same steps per verify within a percent, where its CPU time moves by ten).

Self-contained on purpose (the standard library and trio only): the bench copies this file as
``sitecustomize.py`` into a folder it puts first on each server's ``PYTHONPATH``, so it also
counts an earlier commit's server, which has no such module. There, when
:data:`COUNT_FILE_ENV` names a file, :func:`install` wraps ``trio.run`` to add the counting
instrument and maps ``SIGUSR2`` to writing the count so far into that file (whole, by a
rename). Nothing happens without the variable.
"""

from __future__ import annotations

import os
import signal
from typing import Any

#: The environment variable naming the file the count is written to on ``SIGUSR2``.
COUNT_FILE_ENV = "GENRM_STEP_COUNT_FILE"


def install() -> None:
    """Count every task step of every ``trio.run`` in this process from now on, and write
    the total to the file :data:`COUNT_FILE_ENV` names on each ``SIGUSR2``."""
    path = os.environ.get(COUNT_FILE_ENV)
    if not path:
        return
    import trio

    class StepCounter(trio.abc.Instrument):
        def __init__(self) -> None:
            self.steps = 0

        def before_task_step(self, task: Any) -> None:
            self.steps += 1

    counter = StepCounter()

    def write_count(_signum: int, _frame: Any) -> None:
        partial = f"{path}.partial"
        with open(partial, "w", encoding="ascii") as out:
            out.write(str(counter.steps))
        os.replace(partial, path)

    signal.signal(signal.SIGUSR2, write_count)
    run = trio.run

    def counted_run(*args: Any, **kwargs: Any) -> Any:
        kwargs["instruments"] = (*kwargs.get("instruments", ()), counter)
        return run(*args, **kwargs)

    trio.run = counted_run  # type: ignore[assignment]


if __name__ == "sitecustomize":
    install()
