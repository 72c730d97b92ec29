"""The digits demo trains through the compiled path (opencann forward + backward, bf16
autocast, recomputation) to >= 95% test accuracy. Its wall time is printed by
``opencann train-demo``; timings belong in ``bench/``, never in tests."""
import pytest

pytest.importorskip("sklearn")


def test_digits_reaches_95_percent():
    from opencann.tools.train_demo import train_digits
    r = train_digits(epochs=4, log=lambda *_: None)   # seeded: 96.7% after 4 epochs
    assert r["test_accuracy"] >= 0.95, r
