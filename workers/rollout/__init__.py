"""Model rollout (docs/operations.md, Model rollout).

* :mod:`~gnnstream.workers.rollout.commands`: ``gnnstream rollout start|promote|rollback|retire|status``;
* :mod:`~gnnstream.workers.rollout.topic`: the rollout topic's records, and the view of a rollout they add up to;
* :mod:`~gnnstream.workers.rollout.records`: what a worker records, in its state and in the rollout topic;
* :mod:`~gnnstream.workers.rollout.cli`: the command line.

The streaming runtime imports only :mod:`~gnnstream.workers.rollout.records`; nothing here imports the runtime.
"""
