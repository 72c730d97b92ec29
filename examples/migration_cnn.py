"""A small CNN for the migration walk-through (docs/guide/migration.md): conv+BN+ReLU, a
residual conv, pooling and two linears. ``opencann compare examples/migration_cnn.py:net``."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.c2, self.b2 = torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.fc, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 10)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)) + y)
        return self.head(torch.nn.functional.gelu(self.fc(y.mean((2, 3)))))


def net():
    """(model, example inputs): seeded weights and BatchNorm statistics, input [4, 3, 32, 32]."""
    torch.manual_seed(0)
    m = Net().eval()
    for b in (m.b1, m.b2):
        b.running_mean.uniform_(-1, 1)
        b.running_var.uniform_(0.5, 2)
    return m, (torch.randn(4, 3, 32, 32),)
