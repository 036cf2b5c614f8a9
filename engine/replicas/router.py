"""``PrefixAffinityRouter``: which replica serves a request, from its prompt's first blocks and the
replicas' loads. Pure Python (no Ray), so the rule is tested on its own.

The rule, in two lines:

1. **Affinity.** Hash the prompt's full blocks (the engine's ``block_size``, chained like the
   prefix cache's hashes, salted by ``cache_salt`` and the LoRA adapter, first ``max_prefix_blocks``
   only). The replica that last served the longest of these prefixes holds it in its prefix cache:
   send the request there.
2. **Fallback.** If no replica has seen a prefix of it, or the affine replica has ``max_load_gap``
   or more outstanding sequences than the least-loaded live replica, send it to the least-loaded
   live replica (least outstanding sequences; ties go to the lowest index).

Either way the chosen replica becomes the owner of all the request's prefix hashes (it will hold
them in its cache next), so the next request with the same prefix follows it.

>>> router = PrefixAffinityRouter(num_replicas=2, block_size=4, max_load_gap=8)
>>> first = router.route(list(range(12)))          # unseen: least loaded, replica 0
>>> second = router.route(list(range(8)) + [99])   # shares two blocks with the first
>>> (first.replica, second.replica, second.is_affine)
(0, 0, True)
>>> router.finish(first)
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import EngineDeadError

# The prefix hashes remembered (oldest forgotten first): 64k entries are ~6 MiB and cover 1M tokens
# of distinct prefixes at block size 16.
DEFAULT_TABLE_SIZE = 65536
# Prefixes deeper than this many blocks decide nothing more: a replica that shares 32 blocks
# (512 tokens at block size 16) with a request is where it belongs.
DEFAULT_MAX_PREFIX_BLOCKS = 32


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request went: its replica, whether by affinity, and the load it counts for."""

    replica: int
    is_affine: bool
    num_sequences: int
    num_matched_blocks: int


class PrefixAffinityRouter:
    """Choose a replica per request: prefix-cache affinity, least-outstanding fallback (see the module).

    Thread-safe. ``route`` counts the request as outstanding on its replica until ``finish``.
    ``mark_dead(i)`` stops routing to replica ``i`` (its prefixes are forgotten);
    ``mark_alive(i)`` brings it back (a restarted replica, its cache empty).
    """

    def __init__(self, num_replicas: int, block_size: int, max_load_gap: int = 8,
                 max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS, table_size: int = DEFAULT_TABLE_SIZE):
        for name, value in (("num_replicas", num_replicas), ("block_size", block_size),
                            ("max_load_gap", max_load_gap), ("max_prefix_blocks", max_prefix_blocks),
                            ("table_size", table_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_load_gap = max_load_gap
        self.max_prefix_blocks = max_prefix_blocks
        self.table_size = table_size
        self._lock = threading.Lock()
        self._owner_of: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> replica, LRU order
        self._is_alive = [True] * num_replicas
        self.num_outstanding = [0] * num_replicas      # sequences routed and not finished
        self.num_routed = [0] * num_replicas
        self.num_affine_routed = [0] * num_replicas    # routed there by affinity
        self.num_fallback_routed = [0] * num_replicas  # affine elsewhere, but that replica was overloaded

    def prefix_hashes(self, token_ids, extra_key: str | None = None) -> list[bytes]:
        """Chained hashes of the prompt's first full blocks (at most ``max_prefix_blocks``)."""
        num_blocks = min(len(token_ids) // self.block_size, self.max_prefix_blocks)
        parent = hashlib.blake2b(b"root" if extra_key is None else b"salt:" + extra_key.encode(),
                                 digest_size=16).digest()
        hashes = []
        for index in range(num_blocks):
            block = token_ids[index * self.block_size:(index + 1) * self.block_size]
            parent = hashlib.blake2b(parent + array("q", block).tobytes(), digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def route(self, token_ids, extra_key: str | None = None, num_sequences: int = 1) -> Route:
        """Pick the replica for a prompt (token ids) and count it outstanding there.
        Raises :class:`EngineDeadError` when no replica is alive."""
        hashes = self.prefix_hashes(token_ids, extra_key)
        with self._lock:
            least = self._least_loaded()
            affine, num_matched = self._affine_replica(hashes)
            is_affine = affine is not None and \
                self.num_outstanding[affine] - self.num_outstanding[least] < self.max_load_gap
            replica = affine if is_affine else least
            self._count(replica, is_affine, affine is not None and not is_affine, num_sequences)
            self._remember(hashes, replica)
        return Route(replica, is_affine, num_sequences, num_matched)

    def finish(self, route: Route) -> None:
        """The request of ``route`` ended (finished, aborted or failed)."""
        with self._lock:
            self.num_outstanding[route.replica] = max(0, self.num_outstanding[route.replica] - route.num_sequences)

    def mark_dead(self, replica: int) -> None:
        """Route nothing more to ``replica``; forget what its cache held."""
        with self._lock:
            self._is_alive[replica] = False
            self.num_outstanding[replica] = 0
            for prefix_hash in [h for h, owner in self._owner_of.items() if owner == replica]:
                del self._owner_of[prefix_hash]

    def mark_alive(self, replica: int) -> None:
        """Route to ``replica`` again (restarted: nothing cached there yet)."""
        with self._lock:
            self._is_alive[replica] = True

    def is_alive(self, replica: int) -> bool:
        return self._is_alive[replica]

    @property
    def live_replicas(self) -> list[int]:
        return [index for index, alive in enumerate(self._is_alive) if alive]

    def stats(self, replica: int) -> dict:
        """The router's counters for one replica."""
        with self._lock:
            return {"is_alive": self._is_alive[replica], "num_outstanding": self.num_outstanding[replica],
                    "num_routed": self.num_routed[replica], "num_affine_routed": self.num_affine_routed[replica],
                    "num_fallback_routed": self.num_fallback_routed[replica]}

    # ---- under the lock ----------------------------------------------------------------------

    def _least_loaded(self) -> int:
        live = [index for index, alive in enumerate(self._is_alive) if alive]
        if not live:
            raise EngineDeadError(f"all {self.num_replicas} replicas are dead; no request can be served")
        return min(live, key=lambda index: (self.num_outstanding[index], index))

    def _affine_replica(self, hashes: list[bytes]) -> tuple[int | None, int]:
        """The owner of the longest known prefix among ``hashes`` (a live one), and its length in blocks."""
        for depth in range(len(hashes), 0, -1):
            owner = self._owner_of.get(hashes[depth - 1])
            if owner is not None and self._is_alive[owner]:
                return owner, depth
        return None, 0

    def _count(self, replica: int, is_affine: bool, is_fallback: bool, num_sequences: int) -> None:
        self.num_outstanding[replica] += num_sequences
        self.num_routed[replica] += 1
        self.num_affine_routed[replica] += is_affine
        self.num_fallback_routed[replica] += is_fallback

    def _remember(self, hashes: list[bytes], replica: int) -> None:
        for prefix_hash in hashes:
            self._owner_of[prefix_hash] = replica
            self._owner_of.move_to_end(prefix_hash)
        while len(self._owner_of) > self.table_size:
            self._owner_of.popitem(last=False)
