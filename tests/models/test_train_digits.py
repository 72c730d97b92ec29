"""The digits demo trains through the compiled path (opencann forward + backward, bf16
autocast, recomputation) to >= 95% test accuracy. Its wall time is printed by
``opencann train-demo``; timings belong in ``bench/``, never in tests."""
import pytest

pytest.importorskip("sklearn")


def test_digits_reaches_95_percent():
    from opencann.tools.train_demo import train_digits
    r = train_digits(epochs=8, log=lambda *_: None)
    assert r["test_accuracy"] >= 0.95, r
