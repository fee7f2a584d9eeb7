"""The serving engine's host page pool and prefix cache (`jspec.serve.pages`), no device.

- Pages are taken once, shared by count, and free again when the last row lets go;
  uncached free pages are handed out before cached ones, cached ones least recently freed
  first, and taking a cached page forgets what it held.
- A prefix is found page by page along its chain of keys (a page's key holds its tokens and
  the next one), at most `most` tokens and never the whole sequence; the same content
  registered twice keeps the first page.
- With state snapshots (a hybrid target) a prefix is found only as deep as a saved state.
"""
from __future__ import annotations

import pytest

from jspec.serve.pages import ROOT, PagePool, PoolEmpty


def register_all(pool: PagePool, tokens, pages) -> int:
    node, P = ROOT, pool.page_size
    for j, page in enumerate(pages):
        node = pool.register(node, tokens[j * P:(j + 1) * P + 1], page)
    return node


def test_take_share_release_counts():
    pool = PagePool(6, 4)
    a = pool.take(4)
    assert len(set(a)) == 4 and pool.available == 2
    pool.share(a[:2])  # a second row holds the first two
    pool.release(a)
    assert pool.available == 4  # a[:2] still held once
    pool.release(a[:2])
    assert pool.available == 6
    with pytest.raises(PoolEmpty):
        pool.take(7)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a[0]])


def test_prefix_lookup_chain_and_limits():
    pool = PagePool(8, 4)
    tokens = list(range(100, 118))  # 18 tokens: 4 full pages with a next token
    pages = pool.take(4)
    register_all(pool, tokens, pages)
    assert pool.cached == 4
    assert pool.lookup(tokens, len(tokens) - 1)[0] == pages
    assert pool.lookup(tokens, 11)[0] == pages[:2]  # at most 11 tokens: two pages
    assert pool.lookup(tokens[:17], 16)[0] == pages  # the fourth page's next token is token 16
    assert pool.lookup(tokens[:16], 15)[0] == pages[:3]  # ... without it the fourth is not a hit
    other = tokens[:9] + [7] + tokens[10:]  # differs inside the third page: the first two hit
    assert pool.lookup(other, 17)[0] == pages[:2]
    other = tokens[:8] + [7] + tokens[9:]  # differs at the third page's first token, the second's next
    assert pool.lookup(other, 17)[0] == pages[:1]
    differs_after = tokens[:4] + [9] + tokens[5:]  # the first page's next token differs: nothing
    assert pool.lookup(differs_after, 17)[0] == []
    pool.count(18, 16)
    assert pool.query_tokens == 18 and pool.hit_tokens == 16  # counted when a lookup is used


def test_keys_without_the_next_token():
    """Where no draft's cache reads the token after a page (`next_token=False`: plain
    decoding, standalone and n-gram drafts), a page's key is its own tokens: a prompt
    that differs right after a page still finds it, and a page is full at its last slot."""
    pool = PagePool(8, 4, next_token=False)
    tokens = list(range(100, 116))  # 16 tokens: 4 full pages
    pages = pool.take(4)
    node = 0
    for j, page in enumerate(pages):
        node = pool.register(node, tokens[j * 4:(j + 1) * 4], page)
    assert pool.lookup(tokens, 16)[0] == pages and pool.lookup(tokens, 15)[0] == pages[:3]
    differs_after = tokens[:4] + [9] + tokens[5:]  # differs at the second page's first token
    assert pool.lookup(differs_after, 15)[0] == pages[:1]
    with pytest.raises(ValueError, match="a page's key takes 4 tokens, got 5"):
        pool.register(node, tokens[:5], pages[0])


def test_duplicates_keep_the_first_page_and_chain_on():
    pool = PagePool(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    first, second = pool.take(3), pool.take(3)
    end = register_all(pool, tokens, first)
    assert register_all(pool, tokens, second) == end  # the same nodes: `second` stays uncached
    assert pool.cached == 3
    pool.release(second)
    assert sorted(pool.take(3)) == sorted(second)  # uncached pages go first


def test_cached_pages_last_in_line_and_forgotten_when_taken():
    pool = PagePool(4, 2)
    a = pool.take(2)
    register_all(pool, [1, 2, 3, 4, 5], a)
    b = pool.take(2)
    pool.release(a)  # cached, nobody holds them
    pool.release(b)  # uncached: handed out first
    assert pool.available == 4 and pool.lookup([1, 2, 3, 4, 5], 4)[0] == a
    assert sorted(pool.take(2)) == sorted(b)
    taken = pool.take(1)  # now the least recently freed cached page
    assert taken == [a[0]] and pool.cached == 1
    assert pool.lookup([1, 2, 3, 4, 5], 4)[0] == []  # the chain is broken at its first page
    pool.share([a[1]])  # a held cached page is not free
    assert pool.available == 0


def test_no_caching_registers_nothing():
    pool = PagePool(4, 2, prefix_caching=False)
    pages = pool.take(2)
    register_all(pool, [1, 2, 3, 4, 5], pages)
    assert pool.cached == 0 and pool.lookup([1, 2, 3, 4, 5], 4)[0] == []


def test_snapshots_bound_hits_and_go_with_their_pages():
    """A pool that keeps state snapshots (a hybrid target) finds a prefix only as deep as
    its deepest page with an attached snapshot; slots are pending until attached, reused
    least recently used first, and freed when their page is taken."""
    with pytest.raises(ValueError, match="multiple of the page size"):
        PagePool(8, 4, snapshots=2, boundary=6)
    pool = PagePool(8, 2, snapshots=2, boundary=4)
    tokens = list(range(1, 10))  # 4 full pages with a next token
    pages = pool.take(4)
    node, nodes = ROOT, []
    for j, page in enumerate(pages):
        node = pool.register(node, tokens[2 * j:2 * j + 3], page)
        nodes.append(node)
    assert pool.lookup(tokens, 8) == ([], ROOT, None)  # no snapshot yet: no hit
    first, second = pool.snapshot_slot(), pool.snapshot_slot()
    assert pool.snapshot_slot() is None  # both pending
    pool.attach(nodes[1], first)  # the state after 4 tokens
    assert pool.lookup(tokens, 8) == (pages[:2], nodes[1], first)
    pool.attach(nodes[3], second)  # after 8
    assert pool.lookup(tokens, 8) == (pages, nodes[3], second)
    assert pool.lookup(tokens, 7)[0] == pages[:2]  # at most 7 tokens: back to the snapshot at 4
    third = pool.snapshot_slot()  # reuses the least recently used: `second` (the last lookup touched `first`)
    assert third == second and pool.lookup(tokens, 8)[0] == pages[:2]
    pool.drop_slot(third)
    pool.release(pages)
    pool.take(5)  # the 4 uncached pages first, then the oldest cached (pages[0]): the chain breaks
    assert pool.lookup(tokens, 8)[0] == [] and pool.free_slots == [second]
    pool.take(1)  # pages[1]: its snapshot goes with it
    assert sorted(pool.free_slots) == sorted([first, second])
