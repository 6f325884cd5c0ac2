"""Networks as a site might write them: its own classes, its own attribute (= key) names.

Used by the import tests both as importable factories and, through ``FILE.py:FUNCTION``, by the
``privfusion model import`` command."""

import torch
import torch.nn.functional as F
from torch import nn


class ClinicMLP(nn.Module):
    """Custom key names: ``encoder.*``, ``hidden_layer.*``, ``classifier.*``."""

    def __init__(self, n_in=64, width=32, n_out=10):
        super().__init__()
        self.encoder = nn.Linear(n_in, width)
        self.hidden_layer = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)
        self.classifier = nn.Linear(width, n_out)

    def forward(self, x):
        h = torch.relu(self.encoder(x))
        h = self.drop(F.gelu(self.hidden_layer(h)))
        return self.classifier(h)


class ResidualMLP(nn.Module):
    """A residual stream shared by the stem and two blocks, with LayerNorm on it."""

    def __init__(self, n_in=64, width=32, inner=48, n_out=10):
        super().__init__()
        self.stem = nn.Linear(n_in, width)
        self.block1 = nn.Sequential(nn.Linear(width, inner), nn.ReLU(), nn.Linear(inner, width))
        self.norm = nn.LayerNorm(width)
        self.block2_in = nn.Linear(width, inner)
        self.block2_out = nn.Linear(inner, width)
        self.head = nn.Linear(width, n_out)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.block1(h)
        h = self.norm(h)
        h = h + self.block2_out(F.silu(self.block2_in(h)))
        return self.head(torch.relu(h))


class BasicBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class SmallResNet(nn.Module):
    """ResNet-style CNN for 1×8×8 images: stem, a residual stage, a widening conv, pooling,
    a second residual stage, flatten, linear head."""

    def __init__(self, c1=8, c2=16, n_out=10):
        super().__init__()
        self.stem = nn.Conv2d(1, c1, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(c1)
        self.stage1 = BasicBlock(c1)
        self.widen = nn.Conv2d(c1, c2, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.stage2 = BasicBlock(c2)
        self.fc = nn.Linear(c2 * 4 * 4, n_out)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        x = self.stage1(x)
        x = self.pool(F.relu(self.widen(x)))
        x = self.stage2(x)
        return self.fc(x.view(x.size(0), -1))


class TVBlock(nn.Module):
    """torchvision's BasicBlock as written there: a strided conv, a 1×1 conv + BN shortcut when the
    shape changes, and an in-place ``out += identity``."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TVResNet(nn.Module):
    """A two-stage ResNet in torchvision's layout (stem 7×7/2, max-pool, stages, global pool)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(TVBlock(8, 8, 1), TVBlock(8, 8, 1))
        self.layer2 = nn.Sequential(TVBlock(8, 16, 2), TVBlock(16, 16, 1))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class WithAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.proj(x)
        h, _ = self.attn(h, h, h)
        return self.out(h.mean(dim=1))


class WithConcat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(8, 6)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        return self.out(torch.cat([self.a(x), self.b(x)], dim=1))


class AliasedSkip(nn.Module):
    """One Linear under two attribute names (``self.shortcut = self.skip``): ``state_dict``
    lists ``skip.*`` and ``shortcut.*``, one tensor each; fx calls both ``skip``. Its units are
    all fixed (inputs to outputs), so the self-check alone passes it."""

    def __init__(self, n_in=4, n_out=3):
        super().__init__()
        self.skip = nn.Linear(n_in, n_out)
        self.shortcut = self.skip

    def forward(self, x):
        return self.skip(x) + self.shortcut(x)


class AliasedHidden(nn.Module):
    """An aliased hidden layer (the self-check would fail on it, for a reason it cannot name)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.skip = nn.Linear(8, 8)
        self.shortcut = self.skip
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.out(self.skip(h) + self.shortcut(h))


class TiedLinear(nn.Module):
    """Two layers sharing one weight Parameter (tied weights); their biases are their own."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)
        self.l2.weight = self.l1.weight
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.l2(torch.relu(self.l1(torch.relu(self.a(x)))))))


class TiedEmbeddingHead(nn.Module):
    """A language-model habit: the output layer's weight is the embedding's."""

    def __init__(self, vocab=10, width=6):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, x):
        return self.head(self.embedding(x).mean(dim=1))


class SharedRunningMean(nn.Module):
    """Two BatchNorms holding one running-mean buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.bn2 = nn.BatchNorm1d(8)
        self.bn2.running_mean = self.bn1.running_mean
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.bn2(self.bn1(self.a(x))))


class OverlappingViews(nn.Module):
    """Two Parameter objects over the same memory (a view, not the same object)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = nn.Parameter(self.a.weight.detach().t())

    def forward(self, x):
        return self.b(self.a(x))


class SameStorageDisjoint(nn.Module):
    """Two parameters cut from one buffer without overlapping (a fused tensor split in two):
    distinct values, no alias."""

    def __init__(self):
        super().__init__()
        flat = torch.randn(2, 3, 4)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 3)
        self.a.weight = nn.Parameter(flat[0])
        self.b.weight = nn.Parameter(flat[1, :, :3])

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def aliased_skip():
    torch.manual_seed(0)
    return AliasedSkip()


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every normalisation layer non-trivial affine parameters and running statistics,
    so that a structure missing one of their axes changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
    return model.eval()


def clinic_mlp():
    torch.manual_seed(0)
    return ClinicMLP()


def residual_mlp():
    torch.manual_seed(0)
    return ResidualMLP()


def small_resnet():
    torch.manual_seed(0)
    return SmallResNet()
