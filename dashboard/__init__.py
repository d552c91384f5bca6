"""`hsx dashboard`: a Flask app over the ledger (progress, workers, hosts, failures), with
rq-dashboard mounted at /rq, a JSON API at /api/status and Prometheus text at /metrics.

It reads Redis and writes only one thing: the retry of dead letters, on request.
"""
