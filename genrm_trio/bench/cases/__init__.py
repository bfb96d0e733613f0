"""One module per preset family; each builds :class:`~genrm_trio.bench.records.Case` values
that :mod:`genrm_trio.bench.presets` lists. ``measure`` holds what several families measure alike.
"""
