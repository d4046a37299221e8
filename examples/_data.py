"""Data the examples share, all of it shipped with the installation (nothing is downloaded).

- `stdlib_text`: source files of Python's standard library, concatenated (character-level LM).
- `stdlib_sentences`: docstring and comment lines of the same files, one English-like line each (MLM).
- `CharVocab`: byte-free character vocabulary with reserved special tokens.
- `load_digits_32`: scikit-learn's 8x8 digits, normalized and upsampled to 32x32 (CNN).
- `fixed_batches`: shuffled index batches of one size, the last partial batch of an epoch dropped.
"""
from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# A fixed list keeps the corpus identical across runs and machines with the same Python version.
STDLIB_FILES = ("argparse.py", "textwrap.py", "dataclasses.py", "functools.py", "inspect.py",
                "pathlib.py", "subprocess.py", "typing.py", "enum.py", "difflib.py")


def _stdlib_sources(files: tuple[str, ...] = STDLIB_FILES) -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = [(name, (root / name).read_text(encoding="utf-8")) for name in files if (root / name).exists()]
    if not sources:
        raise FileNotFoundError("none of %s found under %s" % (", ".join(files), root))
    return sources


def stdlib_text(max_chars: int = 400_000, dedent: bool = True) -> str:
    """The first `max_chars` characters of the listed standard-library modules, ASCII only. With
    `dedent`, lines lose their indentation and blank lines are dropped: a small model then spends its
    capacity on words and syntax instead of predicting runs of spaces."""
    text = "\n".join(source for _, source in _stdlib_sources())
    if dedent:
        text = "\n".join(line.strip() for line in text.splitlines() if line.strip())
    return text.encode("ascii", "ignore").decode("ascii")[:max_chars]


_WORDS = re.compile(r"[A-Za-z][A-Za-z'\-]*|[0-9]+|[.,;:!?()]")


def stdlib_sentences(min_words: int = 4, max_words: int = 40) -> list[list[str]]:
    """Comment lines and docstring lines of the standard-library modules, tokenized into lowercase words
    and punctuation; lines with fewer than `min_words` words are skipped and long ones are cut."""
    sentences: list[list[str]] = []
    for _, source in _stdlib_sources():
        in_docstring = False
        for line in source.splitlines():
            stripped = line.strip()
            quotes = stripped.count('"""') + stripped.count("'''")
            if stripped.startswith("#"):
                candidate = stripped.lstrip("#")
            elif in_docstring or quotes:
                candidate = stripped.replace('"""', " ").replace("'''", " ")
            else:
                candidate = ""
            if quotes % 2 == 1:
                in_docstring = not in_docstring
            words = _WORDS.findall(candidate.lower())
            if len(words) >= min_words and sum(w.isalpha() for w in words) >= min_words:
                sentences.append(words[:max_words])
    return sentences


@dataclass
class CharVocab:
    """Characters of a text, each mapped to an id; `specials` come first (e.g. [PAD], [MASK])."""
    tokens: list[str]

    @classmethod
    def build(cls, items, specials: tuple[str, ...] = (), min_count: int = 1) -> "CharVocab":
        counts: dict[str, int] = {}
        for item in items:
            counts[item] = counts.get(item, 0) + 1
        kept = sorted(t for t, c in counts.items() if c >= min_count and t not in specials)
        return cls(list(specials) + kept)

    def __post_init__(self) -> None:
        self.index = {t: i for i, t in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, items, unknown: int | None = None) -> list[int]:
        return [self.index.get(t, unknown) if unknown is not None else self.index[t] for t in items]

    def decode(self, ids) -> str:
        return "".join(self.tokens[int(i)] for i in ids)


def load_digits_32(test_fraction: float = 0.2, seed: int = 0, dither: float = 0.02):
    """scikit-learn's 1797 8x8 digits, normalized with the training statistics and bilinearly upsampled
    to 32x32: (train_x, train_y, test_x, test_y), images shaped (N, 1, 32, 32).

    `dither` adds fixed Gaussian noise of that standard deviation. Without it the blank background is
    exactly constant, so max pooling sees exact ties whose winner (and so where the gradient goes)
    depends on the last bit of the convolution before it: two correct implementations that round
    differently then train measurably differently from the first step."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    n_test = int(len(order) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    images = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1)
    mean, std = images[train].mean(), images[train].std()
    images = F.interpolate((images - mean) / std, size=(32, 32), mode="bilinear", align_corners=False)
    if dither:
        images = images + dither * torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))
    labels = torch.from_numpy(digits.target.astype(np.int64))
    return images[train], labels[train], images[test], labels[test]


def fixed_batches(n_samples: int, batch_size: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Index batches for `steps` steps, reshuffled every epoch; the last partial batch of each epoch is
    dropped so every step has the same shapes and pydisc reuses one compiled plan."""
    if n_samples < batch_size:
        raise ValueError("batch size %d is larger than the %d samples" % (batch_size, n_samples))
    g = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    while len(batches) < steps:
        perm = torch.randperm(n_samples, generator=g)
        batches += list(perm[: n_samples - n_samples % batch_size].split(batch_size))
    return batches[:steps]
