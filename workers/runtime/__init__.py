"""The streaming runtime: :class:`~gnnstream.workers.runtime.worker.Worker` and the parts it wires together.

* :mod:`~gnnstream.workers.runtime.worker`: the worker's lifecycle and its loop, from poll to publish;
* :mod:`~gnnstream.workers.runtime.connect`: reaching Kafka at start, and the checks of what it holds;
* :mod:`~gnnstream.workers.runtime.batching`: the size of each poll, under a latency bound;
* :mod:`~gnnstream.workers.runtime.offsets`: the stored offsets and the offset-reset check;
* :mod:`~gnnstream.workers.runtime.markers`: the rollout-marker barrier;
* :mod:`~gnnstream.workers.runtime.dead_letters`: decoding, and the dead letters of invalid records;
* :mod:`~gnnstream.workers.runtime.group`: the group that shares out the output partitions;
* :mod:`~gnnstream.workers.runtime.publisher`: the outbox and the publisher thread;
* :mod:`~gnnstream.workers.runtime.health`: ``/healthz`` and the errors a retry may cure;
* :mod:`~gnnstream.workers.runtime.metrics`: the Prometheus metrics and the HTTP endpoint.
"""
