"""The fraud example: Bitcoin OTC ratings as graph events, a model and scoring head trained on them, the
scorer that reads the worker's embeddings, and the demo that runs it all."""
