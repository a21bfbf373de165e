"""Offline jobs: what the command line does to a state or a file without the streaming worker.

Modules:
    jobs: ``graph load``, ``apply``, ``backfill``, ``embeddings`` and ``verify`` over a state directory.
    replay: ``produce`` (an event file into Kafka, paced) and ``tail`` (embedding updates, readably).
    train: ``gnnstream train``: a GNN and a scoring head trained on an event file and a labels file.
    commands: the command line of ``model init``, ``model import``, ``model export`` and ``train``.
"""
