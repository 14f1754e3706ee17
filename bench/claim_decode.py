"""Decoding a claim reply: the inline by-index decode store.claim had vs offload.queue.replies.claimed, side by
side on the same 500-job reply, interleaved so machine noise hits both alike. Prints ns per job and the ratio.

    python -m bench.claim_decode
"""

from __future__ import annotations

import timeit

from offload.models import ClaimedJob
from offload.queue import replies

JOBS = 500
ROUNDS, NUMBER = 60, 20


def by_index(flat: list[str]) -> list[ClaimedJob]:
    """The decode as it was in store.claim before replies.py."""
    return [
        ClaimedJob(
            id=flat[i],
            token=flat[i + 1],
            attempt=int(flat[i + 2]),
            max_attempts=int(flat[i + 3]),
            input_json=flat[i + 4],
            output_key=flat[i + 5],
            backend=flat[i + 6] or None,
            remote_id=flat[i + 7] or None,
            cancel_requested=flat[i + 8] == "1",
            redelivered=flat[i + 9] == "1",
            submission=int(flat[i + 10] or 0),
            intent_open=flat[i + 11] == "1",
            begun=flat[i + 12] == "1",
        )
        for i in range(0, len(flat), 13)
    ]


def reply(jobs: int = JOBS) -> list[str]:
    flat: list[str] = []
    for j in range(jobs):
        flat += [f"gpu:{j:024x}", f"w/{j}", "1", "3", '{"prompt": "x"}', f"out/{j}.json", "", ""]
        flat += ["0", "0", "0", "0", "0"]
    return flat


def main() -> None:
    flat = reply()
    assert by_index(flat) == replies.claimed(flat)
    old: list[float] = []
    new: list[float] = []
    for _ in range(ROUNDS):
        old.append(timeit.timeit(lambda: by_index(flat), number=NUMBER))
        new.append(timeit.timeit(lambda: replies.claimed(flat), number=NUMBER))
    old.sort()
    new.sort()
    per_job = 1e9 / NUMBER / JOBS
    print(f"by index: {old[0] * per_job:.0f} ns/job  replies.claimed: {new[0] * per_job:.0f} ns/job")
    print(f"ratio new/old: best {new[0] / old[0]:.2f}, median {new[ROUNDS // 2] / old[ROUNDS // 2]:.2f}")


if __name__ == "__main__":
    main()
