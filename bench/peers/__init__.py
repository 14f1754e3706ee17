"""offload beside the Python queues people use today: `python -m bench.peers` (see run.py)."""
