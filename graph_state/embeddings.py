"""The embedding state's names as the rest of the code imports them.

The parts live in their own modules: the row cache (:mod:`graph_state.row_cache`),
page logs (:mod:`graph_state.page_log`), row files (:mod:`graph_state.row_file`)
and the value layouts (:mod:`graph_state.codecs`).
"""

from __future__ import annotations

from gnnstream.graph_state.codecs import PAGE_ROWS, decode_outbox, decode_page, encode_outbox, encode_pages
from gnnstream.graph_state.page_log import (SUPERSEDED_SHARE, EmbeddingMeta, FrameReused, PageLog, layer_logs_from,
                                            read_final_rows)
from gnnstream.graph_state.row_cache import EmbeddingTables
from gnnstream.graph_state.row_file import RowFile, RowReaders

__all__ = ["EmbeddingTables", "PageLog", "MetaTable", "EmbeddingMeta", "FrameReused", "read_final_rows",
           "layer_logs_from", "encode_pages", "decode_page", "PAGE_ROWS", "SUPERSEDED_SHARE", "encode_outbox",
           "decode_outbox", "RowFile", "RowReaders"]

MetaTable = PageLog  # the name workers/ and their tests import
_FrameFile, _Readers = RowFile, RowReaders  # the names bench/memory.py and tests/workers import
