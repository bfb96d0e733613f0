"""The mock judge: a fault-injecting, OpenAI-compatible fake GenRM judge, and the mock-policy
command line. A tool: it imports the core (and, for ``mock-policy``, the caller's embedded
mock policy), nothing from ``server``.

The parts, lowest first (each imports only those above it)::

    http.py       h11 plumbing: routes, one request, JSON and error bodies, send_response
    prefix_cache.py  the engine's prefix cache model: tokenizer rule, chained block keys, LRU
    faults.py     Fault, the random mix, the text faults and the wire faults (answer_with_fault)
    settings.py   MockJudgeSettings (validated) and MockJudgeState (counters, the fault plan)
    inputs.py     what a judge call asks, read from a Responses or Chat Completions body
    verdicts.py   the deterministic verdict, shaped as asked, in the API's response object
    judge.py      the server: connections, routing, the capacity limit (run_mock_judge)
    cli.py        ``genrm-trio mock-judge`` (``python -m genrm_trio.mock.cli``)
    policy.py     ``genrm-trio mock-policy``

A new fault: :mod:`genrm_trio.mock.faults` (a member of ``Fault``, then its text or its branch
in ``answer_with_fault``).
"""
