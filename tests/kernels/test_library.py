"""lucid_fx.kernels.library: the weight cache behind packed and padded weights."""

import gc

import torch

from lucid_fx.kernels import WeightCache


def test_entries_follow_the_weight_identity_version_and_lifetime():
    cache = WeightCache()
    w = torch.ones(3)
    assert [cache.get(w, "twice", lambda: w * 2).tolist() for _ in range(2)] == [[2.0] * 3] * 2
    assert cache.builds == 1 and cache.has(w, "twice") and not cache.has(w, "other")
    cache.get(w, "other", lambda: w + 1)
    assert cache.count(w, lambda key: key in ("twice", "other")) == 2
    w.add_(1)  # in place: stale for every key
    assert not cache.has(w, "twice") and cache.count(w, lambda key: True) == 0
    assert cache.get(w, "twice", lambda: w * 2).tolist() == [4.0] * 3 and cache.builds == 3
    twin = w.clone()  # equal values, another tensor: its own entries
    assert not cache.has(twin, "twice")
    cache.get(twin, "twice", lambda: twin * 2)
    assert len(cache) == 2
    del w, twin
    gc.collect()
    assert len(cache) == 0 and cache._entries == {}  # the entries went with their weights


def test_a_reused_id_never_returns_a_dead_weights_entry():
    cache = WeightCache()
    seen = {}
    for i in range(200):  # ids of freed tensors are reused by later ones
        w = torch.full((2,), float(i))
        assert cache.get(w, "value", lambda: float(w[0])) == float(i)
        seen[id(w)] = seen.get(id(w), 0) + 1
        del w
    assert max(seen.values()) > 1  # an id was reused, and still each lookup saw its own weight
    assert cache.builds == 200


def test_fallback_weights_leave_the_caches_when_they_die():
    # The _int_mm form of a weight (a column-major view of its storage) must not keep the weight
    # alive, or its cache entries would never go.
    import lucid_fx.kernels as K
    from lucid_fx.kernels import int_mm

    with K.use_onednn(False):
        weights = [torch.randint(-64, 64, (8, 16), dtype=torch.int8) for _ in range(5)]
        x = torch.randint(0, 256, (3, 16), dtype=torch.uint8)
        outs = [torch.ops.lucid_fx.linear(x, 0.1, 128, w, torch.full((8,), 0.01), None, 1.0, 0, "none", torch.float32)
                for w in weights]
        expected = [((x.float() - 128) * 0.1) @ (w.float() * 0.01).t() for w in weights]
        assert all(torch.allclose(o, e, atol=1e-4) for o, e in zip(outs, expected))
        held = len(int_mm.PREPARED)
        del weights, outs
        gc.collect()
        assert len(int_mm.PREPARED) == held - 5
