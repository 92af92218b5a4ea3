"""Which downstream serves each kind, and which answers prove a downstream is back (pure).

"The same downstream" is what one gateway serves: the provider a kind is sent to
(``SETTLED_DOWNSTREAM_PROVIDERS``: ``stripe``, ``wechatpay``, ``alipay``; ``http``, the wire
protocol at ``SETTLED_DOWNSTREAM_URL``, for every kind not named). One answer from it says
for all its kinds whether it is reachable again: the operations of those kinds that wait on
backoff after refusals that proved nothing ran are then woken (``workers.waking``).

What proves it is back is an answer that shows it reachable *and processing*: a send
accepted or refused on its merits, a lookup that found the key or found nothing. A
connection refused, a 429 or a 503 before processing, a timeout or a 5xx proves no such
thing, nor does a misuse answer (it says something is wrong with the request, not that the
downstream is well).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from outbox.downstream import Accepted, Found, LookupNotFound, LookupOutcome, Refused, SubmitOutcome

#: The downstream of every kind no provider is named for: the wire protocol's server.
WIRE = "http"


@dataclass(frozen=True)
class Downstreams:
    """The downstream (a provider's name) serving each kind; ``WIRE`` where none is named."""

    by_kind: Mapping[str, str] = field(default_factory=dict)

    def of(self, kind: str) -> str:
        """The downstream serving ``kind``."""
        return self.by_kind.get(kind, WIRE)

    def kinds_of(self, downstream: str, kinds: Iterable[str]) -> list[str]:
        """Those of ``kinds`` that ``downstream`` serves, sorted."""
        return sorted(k for k in set(kinds) if self.of(k) == downstream)

    def served(self, kinds: Iterable[str]) -> dict[str, list[str]]:
        """Each downstream serving some of ``kinds``, with the kinds it serves (sorted)."""
        out: dict[str, list[str]] = {}
        for kind in sorted(set(kinds)):
            out.setdefault(self.of(kind), []).append(kind)
        return out


def proves_back(outcome: SubmitOutcome | LookupOutcome) -> bool:
    """Whether ``outcome`` came from a downstream that is reachable and processing."""
    return isinstance(outcome, Accepted | Refused | Found | LookupNotFound)
