"""Trainer hooks: each trainer gets its rewards from genrm-trio cohorts through its own hook.

One module per trainer (``trl``, ``verl``, ``slime``), each installable as an extra
(``pip install 'genrm-trio[trl]'``, ``[verl]``; slime is not on PyPI and its hook imports none
of it) and importing its trainer lazily, inside the functions that need it, so
``import genrm_trio.integrations.trl`` works without TRL. They share one async
client, :mod:`genrm_trio.integrations.client`, which posts members to ``/verify`` with an
explicit group key, slot and attempt and waits as long as the server's own deadlines.

The arrows (``tests/test_layout.py``): nothing in ``server/``, ``caller/`` or the core imports
this package; it imports only the core. It talks to the server over HTTP, like the caller side.
Importing this package imports nothing else.
"""
