"""Linear evaluation on frozen features: the paper's few-shot ridge regression and a linear probe.

Few-shot (paper section 4.1, big_vision's `fewshot` evaluator, which the paper used): take `shots`
training images per class (1, 5, 10, 25), standardise their pre-logit features (the training
draw's mean and std), append a constant bias feature of 100, solve the L2-regularised least squares
to {-1, 1} one-hot targets in closed form (l2 = 2^10), and report the accuracy of arg-max predictions
on the test set. Repeated over ``seeds`` (3) nested draws of the training images; the result is mean
± std over the draws.

One definition of the draws serves the in-run evaluators (pipeline/train/evaluations.py) and `vitp
eval` (:func:`shot_subsets`): seed s permutes each class's training positions with a generator seeded
s, and its k-shot subset is the first k of each permutation (nested across k within a seed). Both
compute the metrics with :func:`fewshot_accuracy` and name them with :func:`fewshot_metrics`
(``<prefix><k>shot`` the mean over seeds, ``<prefix><k>shot_std`` the std), so for the same weights,
data, shots, seeds and l2 they report the same numbers.

Everything here works on feature tensors, so it is testable without a model or a data loader:
    x: [N, D] float features, y: [N] int64 labels in [0, num_classes).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# big_vision's few-shot regulariser (evaluators/fewshot.py, the paper's: l2_reg 2^10). With a small one
# the regression overfits where shots x classes nears the feature width and accuracy can fall as shots
# rise; this one keeps the numbers comparable with published few-shot curves.
FEWSHOT_L2 = 1024.0
# The bias is a constant feature column. Large, so its weight is barely touched by the L2 penalty:
# ridge on w·b with a column of value c penalises the bias as l2 * (bias / c)^2.
BIAS_CONSTANT = 100.0


@dataclass
class Whitening:
    """Per-feature standardisation fitted on the training features (test uses the same numbers)."""

    mean: torch.Tensor  # [1, D]
    std: torch.Tensor  # [1, D]

    @classmethod
    def fit(cls, x: torch.Tensor) -> Whitening:
        x = x.double()
        return cls(x.mean(0, keepdim=True), x.std(0, unbiased=False, keepdim=True) + 1e-5)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D + 1] float64 (standardised features plus the bias column)."""
        z = (x.double() - self.mean) / self.std
        return F.pad(z, (0, 1), value=BIAS_CONSTANT)


def _check(x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"{what}: need features [N, D] and labels [N]; got {tuple(x.shape)} and {tuple(y.shape)}")


def ridge_fit(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float) -> tuple[Whitening, torch.Tensor]:
    """Closed-form L2-regularised least squares to {-1, 1} targets.

    x: [N, D] features, y: [N] labels -> (whitening, W [D + 1, C]) with
    W = (Xᵀ X + l2 I)⁻¹ Xᵀ T, X the whitened features with the bias column, T = 2 onehot(y) - 1.
    When D + 1 > N the equivalent dual form Xᵀ (X Xᵀ + l2 I)⁻¹ T is solved instead (an N x N
    system: few-shot sets are far smaller than the feature width).
    """
    _check(x, y, "ridge_fit")
    if l2 <= 0:
        raise ValueError(f"ridge_fit: l2 must be > 0; got {l2}")
    white = Whitening.fit(x)
    X = white(x)  # [N, D+1]
    T = 2.0 * F.one_hot(y.long(), num_classes).double() - 1.0  # [N, C]
    n, d = X.shape
    if n >= d:
        A = X.T @ X + l2 * torch.eye(d, dtype=X.dtype)
        W = torch.linalg.solve(A, X.T @ T)
    else:
        A = X @ X.T + l2 * torch.eye(n, dtype=X.dtype)
        W = X.T @ torch.linalg.solve(A, T)
    return white, W


