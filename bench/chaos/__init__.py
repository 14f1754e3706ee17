"""The fault harness: `python -m bench.chaos [--quick] [--minutes N]` runs real workers, a producer, Valkey, S3 and
the simulator with faults injected everywhere (a RESP-aware TCP proxy in front of Valkey, SIGKILL / SIGSTOP of
workers, restarts with the same host:pid in a PID namespace, Valkey crashes, provider 5xx / 429 storms / slow and
lost submits / expiring results), then checks every guarantee from the job store, the simulator's submission log
and the bucket. Modules: proxy (the TCP fault proxy), procs (the processes), faults (the schedule), run (the
command line and one run: producer, operator, settle, collect), checker (the invariants: rundata, check_outputs,
check_resends, resend_cause, check_store), autoscale (the server killed mid-provisioning)."""
