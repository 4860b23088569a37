"""Hub side."""
