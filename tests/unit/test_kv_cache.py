import pytest
import torch

from splitflash.models.kv_cache import KVPoolFullError, PagedKVCache


def snapshot(cache: PagedKVCache):
    return (
        {k: (list(s.pages), s.length) for k, s in cache.seqs.items()},
        list(cache._free),
    )


def make_cache(pages=8, size=4):
    return PagedKVCache(num_layers=2, num_pages=pages, page_size=size, num_kv_heads=1, head_dim=2)


def test_roll_back_restores_exact_state_and_data():
    cache = make_cache()
    cache.add("a")
    cache.reserve("a", 6)
    k = torch.arange(12.0).view(6, 1, 2)
    cache.write(0, cache.slots("a", 0, 6), k, -k)
    cache.seq("a").length = 6
    before = snapshot(cache)
    kept = cache.read(0, cache.slots("a", 0, 6))[0].clone()
    cache.reserve("a", 15)  # a verify block that spills onto two more pages
    cache.write(0, cache.slots("a", 6, 15), torch.ones(9, 1, 2), torch.ones(9, 1, 2))
    cache.seq("a").length = 15
    assert cache.used_pages == 4
    cache.truncate("a", 6)
    assert snapshot(cache) == before
    assert torch.equal(cache.read(0, cache.slots("a", 0, 6))[0], kept)
    # the next append gets the very same pages back
    cache.reserve("a", 15)
    assert cache.seq("a").pages == [0, 1, 2, 3]


def test_pool_full_error_names_the_problem_and_changes_nothing():
    cache = make_cache(pages=3, size=4)
    cache.add("a")
    cache.reserve("a", 8)
    cache.add("b")
    before = snapshot(cache)
    with pytest.raises(KVPoolFullError, match="KV pool full.*'b' needs 2 more page"):
        cache.reserve("b", 5)
    assert snapshot(cache) == before
    assert not cache.can_reserve({"b": 5})
    assert cache.can_reserve({"b": 4})


def test_free_returns_every_page_and_page_table_matches():
    cache = make_cache(pages=6, size=2)
    for name, n in (("a", 3), ("b", 5)):
        cache.add(name)
        cache.reserve(name, n)
    table = cache.page_table(["a", "b"])
    assert table.shape == (2, 3)
    assert table[0, :2].tolist() == cache.seq("a").pages
    assert table[1].tolist() == cache.seq("b").pages
    cache.free("a")
    cache.free("b")
    assert cache.free_pages == 6 and cache.seqs == {}
    with pytest.raises(KeyError, match="no KV for request 'a'"):
        cache.reserve("a", 1)


def test_move_compacts_positions_in_every_layer():
    cache = make_cache(pages=4, size=2)
    cache.add("a")
    cache.reserve("a", 7)
    for layer in range(2):
        vals = torch.arange(7.0).view(7, 1, 1).expand(7, 1, 2) + 100 * layer
        cache.write(layer, cache.slots("a", 0, 7), vals, vals)
    cache.move("a", [4, 6], 3)
    for layer in range(2):
        got = cache.read(layer, cache.slots("a", 3, 5))[0][:, 0, 0]
        assert got.tolist() == [4 + 100 * layer, 6 + 100 * layer]


def test_page_tensors_follow_the_page_lists_through_random_growth_and_roll_back():
    """The int32 page mirror (what slots / page_table read) against the page lists
    themselves, over random reserve / truncate / free / re-add, pages crossing the mirror's
    doublings; and a range past the reserved pages still refuses."""
    import random

    rng = random.Random(5)
    cache = make_cache(pages=300, size=4)
    lengths = {}
    for step in range(400):
        name = rng.choice("abc")
        if name not in lengths:
            cache.add(name)
            lengths[name] = 0
        op = rng.random()
        if op < 0.6:
            new = lengths[name] + rng.choice([1, 3, 17, 60])
            if cache.can_reserve({name: new}):
                cache.reserve(name, new)
                lengths[name] = new
        elif op < 0.9:
            lengths[name] = rng.randrange(lengths[name] + 1)
            cache.truncate(name, lengths[name])
        else:
            cache.free(name)
            del lengths[name]
            continue
        pages, n = cache.seq(name).pages, lengths[name]
        if n:
            start = rng.randrange(n)
            want = [pages[p // 4] * 4 + p % 4 for p in range(start, n)]
            assert cache.slots(name, start, n).tolist() == want, step
            picks = rng.sample(range(n), min(n, 5))
            assert cache.slots_of(name, picks).tolist() == [pages[p // 4] * 4 + p % 4
                                                            for p in picks]  # fmt: skip
        names = sorted(lengths)
        table = cache.page_table(names)
        for row, other in enumerate(names):
            got = cache.seq(other).pages
            assert table[row, : len(got)].tolist() == got and not table[row, len(got) :].any()
    name = next(iter(lengths))
    reserved = len(cache.seq(name).pages) * 4
    with pytest.raises(IndexError):
        cache.slots(name, reserved, reserved + 5)
    with pytest.raises(IndexError):
        cache.slots_of(name, [reserved + 1])
