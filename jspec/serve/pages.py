"""The serving engine's page pool, kept on the host (`jspec.cache.layout.CacheLayout.host_pages`):
which pages are free, how many rows hold each page, and the prefix cache.

Pure host logic (tested on its own, `tests/test_pages.py`); the scheduler asks it for
pages and the runner writes them into the device's page table.

The prefix cache. A page is *full* when all its P slots hold a request's keys and values
(and, with `next_token`, the token after them is known). Such a page is registered under a
key: its parent's key and its own P tokens, plus the next one where a draft's cache at a
slot reads the token after it (an EAGLE-style head's value at the page's last slot is
computed from that next token, so the page is exact for the draft as well as the target;
`Proposer.cache_reads_next_token`). Keys chain from the first page, so a key names a whole prefix: a later request
whose prompt begins with the same tokens looks its pages up (`lookup`) and shares them
(`share`), its pass starting past them. A page nobody holds stays cached among the free
pages; pages that hold nothing cached are handed out first, then cached ones, least
recently freed first (`take` forgets what a page held).
"""
from __future__ import annotations

import collections
from typing import Sequence

ROOT = 0  # the key of the empty prefix, every chain's first parent


class PoolEmpty(RuntimeError):
    """More pages were taken than are free (a scheduler bug: it checks `available` first)."""


