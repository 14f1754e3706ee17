"""What the harness read from each queue's event stream, by stream entry, so a failover can take back exactly what
the promoted replica never had.

A stream replicates in order, so the replica holds every entry up to its last one and none after it: an entry the
harness read from the old primary with a greater id never happened as far as the new primary knows. Comparing
ids, not times, holds when Valkey's clock was stepped (ids are held at the step's moment) and when replication
had stopped long before the cut (a primary restarted under a stepped-back clock delays the replica's full resync
by the step: Valkey's diskless-sync delay runs on the wall clock).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

EntryId = tuple[int, int]


def entry_id(raw: str) -> EntryId:
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class EventLog:
    """Each item appended to a list on behalf of a stream entry (`add`), so `take_back` can remove it again."""

    entries: dict[str, list[tuple[EntryId, list[Any], Any]]] = field(default_factory=lambda: defaultdict(list))

    def add(self, stream: str, raw_id: str, into: list[Any], item: Any) -> None:
        into.append(item)
        self.entries[stream].append((entry_id(raw_id), into, item))

    def take_back(self, stream: str, kept_raw_id: str) -> int:
        """Remove every item of an entry past `kept_raw_id` (the promoted replica's last entry of the stream, "0-0"
        when it had none); returns how many were removed."""
        kept = entry_id(kept_raw_id)
        stay, gone = [], 0
        for entry in self.entries[stream]:
            if entry[0] > kept:
                entry[1].remove(entry[2])
                gone += 1
            else:
                stay.append(entry)
        self.entries[stream] = stay
        return gone
