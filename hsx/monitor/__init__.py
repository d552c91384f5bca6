"""What status, the dashboard and /metrics show."""
