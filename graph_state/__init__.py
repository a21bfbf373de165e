"""The state layer: a worker's graph and embeddings in one RocksDB directory, with row files beside it (`docs/storage.md`)."""
