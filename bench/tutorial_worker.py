"""The tutorial's worker.py, minimal and faithful, as the baseline `bench/inflight.py` measures offload against:
one job at a time, BLPOP, the INCR/EXPIRE daily cap, POST {base}/jobs, GET {base}/jobs/{id} every poll
interval, the output written to a file (for its S3 put_object), retry by re-push after a sleep, dead-letter list.
httpx stands in for requests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import redis


class WindowOver(Exception):
    """The measurement window ended while a job was still running."""


class TutorialWorker:
    """The tutorial's loop, stopped at `until` (time.monotonic()); `run` returns the monotonic time of each
    completion."""

    def __init__(
        self,
        redis_url: str,
        queue_key: str,
        api_base: str,
        api_key: str,
        result_dir: Path,
        *,
        until: float,
        poll_interval: float = 1.0,
        poll_timeout: float = 600.0,
        max_attempts: int = 3,
        daily_job_cap: int = 1_000_000,
    ) -> None:
        self.queue_key, self.api_base, self.result_dir, self.until = queue_key, api_base, result_dir, until
        self.poll_interval, self.poll_timeout = poll_interval, poll_timeout
        self.max_attempts, self.daily_job_cap = max_attempts, daily_job_cap
        self.queue = redis.Redis.from_url(redis_url)
        self.http = httpx.Client(headers={"Authorization": f"Bearer {api_key}"})

    def run(self) -> list[float]:
        done: list[float] = []
        queue, queue_key, until = self.queue, self.queue_key, self.until
        try:
            while time.monotonic() < until:
                item = queue.blpop([queue_key], timeout=1)
                if item is None:
                    continue
                job = json.loads(item[1])
                attempt = job.get("attempt", 1)
                if not self.within_budget():
                    queue.rpush(f"{queue_key}:held", json.dumps(job))
                    time.sleep(min(60, max(until - time.monotonic(), 0)))
                    continue
                try:
                    self.store(job, self.poll(self.submit(job)))
                    done.append(time.monotonic())
                except WindowOver:
                    break
                except Exception as error:
                    self.retry_or_bury(job, attempt, error)
        finally:
            self.http.close()
            queue.close()
        return done

    def retry_or_bury(self, job: dict[str, Any], attempt: int, error: Exception) -> None:
        if attempt < self.max_attempts:
            job["attempt"] = attempt + 1
            time.sleep(min(2**attempt, max(self.until - time.monotonic(), 0)))
            self.queue.rpush(self.queue_key, json.dumps(job))
        else:
            self.queue.rpush(f"{self.queue_key}:dead", json.dumps({"job": job, "error": str(error)}))

    def within_budget(self) -> bool:
        day = time.strftime("%Y%m%d")
        used = self.queue.incr(f"{self.queue_key}:spend:{day}")
        self.queue.expire(f"{self.queue_key}:spend:{day}", 172800)
        return int(used) <= self.daily_job_cap

    def submit(self, job: dict[str, Any]) -> str:
        response = self.http.post(f"{self.api_base}/jobs", json=job["input"], timeout=30)
        response.raise_for_status()
        return str(response.json()["id"])

    def poll(self, remote_id: str) -> Any:
        deadline = time.monotonic() + self.poll_timeout
        while time.monotonic() < deadline:
            response = self.http.get(f"{self.api_base}/jobs/{remote_id}", timeout=30)
            response.raise_for_status()
            body = response.json()
            if body["status"] == "succeeded":
                return body["output"]
            if body["status"] == "failed":
                raise RuntimeError(f"remote job {remote_id} failed")
            if time.monotonic() + self.poll_interval > self.until:
                raise WindowOver
            time.sleep(self.poll_interval)
        raise TimeoutError(f"remote job {remote_id} did not finish in time")

    def store(self, job: dict[str, Any], output: Any) -> str:
        path = self.result_dir / job["output_key"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(json.dumps(output).encode())
        return str(job["output_key"])


def run_tutorial(redis_url: str, sim_url: str, workdir: Path, window: float, latency: float) -> tuple[int, float]:
    """Fill the tutorial's list (its producer's JSON) with more jobs than the window can take, run the loop for
    `window` seconds; the rate is completions over the time of the last one (a partly done job is not counted)."""
    queue_key = f"gpu:jobs:bench{os.getpid()}"
    r = redis.Redis.from_url(redis_url)
    try:
        count = int(window / max(latency, 0.05)) + 5
        r.rpush(
            queue_key,
            *(
                json.dumps(
                    {
                        "id": f"t{i}",
                        "input": {"prompt": f"tutorial job {i}"},
                        "output_key": f"results/t{i}.json",
                        "attempt": 1,
                    }
                )
                for i in range(count)
            ),
        )
        start = time.monotonic()
        done = TutorialWorker(redis_url, queue_key, sim_url, "bench", workdir / "tutorial", until=start + window).run()
        r.delete(queue_key, f"{queue_key}:held", f"{queue_key}:dead")
    finally:
        r.close()
    if not done:
        return 0, 0.0
    return len(done), len(done) / (done[-1] - start)
