"""What a run is."""
