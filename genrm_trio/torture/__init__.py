"""``genrm-trio torture``: randomized lifecycle schedules, checked against the contract.

Two drivers share one idea: throw arrivals, duplicates, conflicting answers, client disconnects,
newer and older attempts, deadlines, judge faults and shutdown at a server, then check that every
request got exactly one answer, that every answer is a full-cohort reward for its own slot or an
explicit failure of the contract's kinds, that rewards equal a reference computation, and that
nothing is left behind.

::

    Schedule (frozen ops)  --run_schedule-->  in-process CohortRegistry, scripted judge,
       |                                      autojump clock: Report(violations, ...)
       +-- generate_schedule(rng)             seeded; shrink_schedule() cuts a failing one down
    run_http_torture(url, judge_url)      --> a live server over HTTP (ours or any server speaking
                                              the protocol) with the mock judge's fault injection

Lifetimes: :func:`run_schedule` opens two nurseries, one that the registry spawns its cohorts
into and one for the request tasks; both are empty when it returns (that is one of the checks).
:func:`run_http_torture` owns its HTTP client and one nursery per round. Nothing here keeps
module-level mutable state.

The parts, lowest first (each imports only those above it)::

    schedules.py       the operations, Schedule, generate_schedule
    contract.py        failure kinds by status, request bodies, reference rewards
    scripted_judge.py  the local driver's judge
    shrink.py          shrink_schedule
    local.py           run_schedule, run_local: in process, virtual time
    fuzz.py            malformed bodies from the OpenAPI schemas
    http.py            run_http_torture: a live server over HTTP
    cli.py             ``genrm-trio torture``
"""
