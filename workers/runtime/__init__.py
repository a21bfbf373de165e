"""The streaming runtime: :class:`~workers.runtime.worker.Worker` and the parts it wires together.

* :mod:`~workers.runtime.worker`: the worker's lifecycle and its loop, from poll to publish;
* :mod:`~workers.runtime.connect`: reaching Kafka at start, and the checks of what it holds;
* :mod:`~workers.runtime.offsets`: the stored offsets and the offset-reset check;
* :mod:`~workers.runtime.markers`: the rollout-marker barrier;
* :mod:`~workers.runtime.dead_letters`: decoding, and the dead letters of invalid records;
* :mod:`~workers.runtime.group`: the group that shares out the output partitions;
* :mod:`~workers.runtime.publisher`: the outbox and the publisher thread;
* :mod:`~workers.runtime.health`: ``/healthz`` and the errors a retry may cure;
* :mod:`~workers.runtime.metrics`: the Prometheus metrics and the HTTP endpoint.
"""
