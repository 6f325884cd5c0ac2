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
