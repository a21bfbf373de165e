"""gnnstream: streaming dynamic-graph GNN inference.

Sub-packages (each installed from the top-level folder of the same name):

- ``gnnstream.stream``: Kafka I/O, the event schema and codecs, dead letters, the embedded dev broker;
- ``gnnstream.graph_state``: the RocksDB store, id handling, the sampler, dirty tracking;
- ``gnnstream.model``: pure torch layers, model directories, cold-start policies;
- ``gnnstream.workers``: the engine, the streaming runtime, the query service, rollout, offline jobs, the CLI;
- ``gnnstream.fraud``: the Bitcoin OTC fraud example, built on the others.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gnnstream")
except PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
