"""The one live-bytes sweep line (opencann.ir.liveness), against a brute-force count."""
import random

import pytest

from opencann.ir.liveness import live_bytes, peak_live_bytes


def _brute(ranges, nsteps):
    return [sum(b for s, e, b in ranges if s <= t <= e) for t in range(nsteps)]


def test_live_bytes_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        nsteps = rng.randint(1, 12)
        ranges = []
        for _ in range(rng.randint(0, 8)):
            s = rng.randrange(nsteps)
            ranges.append((s, rng.randint(s, nsteps - 1), rng.randint(0, 100)))
        want = _brute(ranges, nsteps)
        assert live_bytes(ranges, nsteps) == want
        assert peak_live_bytes(iter(ranges)) == max(want, default=0) * bool(ranges)


def test_ranges_are_inclusive_and_peak_of_nothing_is_zero():
    # a value read at the step that frees the other still overlaps it
    assert live_bytes([(0, 1, 8), (1, 2, 4)], 3) == [8, 12, 4]
    assert peak_live_bytes([]) == 0


@pytest.mark.parametrize("bad", [(2, 1, 4), (-1, 0, 4), (0, 3, 4), (0, 0, -4)])
def test_bad_range_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="live range"):
        live_bytes([bad], 3)
