"""Offline jobs: what the command line does to a state or a file without the streaming worker.

Modules:
    jobs: ``graph load``, ``apply``, ``backfill``, ``embeddings`` and ``verify`` over a state directory.
    replay: ``produce`` (an event file into Kafka, paced) and ``tail`` (embedding updates, readably).
"""
