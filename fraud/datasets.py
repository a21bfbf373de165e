"""The SNAP networks the example reads, shipped with the repository (gzip; see ``data/README.md``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DATA_DIR", "BITCOIN_OTC", "BITCOIN_ALPHA"]

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
BITCOIN_OTC = DATA_DIR / "soc-sign-bitcoinotc.csv.gz"
BITCOIN_ALPHA = DATA_DIR / "soc-sign-bitcoinalpha.csv.gz"
