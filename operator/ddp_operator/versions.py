"""Which copy of one object is the newest, from resourceVersions compared for equality only.

The API conventions make resourceVersion opaque: a client may test two for equality, never order them
(etcd's revisions are integers today, but nothing promises it). The operator holds each DDPJob and
rank pod from two sources: a watch (kopf's for DDPJobs, the pod cache's for rank pods), which delivers
the versions of one object in the order they were written, and the answers to its own writes, which
may arrive before or after the watch delivers the same version. Equality is enough to keep an older
copy from replacing a newer one:

- an answer whose version the watch already delivered is not newer than what is held: dropped;
- any other answer is newer than everything delivered: held, and until the watch delivers its
  version, every watch event of the object was written before it (the watch is in order): dropped;
- a listing (the first one, a relist) is a fresh read of everything: taken, and nothing is awaited.

Two documented fallbacks keep a copy from being held forever: the watch's versions are remembered
RECENT_VERSIONS deep, and at most RECENT_VERSIONS events are dropped while an answer waits for its
version (a write's answer and the watch are never that many versions of one object apart; past it
the event is taken, as it would be without this rule). A listing read just before one of our writes
and delivered just after its answer is taken too: the object is then reconciled once more from that
copy, and the watch delivers the write right after.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

# How many versions of one object a watch may deliver during one of our requests, at most.
RECENT_VERSIONS: Final = 16


def resource_version(obj: Mapping[str, Any]) -> str | None:
    """The object's resourceVersion, as the opaque string it is (None: absent)."""
    version = (obj.get("metadata") or {}).get("resourceVersion")
    return str(version) if version else None


@dataclass
class Freshness:
    """What one object's copies say of its versions: each method says whether to take the copy."""

    # The version of an answer taken, which the watch has not delivered yet.
    awaited: str | None = None
    # Watch events dropped while waiting for it.
    dropped: int = 0
    delivered: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_VERSIONS))

    def watched(self, obj: Mapping[str, Any]) -> bool:
        """A watch event: False when it is older than an answer taken."""
        version = resource_version(obj)
        if version is None:
            return True
        self.delivered.append(version)
        if self.awaited is None or version == self.awaited or self.dropped >= RECENT_VERSIONS:
            self.awaited, self.dropped = None, 0
            return True
        self.dropped += 1
        return False

    def answered(self, obj: Mapping[str, Any]) -> bool:
        """The answer to one of our writes: False when the watch delivered that version already."""
        version = resource_version(obj)
        if version is None:
            return True
        if version in self.delivered:
            return False
        self.awaited, self.dropped = version, 0
        return True

    def listed(self, obj: Mapping[str, Any]) -> bool:
        """A listing's copy: always taken; whatever was awaited is forgotten."""
        self.awaited, self.dropped = None, 0
        version = resource_version(obj)
        if version is not None:
            self.delivered.append(version)
        return True
