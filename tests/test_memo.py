"""`BoundedCache`: the per-call memo forgets its oldest entries beyond its size."""

from eqx_batch._memo import BoundedCache


def test_holds_at_most_its_size_forgetting_the_oldest():
    cache = BoundedCache(2)
    assert cache.add("a", 1) == 1
    cache.add("b", 2)
    cache.add("c", 3)
    assert dict(cache) == {"b": 2, "c": 3}


def test_replacing_an_entry_forgets_nothing_else():
    cache = BoundedCache(2)
    cache.add("a", 1)
    cache.add("b", 2)
    cache.add("a", 10)
    assert dict(cache) == {"a": 10, "b": 2}
