"""``genrm-trio bench``: side-by-side benchmarks, genrm-trio against NeMo Gym 0.7.0's
``genrm_compare``.

Every run starts fresh processes (mock judge, then the server under test) and drives them with
:mod:`genrm_trio.bench.loadgen`. Runs of one case alternate A B A B (ours, NeMo Gym, ours, ...)
so machine drift hits both; the summary reports medians per server and the per-pair ratio.

::

    run_bench(presets, ...)                    one trio task tree, nothing detached
      +-- for each case, for each pair: ours, then nemo
            +-- _rig(kind, ...)                nursery: mock judge process, server process,
            |                                  a stdout-draining task per process
            +-- case.run(rig)                  load generator tasks (loadgen.drive_load, ...)
      +-- write results.json, summary.md, *.png

Processes are ours to end: SIGTERM, a grace period, then SIGKILL. NeMo Gym lives in its own
venv (``~/.cache/genrm-trio/nemo-gym-0.7.0`` or ``$GENRM_NEMO_VENV``), created on demand
from a Python 3.13 under pyenv; without one its runs are skipped with a message.

The parts, lowest first (each imports only those above it)::

    records.py     the structs: settings, Case, RunRecord, CaseResult, BenchContext
    loadgen.py     the trio + h11 load generator
    processes.py   launching, readiness, stopping; programs from Debian packages
    wrk.py, haproxy.py, bare.py   the scale-out's wrk (C), HAProxy and bare ASGI app
    nemo_gym.py    NeMo Gym's venv and the config that starts its genrm_compare
    rig.py         one run's processes and clients (``_rig``)
    cases/         one module per preset family: load, judge_client, steady_state, release,
                   admission, scaleout, step, soak, flood (and measure: shared measurements)
    presets.py     the table: preset name -> cases, and the metrics each table shows
    report.py      medians, per-pair ratios, goal rows, the markdown summary
    plots.py       the PNG plots
    run.py         run_bench: the presets' cases A B A B, then results.json, summary.md, plots
    cli.py         ``genrm-trio bench``

A new preset: a case builder in ``cases/`` (a new module for a new family), then a line in
``presets.py``.
"""
