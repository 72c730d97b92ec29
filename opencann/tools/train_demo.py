"""``opencann train-demo``: training through the graph engine, end to end.

1. A small CNN on scikit-learn's digits (1797 8×8 images, 10 classes; 80/20 split),
   compiled with ``torch.compile(backend=opencann training backend)``: forward and
   backward graphs run on opencann's runtime, recomputation on (the always-on minimum
   cut, or a ``--memory-budget``), bf16 autocast on CPU (mixed precision), Adam in torch.
2. Optionally (``--minilm-steps N``) fine-tunes all-MiniLM-L6-v2 (real weights) for N
   steps on a tiny sentence-topic task and prints the loss going down.
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional

import torch

CLASSES = 10


def digits_cnn() -> torch.nn.Module:
    """Conv(1→16) → ReLU → Conv(16→32) → ReLU → MaxPool 2 → Linear(512→10). Input
    float32 [N, 1, 8, 8] in [0, 1]; output logits [N, 10]."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, CLASSES))


def load_digits_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test): float32 [N, 1, 8, 8] scaled to [0, 1], int64
    labels. Raises RuntimeError when scikit-learn is missing (pip install opencann[train])."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise RuntimeError("the digits demo needs scikit-learn: pip install 'opencann[train]'") from None
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def train_digits(epochs: int = 12, batch: int = 64, lr: float = 3e-3, bf16: bool = True,
                 memory_budget=None, seed: int = 0, log=print) -> Dict[str, float]:
    """Train `digits_cnn` through the opencann training backend. Returns
    ``{"test_accuracy", "seconds", "final_loss"}`` (accuracy in [0, 1], wall seconds
    including compilation)."""
    from ..dynamo.training import make_training_backend
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = load_digits_split(seed)
    model = digits_cnn().train()
    cm = torch.compile(model, backend=make_training_backend(memory_budget=memory_budget),
                       dynamic=False)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for ep in range(epochs):
        perm = torch.randperm(len(ytr), generator=g)
        for i in range(0, len(ytr) - batch + 1, batch):  # full batches: one static graph
            idx = perm[i:i + batch]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = cm(xtr[idx])
            loss = torch.nn.functional.cross_entropy(logits.float(), ytr[idx])
            loss.backward()
            opt.step()
        log(f"epoch {ep + 1:2d}  loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    return {"test_accuracy": acc, "seconds": time.perf_counter() - t0, "final_loss": loss.item()}


def finetune_minilm(steps: int = 6, lr: float = 5e-4, log=print) -> List[float]:
    """Fine-tune all-MiniLM-L6-v2 (mean pooling + a linear head) for ``steps`` steps on
    6 sentences with 3 topic labels, through the opencann training backend. Returns
    the loss of each step."""
    from .. import zoo
    from ..dynamo.training import opencann_training_backend
    sents = zoo.SENTENCES + ["The dog chases a ball in the park."]
    labels = torch.tensor([0, 0, 1, 1, 2, 1])
    ids, mask = zoo.tokenize(sents, max_length=16)
    enc = zoo.minilm().model.train()

    class Clf(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = enc, torch.nn.Linear(enc.config.hidden_size, 3)

        def forward(self, ids, mask):
            h = self.enc(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * m).sum(1) / m.sum(1))

    torch.manual_seed(0)
    model = Clf()
    cm = torch.compile(model, backend=opencann_training_backend, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(cm(ids, mask), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        log(f"minilm step {s + 1}  loss {losses[-1]:.4f}")
    return losses


def add_arguments(p: argparse.ArgumentParser, minilm_steps: int = 0) -> None:
    """The demo's options (shared by ``opencann train-demo`` and the example script)."""
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--no-bf16", action="store_true", help="train in fp32")
    p.add_argument("--memory-budget", type=_budget, default=None,
                   help="recomputation budget: a fraction of the no-recompute peak in (0, 1] "
                        "or an int number of bytes")
    p.add_argument("--minilm-steps", type=int, default=minilm_steps,
                   help=f"also fine-tune MiniLM for this many steps (0: skip; default {minilm_steps})")


def _budget(text: str):
    return int(text) if text.isdigit() else float(text)


def run_args(a: argparse.Namespace) -> int:
    """Run the demo with parsed options. Returns 0 when the digits model reaches 95% test
    accuracy (and MiniLM's loss went down, when run), 1 when it does not, 2 for a budget
    that cannot be met or malformed options (printed as one line)."""
    from torch._dynamo.exc import BackendCompilerFailed
    try:
        r = train_digits(epochs=a.epochs, bf16=not a.no_bf16, memory_budget=a.memory_budget)
    except (ValueError, BackendCompilerFailed) as e:
        inner = getattr(e, "inner_exception", e)
        print(f"error: {type(inner).__name__}: {inner}")
        return 2
    print(f"digits: test accuracy {r['test_accuracy']:.3f} in {r['seconds']:.1f} s")
    ok = r["test_accuracy"] >= 0.95
    if a.minilm_steps:
        losses = finetune_minilm(a.minilm_steps)
        ok = ok and losses[-1] < losses[0]
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    """Script entry (``python examples/train_digits.py``); see `run_args`."""
    p = argparse.ArgumentParser(prog="train_digits", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
