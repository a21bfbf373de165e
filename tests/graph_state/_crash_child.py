"""Child process of ``test_crash``: apply the deterministic batches, resuming at the stored offset.

Run as ``python -m tests.graph_state._crash_child PATH``. Prints ``started O``
once the store is open, ``applied O`` after each batch is durable, and
``finished`` at the end.
"""

from __future__ import annotations

import sys

from gnnstream.graph_state.store import GraphStore
from tests.graph_state._events import random_batches

N_BATCHES = 200
BATCH_SIZE = 50
STREAM_SEED = 1234
STORE_SEED = 7
FANOUTS = (1, 3, 10)
PARTITION = ("events", 0)


def batches() -> list[list]:
    return random_batches(STREAM_SEED, N_BATCHES, BATCH_SIZE)


def main(path: str) -> None:
    stream = batches()
    store = GraphStore(path, seed=STORE_SEED)
    store.set_fanouts(FANOUTS)
    start = store.offsets().get(PARTITION, 0)
    if start % BATCH_SIZE:
        raise SystemExit(f"stored offset {start} is not a batch boundary")
    print(f"started {start}", flush=True)
    for b in range(start // BATCH_SIZE, N_BATCHES):
        store.apply(stream[b], {PARTITION: (b + 1) * BATCH_SIZE})
        print(f"applied {(b + 1) * BATCH_SIZE}", flush=True)
    store.close()
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
