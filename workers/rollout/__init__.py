"""Model rollout (docs/operations.md, Model rollout).

* :mod:`~workers.rollout.commands`: ``gnnstream rollout start|promote|rollback|retire|status``;
* :mod:`~workers.rollout.topic`: the rollout topic's records, and the view of a rollout they add up to;
* :mod:`~workers.rollout.records`: what a worker records, in its state and in the rollout topic;
* :mod:`~workers.rollout.cli`: the command line.

The streaming runtime imports only :mod:`~workers.rollout.records`; nothing here imports the runtime.
"""
