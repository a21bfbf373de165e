"""graph_state."""
