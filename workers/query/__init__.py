"""The query service: HTTP/JSON answers from a worker's state, in a process of its own.

Modules:
    state: :class:`QueryState`, lookups and exact what-ifs from a RocksDB follower of the state.
    server: the HTTP application, its process beside the worker (:class:`QueryProcess`) and ``gnnstream serve``.
    limits: :class:`HttpLimits`, the header and body timeouts and the connection bound.
"""
