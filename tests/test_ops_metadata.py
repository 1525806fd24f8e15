"""The fused ops over lists longer than their metadata prefetch distance (NOTE: [Thousands of small
tensors' metadata]), against the float64 reference."""

import random

import torch

import nanfast
from reference import assert_stats_match, reference_stats
from test_watch_recorder import planted


def test_long_lists_of_mixed_tensors_past_the_prefetch_distance():
    """Several hundred entries (the metadata prefetches reach 64 entries ahead): small and empty ones,
    strided and expanded views, complex and half-precision, each against the float64 reference."""
    rng = random.Random(7)
    tensors = []
    for i in range(300):
        kind = i % 6
        if kind == 0:
            tensors.append(planted(rng.randrange(1, 40), rng))
        elif kind == 1:
            tensors.append(planted(64, rng).reshape(8, 8).t())
        elif kind == 2:
            tensors.append(torch.empty(0))
        elif kind == 3:
            tensors.append(planted(5, rng).expand(3, 5))
        elif kind == 4:
            tensors.append(torch.complex(planted(9, rng), planted(9, rng)))
        else:
            tensors.append(planted(33, rng, torch.float16))
    s = nanfast.stats(tensors)
    assert_stats_match(s.counts, s.norm, s.absmax, tensors)
    assert nanfast.any_nonfinite(tensors).item() == any(sum(reference_stats(t).counts) for t in tensors)