def ridge_predict(white: Whitening, W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x: [M, D] -> predicted labels [M]."""
    return (white(x) @ W).argmax(1)


def ridge_accuracy(train_x, train_y, test_x, test_y, num_classes: int, l2: float) -> float:
    """Fit on (train_x, train_y), return top-1 accuracy on (test_x, test_y)."""
    _check(test_x, test_y, "ridge_accuracy test set")
    white, W = ridge_fit(train_x, train_y, num_classes, l2)
    return (ridge_predict(white, W, test_x) == test_y.long()).double().mean().item()


@dataclass
class Subsets:
    """draws[s][k]: the sorted positions of seed s's k-shot subset; skipped[k]: why k has none."""

    draws: list[dict[int, np.ndarray]]
    skipped: dict[int, str]

    @property
    def shots(self) -> list[int]:
        return sorted(self.draws[0]) if self.draws else []

    def positions(self) -> np.ndarray:
        """Every position some subset holds (sorted): the union over seeds of the largest subsets."""
        if not self.shots:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.concatenate([d[max(d)] for d in self.draws]))


def shot_subsets(labels, shots: Sequence[int], seeds: int, num_classes: int) -> Subsets:
    """The few-shot subsets of a training split, from the label of each of its positions.

    labels: [P] int (position p's class; -1 for a position not to draw from). For each seed s in
    range(seeds), a generator seeded s permutes each class's positions (classes in order); the k-shot
    subset of seed s is the first k of every class's permutation, so within a seed smaller subsets
    lie inside larger ones. A k that some class cannot supply is skipped, with the reason.
    """
    labels = np.asarray(labels, dtype=np.int64)
    order = np.argsort(labels, kind="stable")  # positions grouped by class, in position order
    starts = np.searchsorted(labels[order], np.arange(num_classes + 1))
    by_class = [order[starts[c]:starts[c + 1]] for c in range(num_classes)]
    fewest = min(range(num_classes), key=lambda c: len(by_class[c]), default=None)
    have = len(by_class[fewest]) if fewest is not None else 0
    keep = sorted(k for k in set(shots) if k <= have)
    skipped = {k: f"class {fewest} has {have} training samples, fewer than {k}" for k in sorted(set(shots))
               if k > have}
    draws = []
    for s in range(seeds):
        g = torch.Generator().manual_seed(s)
        perms = [idx[torch.randperm(len(idx), generator=g).numpy()] for idx in by_class]
        draws.append({k: np.sort(np.concatenate([p[:k] for p in perms])) for k in keep})
    return Subsets(draws, skipped)


def fewshot_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                     num_classes: int, shots: Sequence[int] = (1, 5, 10, 25), seeds: int = 3, l2: float = FEWSHOT_L2, *,
                     positions: torch.Tensor | None = None, subsets: Subsets | None = None) -> dict[int, dict]:
    """Few-shot linear accuracy for each shot count: {k: {"mean", "std", "accs": [per seed]}}, or
    {k: {"skipped": reason}} for a k some class cannot supply (a small downstream set may have 20
    images of its rarest class and still support 1/5/10).

    train_x: [N, D], train_y: [N] features and labels of training images; ``positions`` [N]: each
    row's position in the split (default: row i is position i). ``subsets``: the split's
    :func:`shot_subsets` (default: drawn from the rows' own labels). A subset's position without a
    row (its image did not decode) is left out, with a warning. std is over seeds (0 for one seed).
    """
    _check(train_x, train_y, "few-shot train set")
    pos = np.arange(len(train_y)) if positions is None else np.asarray(positions, dtype=np.int64)
    if subsets is None:
        labels = np.full(int(pos.max()) + 1 if len(pos) else 0, -1, dtype=np.int64)
        labels[pos] = train_y.numpy()
        subsets = shot_subsets(labels, shots, seeds, num_classes)
    row = np.full(int(max(pos.max(initial=-1), subsets.positions().max(initial=-1))) + 1, -1, dtype=np.int64)
    row[pos] = np.arange(len(pos))
    out: dict[int, dict] = {k: {"skipped": why} for k, why in subsets.skipped.items() if k in set(shots)}
    for k in sorted(set(shots) - set(out)):
        accs = []
        for draw in subsets.draws:
            idx = row[draw[k]]
            if (idx < 0).any():
                warnings.warn(f"few-shot: {int((idx < 0).sum())} of the {k}-shot images did not decode; "
                              "solved without them", stacklevel=2)
                idx = idx[idx >= 0]
            idx = torch.from_numpy(idx)
            accs.append(ridge_accuracy(train_x[idx], train_y[idx], test_x, test_y, num_classes, l2))
        t = torch.tensor(accs, dtype=torch.float64)
        out[k] = {"mean": t.mean().item(), "std": t.std(unbiased=False).item() if len(accs) > 1 else 0.0,
                  "accs": accs}
    return dict(sorted(out.items()))


