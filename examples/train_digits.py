"""Train a small CNN on scikit-learn's digits through opencann (forward and backward
graphs compiled by the graph engine, bf16 autocast, recomputation on), then fine-tune
MiniLM for a few steps.

    python examples/train_digits.py --minilm-steps 4
"""
from opencann.tools.train_demo import main

if __name__ == "__main__":
    raise SystemExit(main())
