"""`BoundedCache`: the per-call memo forgets its oldest entries beyond its size."""

from eqx_batch._compiling._memo import BoundedCache


def test_holds_at_most_its_size_forgetting_the_oldest():
    cache = BoundedCache(2)
    assert cache.add("a", 1) == 1
    cache.add("b", 2)
    cache.add("c", 3)
    assert dict(cache) == {"b": 2, "c": 3}


def test_get_or_make_makes_only_what_it_does_not_hold():
    cache = BoundedCache(2)
    made = []

    def make() -> int:
        made.append(1)
        return len(made)

    assert cache.get_or_make("a", make) == 1
    assert cache.get_or_make("a", make) == 1
    assert made == [1]


def test_replacing_an_entry_forgets_nothing_else():
    cache = BoundedCache(2)
    cache.add("a", 1)
    cache.add("b", 2)
    cache.add("a", 10)
    assert dict(cache) == {"a": 10, "b": 2}