def fewshot_metrics(results: dict[int, dict], prefix: str) -> dict[str, float]:
    """{k: {mean, std}} -> {f"{prefix}{k}shot": mean, f"{prefix}{k}shot_std": std} (skipped k: none)."""
    out = {}
    for k, r in results.items():
        if "mean" in r:
            out[f"{prefix}{k}shot"] = r["mean"]
            out[f"{prefix}{k}shot_std"] = r["std"]
    return out


def linear_probe(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                 num_classes: int, l2: float = 1e-4, max_iter: int = 200) -> dict:
    """Multinomial logistic regression on frozen, whitened features (full-batch L-BFGS).

    The objective is convex, so L-BFGS to convergence is the deterministic equivalent of "train a
    linear layer for a few epochs" and needs no learning rate. Returns {"top1", "train_top1"}.
    """
    _check(train_x, train_y, "linear probe train set")
    _check(test_x, test_y, "linear probe test set")
    white = Whitening.fit(train_x)
    Xtr, Xte = white(train_x)[:, :-1], white(test_x)[:, :-1]  # the layer has its own bias
    ytr = train_y.long()
    layer = torch.nn.Linear(Xtr.shape[1], num_classes, dtype=torch.float64)
    torch.nn.init.zeros_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    opt = torch.optim.LBFGS(layer.parameters(), lr=1.0, max_iter=max_iter, history_size=20,
                            tolerance_grad=1e-9, tolerance_change=1e-12, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(layer(Xtr), ytr) + 0.5 * l2 * layer.weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        top1 = (layer(Xte).argmax(1) == test_y.long()).double().mean().item()
        train_top1 = (layer(Xtr).argmax(1) == ytr).double().mean().item()
    return {"top1": top1, "train_top1": train_top1}


PROBE_L2_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)  # the linear probe's l2 candidates (whitened features)


def choose_probe_l2(train_x: torch.Tensor, train_y: torch.Tensor, num_classes: int, grid=PROBE_L2_GRID,
                    holdout_fraction: float = 0.2, seed: int = 0) -> tuple[float, dict[float, float]]:
    """The linear probe's l2, chosen on held-out data: a seeded ``holdout_fraction`` of the training
    rows (at least one, leaving at least one) is scored by a probe fitted on the rest, for each l2 of
    ``grid``; the best held-out top-1 wins (ties: the larger l2). train_x: [N, D], train_y: [N], rows
    in a fixed order (the split's positions), so the choice is the same however many ranks read them.
    -> (l2, {l2: held-out top-1})."""
    _check(train_x, train_y, "linear probe train set")
    n = len(train_y)
    if n < 2:
        raise ValueError(f"linear probe: {n} training image(s); choosing l2 on held-out data needs 2 or more")
    order = torch.from_numpy(np.random.default_rng(seed).permutation(n))
    k = min(n - 1, max(1, round(holdout_fraction * n)))
    held, fit = order[:k], order[k:]
    scores = {float(l2): linear_probe(train_x[fit], train_y[fit], train_x[held], train_y[held], num_classes,
                                      l2=float(l2))["top1"] for l2 in grid}
    return max(scores, key=lambda l2: (scores[l2], l2)), scores


def format_fewshot(results: dict[int, dict]) -> str:
    """One line per shot count, e.g. '5-shot: 71.20 ± 0.85 % (3 seeds)'."""
    lines = []
    for k, r in results.items():
        if "skipped" in r:
            lines.append(f"{k}-shot: skipped ({r['skipped']})")
        else:
            lines.append(f"{k}-shot: {100 * r['mean']:.2f} ± {100 * r['std']:.2f} % ({len(r['accs'])} seeds)")
    return "\n".join(lines)
