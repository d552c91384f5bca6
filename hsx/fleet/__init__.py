"""The processes that serve runs."""
