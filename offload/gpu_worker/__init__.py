"""The GPU-machine worker (`offload worker --handler`): runs the user's handler on a rented machine and speaks
only HTTP to the server, with a worker key scoped to its queues (never to Redis).

loop.py (claims, heartbeats, the handler's runs, shutdown) · server_api.py (the server's worker routes, with
retry) · job_files.py (a job's files, through URLs the server signed). A handler imports what it uses from here:
`from offload.gpu_worker import JobContext, PermanentError`.
"""

from offload.gpu_worker.loop import JobContext, PermanentError

__all__ = ["JobContext", "PermanentError"]