class PagePool:
    """num_pages pages of page_size tokens. prefix_caching: keep and look up full pages;
    snapshots, boundary: the state snapshots a prefix needs (0: none needed); next_token: a
    page's key holds the token after it too (see the module)."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True, snapshots: int = 0,
                 boundary: int = 0, next_token: bool = True):
        if snapshots and (boundary <= 0 or boundary % page_size):
            raise ValueError(f"snapshot boundaries ({boundary}) must be a multiple of the page size ({page_size})")
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.snapshots, self.boundary = snapshots, boundary
        self.next_token = int(next_token)
        self.key_len = page_size + self.next_token  # the tokens a page's key holds
        self.query_tokens = self.hit_tokens = 0  # prompt tokens looked up and found (metrics; never reset)
        self.clear()

    def clear(self) -> None:
        """Every page free, nothing cached (the device's pages were reset)."""
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(self.num_pages))
        self.refs = [0] * self.num_pages  # rows holding each page
        self.key_of: dict[int, tuple] = {}  # cached page -> its key
        self.nodes: dict[tuple, tuple[int, int]] = {}  # key -> (node id, page)
        self._next_node = ROOT + 1
        self.page_of_node: dict[int, int] = {}  # cached node -> its page
        self.slot_of: dict[int, int] = {}  # node -> its snapshot's slot
        self.node_of_slot: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU: oldest first
        self.free_slots = list(range(self.snapshots))[::-1]

    @property
    def available(self) -> int:
        """Pages that can be taken: held by no row (cached or not)."""
        return len(self.free)

    @property
    def cached(self) -> int:
        return len(self.key_of)

    def take(self, n: int) -> list[int]:
        """n free pages for a row (each then held once), uncached ones first."""
        if n > len(self.free):
            raise PoolEmpty(f"{n} pages asked, {len(self.free)} free")
        out = []
        for _ in range(n):
            page, _ = self.free.popitem(last=False)
            self._forget(page)
            self.refs[page] = 1
            out.append(page)
        return out

    def share(self, pages: Sequence[int]) -> None:
        """A row holds these (cached) pages too."""
        for p in pages:
            if self.refs[p] == 0:
                del self.free[p]
            self.refs[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        """A row lets go of its pages: those nobody holds become free (cached ones last in
        line, so they are kept longest; the rest first)."""
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] < 0:
                raise RuntimeError(f"page {p} released more often than taken")
            if self.refs[p] == 0:
                self.free[p] = None
                if p not in self.key_of:
                    self.free.move_to_end(p, last=False)

    def cost(self, pages: Sequence[int]) -> int:
        """Free pages that sharing `pages` takes out of the free ones (those nobody holds)."""
        return sum(self.refs[p] == 0 for p in pages)

    # ------------------------------------------------------------------ the prefix cache

    def key(self, parent: int, tokens: Sequence[int]) -> tuple:
        return parent, tuple(tokens)

    def lookup(self, tokens: Sequence[int], most: int) -> tuple[list[int], int, int | None]:
        """The cached pages of the longest prefix of `tokens` of at most `most` tokens ->
        (pages, the node id of the last, ROOT if none; the slot of its state snapshot, None
        if the pool keeps none). The metrics count a query when it is used (`count`)."""
        pages, nodes = self._walk(tokens, most)
        slot = None
        if self.snapshots:  # only as deep as a saved state
            while pages and nodes[-1] not in self.slot_of:
                pages.pop()
                nodes.pop()
            if pages:
                slot = self.slot_of[nodes[-1]]
                self.node_of_slot.move_to_end(slot)
        return pages, nodes[-1], slot

    def _walk(self, tokens: Sequence[int], most: int) -> tuple[list[int], list[int]]:
        """The cached pages of the longest prefix of `tokens` of at most `most` tokens and
        their nodes (ROOT first), whether or not a state snapshot is saved at its end."""
        P = self.page_size
        pages, nodes = [], [ROOT]
        if self.prefix_caching:
            for j in range(min(most, len(tokens) - self.next_token) // P):
                hit = self.nodes.get(self.key(nodes[-1], tokens[j * P:j * P + self.key_len]))
                if hit is None:
                    break
                nodes.append(hit[0])
                pages.append(hit[1])
        return pages, nodes

    def cached_depth(self, tokens: Sequence[int], most: int) -> int:
        """Tokens of the longest cached prefix of `tokens` (at most `most`), as `lookup`
        would find them if a snapshot were saved at its end (a pool that keeps them: a
        prefix another request shares, which a state saved there would make a hit)."""
        return len(self._walk(tokens, most)[0]) * self.page_size

    def count(self, query: int, hit: int) -> None:
        """A prompt of `query` tokens looked up, `hit` of them found (the metrics)."""
        self.query_tokens += query
        self.hit_tokens += hit

    def snapshot_slot(self) -> int | None:
        """A slot for a state saved now, pending until `attach` or `drop_slot` (None: every
        slot is pending)."""
        if self.free_slots:
            return self.free_slots.pop()
        if not self.node_of_slot:
            return None
        slot, node = self.node_of_slot.popitem(last=False)
        del self.slot_of[node]
        return slot

    def attach(self, node: int, slot: int) -> None:
        """The pending snapshot `slot` holds the state after the prefix of `node`."""
        if node not in self.page_of_node or node in self.slot_of:
            self.drop_slot(slot)
            return
        self.slot_of[node] = slot
        self.node_of_slot[slot] = node

    def drop_slot(self, slot: int) -> None:
        """A pending slot that holds nothing to keep."""
        self.free_slots.append(slot)

    def register(self, parent: int, tokens: Sequence[int], page: int) -> int:
        """Page `page`, full, holds `tokens` (its P tokens, and the next with `next_token`)
        after the prefix of node `parent` -> the node id of the longer prefix. If that prefix
        is cached in another page already, this page stays uncached and that node is returned."""
        if len(tokens) != self.key_len:
            raise ValueError(f"a page's key takes {self.key_len} tokens, got {len(tokens)}")
        k = self.key(parent, tokens)
        hit = self.nodes.get(k)
        if hit is not None:
            return hit[0]
        if not self.prefix_caching or page in self.key_of:
            return -1  # nothing can chain from it
        node = self._next_node
        self._next_node += 1
        self.nodes[k] = (node, page)
        self.key_of[page] = k
        self.page_of_node[node] = page
        return node

    def _forget(self, page: int) -> None:
        k = self.key_of.pop(page, None)
        if k is not None:
            node, _ = self.nodes.pop(k)  # its descendants can no longer be reached: they age out
            del self.page_of_node[node]
            slot = self.slot_of.pop(node, None)
            if slot is not None:
                del self.node_of_slot[slot]
                self.free_slots.append(slot)
