"""The delivery process's encoding cost per update, per output format (no broker).

``python -m bench.codecs [--nodes N] [--dim D] [--partitions P] [--repeat R]`` encodes one batch of update
columns the way :class:`gnnstream.stream.delivery.Delivery` does (JSON and binary: ``encode_columns``;
packed: ``encode_frames`` into frames of at most 1 MB) and prints JSON: per format the CPU time per update
(best of ``--repeat``), the bytes per update and the messages.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np

from gnnstream.stream.clients import MAX_MESSAGE_BYTES
from gnnstream.stream.delivery import UpdateColumns, encode_columns, encode_frames

__all__ = ["measure", "main"]

logger = logging.getLogger(__name__)


def measure(nodes: int, dim: int, partitions: int, repeat: int) -> dict[str, dict[str, float]]:
    """``{format: {"cpu_us_per_update", "bytes_per_update", "messages"}}`` of one batch of ``nodes`` updates."""
    rng = np.random.default_rng(0)
    cols = UpdateColumns([str(i) for i in range(nodes)], rng.integers(1, 2**40, nodes),
                         rng.uniform(1.4e9, 1.5e9, nodes), time.time(), ["full"] * nodes,
                         rng.normal(size=(nodes, dim)).astype(np.float32), np.zeros(nodes, dtype=bool))
    runs = {"json": lambda: [v for _, v, _ in encode_columns([cols], "otc-sage:1", "json")],
            "binary": lambda: [v for _, v, _ in encode_columns([cols], "otc-sage:1", "binary")],
            "packed": lambda: [v for _, _, v in encode_frames([cols], "otc-sage:1", partitions,
                                                              MAX_MESSAGE_BYTES - 2048)]}
    out = {}
    for name, run in runs.items():
        best = float("inf")
        for _ in range(repeat):
            t0 = time.process_time()
            values = run()
            best = min(best, time.process_time() - t0)
        out[name] = {"cpu_us_per_update": round(best / nodes * 1e6, 3),
                     "bytes_per_update": round(sum(map(len, values)) / nodes, 1), "messages": len(values)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    result = {"nodes": args.nodes, "dim": args.dim, "partitions": args.partitions,
              "formats": measure(args.nodes, args.dim, args.partitions, args.repeat)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
