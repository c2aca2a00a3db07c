"""Few-shot ridge regression and linear probe on tiny feature sets, checked against closed forms."""

import numpy as np
import pytest
import torch

from pipeline.eval.linear import (
    BIAS_CONSTANT,
    fewshot_accuracy,
    format_fewshot,
    linear_probe,
    ridge_accuracy,
    ridge_fit,
    shot_subsets,
)


def _hand_ridge(x: np.ndarray, y: np.ndarray, num_classes: int, l2: float) -> np.ndarray:
    """The textbook primal solution, written independently in numpy."""
    mean, std = x.mean(0), x.std(0) + 1e-5
    X = np.concatenate([(x - mean) / std, np.full((len(x), 1), BIAS_CONSTANT)], 1)
    T = -np.ones((len(y), num_classes))
    T[np.arange(len(y)), y] = 1.0
    return np.linalg.inv(X.T @ X + l2 * np.eye(X.shape[1])) @ X.T @ T


def test_ridge_matches_hand_closed_form_primal():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3))  # N > D + 1: primal system
    y = np.array([0, 1, 2] * 4)
    _, W = ridge_fit(torch.from_numpy(x), torch.from_numpy(y), 3, l2=0.5)
    np.testing.assert_allclose(W.numpy(), _hand_ridge(x, y, 3, 0.5), rtol=1e-9, atol=1e-10)


def test_ridge_dual_form_equals_primal_when_features_outnumber_points():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 9))  # N < D + 1: the dual N x N system is solved
    y = np.array([0, 1, 0, 1])
    _, W = ridge_fit(torch.from_numpy(x), torch.from_numpy(y), 2, l2=2.0)
    assert W.shape == (10, 2)
    np.testing.assert_allclose(W.numpy(), _hand_ridge(x, y, 2, 2.0), rtol=1e-8, atol=1e-10)


def test_ridge_one_feature_by_hand():
    # One feature: x = [-1, 1] whitens to [-1, 1] (std 1, up to the 1e-5 guard); with the bias column
    # c = 100, XᵀX = [[2, 0], [0, 2c²]], XᵀT for class 1 targets [-1, 1] is [2, 0]
    # -> w = 2 / (2 + l2) and bias 0. With l2 = 2, w = 0.5.
    x = torch.tensor([[-1.0], [1.0]])
    _, W = ridge_fit(x, torch.tensor([0, 1]), 2, l2=2.0)
    s = 1 / (1 + 1e-5)
    assert W[0, 1].item() == pytest.approx(2 * s / (2 * s * s + 2.0), rel=1e-12)
    assert W[1, 1].item() == pytest.approx(0.0, abs=1e-12)
    assert W[0, 0].item() == pytest.approx(-W[0, 1].item(), rel=1e-12)


def test_ridge_separates_clusters():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 4
    y = torch.arange(4).repeat(30)
    x = centres[y] + torch.randn(120, 16, generator=g)
    assert ridge_accuracy(x[:40], y[:40], x[40:], y[40:], 4, l2=1.0) == 1.0


def test_subsets_per_seed_are_the_first_k_of_a_permutation_seeded_by_it():
    labels = np.array([0, 1, 2] * 10)
    sub = shot_subsets(labels, [5, 1], seeds=3, num_classes=3)
    assert sub.shots == [1, 5] and sub.skipped == {} and len(sub.draws) == 3
    for s, draw in enumerate(sub.draws):
        g = torch.Generator().manual_seed(s)  # the definition, written out: classes in order, one generator
        perms = [np.flatnonzero(labels == c)[torch.randperm(10, generator=g).numpy()] for c in range(3)]
        for k in (1, 5):
            assert np.array_equal(draw[k], np.sort(np.concatenate([p[:k] for p in perms])))
            assert np.bincount(labels[draw[k]], minlength=3).tolist() == [k, k, k]
        assert set(draw[1]) <= set(draw[5])  # nested within a seed
    assert not np.array_equal(sub.draws[0][5], sub.draws[1][5])  # seeds draw differently
    again = shot_subsets(labels, [1, 5], seeds=3, num_classes=3)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(sub.draws, again.draws) for k in (1, 5))
    want = np.unique(np.concatenate([d[5] for d in sub.draws]))
    assert np.array_equal(sub.positions(), want)  # what a run reads: the union of the largest subsets


def test_subsets_skip_what_a_class_cannot_supply_and_ignore_unlabelled_positions():
    labels = np.array([0] * 10 + [1] * 6 + [-1] * 4 + [2] * 8)
    sub = shot_subsets(labels, [5, 1, 10], seeds=2, num_classes=3)
    assert sub.shots == [1, 5] and sub.skipped == {10: "class 1 has 6 training samples, fewer than 10"}
    assert all(labels[d[5]].min() >= 0 for d in sub.draws)
    none = shot_subsets(labels, [7], seeds=2, num_classes=3)
    assert none.shots == [] and len(none.positions()) == 0


def test_fewshot_accuracy_reads_subsets_by_position():
    """Rows in any order, with their positions, score as the rows in position order."""
    g = torch.Generator().manual_seed(3)
    y = torch.arange(3).repeat(8)
    x = torch.randn(3, 6, generator=g)[y] * 2 + torch.randn(24, 6, generator=g)
    ref = fewshot_accuracy(x, y, x, y, 3, shots=(1, 3), seeds=3, l2=1.0)
    perm = torch.randperm(24, generator=g)
    got = fewshot_accuracy(x[perm], y[perm], x, y, 3, shots=(1, 3), seeds=3, l2=1.0, positions=perm)
    for k in (1, 3):
        assert got[k]["accs"] == pytest.approx(ref[k]["accs"], abs=1e-12)
    sub = shot_subsets(y.numpy(), (1, 3), 3, 3)
    rows = torch.from_numpy(sub.positions())  # only the subsets' rows, as a run reads them
    part = fewshot_accuracy(x[rows], y[rows], x, y, 3, shots=(1, 3), seeds=3, l2=1.0, positions=rows, subsets=sub)
    assert [part[k]["mean"] for k in (1, 3)] == pytest.approx([ref[k]["mean"] for k in (1, 3)], abs=1e-12)


def test_fewshot_eval_mean_std_over_seeds_and_skips_impossible_shots():
    g = torch.Generator().manual_seed(1)
    centres = torch.randn(3, 8, generator=g) * 2
    y = torch.arange(3).repeat(12)
    x = centres[y] + torch.randn(36, 8, generator=g)
    res = fewshot_accuracy(x, y, x, y, 3, shots=(1, 5, 25), seeds=4, l2=1.0)
    assert set(res) == {1, 5, 25}
    for k in (1, 5):
        accs = np.array(res[k]["accs"])
        assert len(accs) == 4
        assert res[k]["mean"] == pytest.approx(accs.mean())
        assert res[k]["std"] == pytest.approx(accs.std())
    assert res[5]["mean"] >= res[1]["mean"] - 0.05  # more shots, not worse (well-separated data)
    assert "fewer than 25" in res[25]["skipped"]
    text = format_fewshot(res)
    assert "5-shot:" in text and "(4 seeds)" in text and "25-shot: skipped" in text


def test_linear_probe_learns_linearly_separable_labels():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(600, 6, generator=g)
    w = torch.randn(6, 3, generator=g)
    y = (x @ w).argmax(1)
    r = linear_probe(x[:500], y[:500], x[500:], y[500:], 3)
    assert r["train_top1"] > 0.95
    assert r["top1"] > 0.9


def test_wrong_shapes_fail_clearly():
    with pytest.raises(ValueError, match="features \\[N, D\\] and labels \\[N\\]"):
        ridge_fit(torch.zeros(3, 2), torch.zeros(4, dtype=torch.long), 2, 1.0)
    with pytest.raises(ValueError, match="l2 must be > 0"):
        ridge_fit(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), 2, 0.0)


def test_fewshot_data_names():
    from pipeline.config import ConfigError, fewshot_sets, load_config

    assert fewshot_sets(["/d/digits/", "pets=/d/shards"]) == [("digits", "/d/digits/"), ("pets", "/d/shards")]
    base = ["model.name=vit_ti16", "eval.fewshot_data=[/a/shards,/b/shards]"]
    with pytest.raises(ConfigError, match="eval.fewshot_data: each set needs its own name"):
        load_config(None, base, world_size=1)
    assert load_config(None, [*base[:1], "eval.fewshot_data=[a=/a/shards,b=/b/shards]"], world_size=1)


def test_submit_checks_the_fewshot_folders_before_queueing(tmp_path, repo_root):
    import json

    from launch.submit import SubmitError, check_data, load_submit_config

    split = {"filenames": ["a.tar"]}
    (tmp_path / "data").mkdir()
    (tmp_path / "data/_info.json").write_text(json.dumps({"splits": {"train": split, "val": split}}))
    (tmp_path / "few").mkdir()
    (tmp_path / "few/_info.json").write_text(json.dumps({"splits": {"train": split}}))
    cfg = load_submit_config(str(repo_root / "configs/pretrain/tiny_cpu.yaml"),
                             [f"data.path={tmp_path / 'data'}", f"eval.fewshot_data=[{tmp_path / 'few'}]"])
    with pytest.raises(SubmitError, match=r"^eval.fewshot_data: 'test' not in .*few/_info.json \(has: train\)"):
        check_data(cfg, "pretrain")
    check_data(cfg, "eval")  # `vitp eval` runs no in-run evaluators


def _reference_fewshot_scores(xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, num_classes: int,
                              l2: float) -> np.ndarray:
    """big_vision's few-shot closed form, written from its definition in numpy alone: standardise by
    the training draw, a bias feature of 100, ridge to {-1, 1} targets; the N x N (dual) system when
    the draw has fewer points than features, the D x D (primal) one otherwise. -> test scores [M, C]."""
    mu, sd = xtr.mean(axis=0), np.sqrt(((xtr - xtr.mean(axis=0)) ** 2).mean(axis=0)) + 1e-5

    def feats(a):
        return np.hstack([(a - mu) / sd, 100.0 * np.ones((a.shape[0], 1))])

    X, T = feats(xtr), 2.0 * np.eye(num_classes)[ytr] - 1.0
    n, d = X.shape
    if n < d:
        W = X.T @ np.linalg.solve(X @ X.T + l2 * np.eye(n), T)
    else:
        W = np.linalg.solve(X.T @ X + l2 * np.eye(d), X.T @ T)
    return feats(xte) @ W


@pytest.mark.parametrize("n_per_class,dim", [(25, 8), (2, 64)], ids=["primal N>=D", "dual N<D"])
def test_fewshot_default_l2_agrees_with_an_independent_numpy_reference(n_per_class, dim):
    from pipeline.config.sections import EvalCfg
    from pipeline.eval.linear import FEWSHOT_L2, ridge_predict

    assert FEWSHOT_L2 == 2.0 ** 10 == EvalCfg().fewshot_l2  # big_vision's, everywhere by default
    rng = np.random.default_rng(7)
    c = 5
    centres = 3.0 * rng.normal(size=(c, dim))
    ytr = np.repeat(np.arange(c), n_per_class)
    xtr = centres[ytr] + rng.normal(size=(len(ytr), dim)) * rng.uniform(0.5, 4.0, size=dim)
    yte = rng.integers(0, c, size=40)
    xte = centres[yte] + rng.normal(size=(40, dim))
    assert (len(ytr) >= dim + 1) == (n_per_class == 25)
    ref = _reference_fewshot_scores(xtr, ytr, xte, c, FEWSHOT_L2)
    white, W = ridge_fit(torch.from_numpy(xtr), torch.from_numpy(ytr), c, FEWSHOT_L2)
    got = (white(torch.from_numpy(xte)) @ W).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert (ridge_predict(white, W, torch.from_numpy(xte)).numpy() == ref.argmax(1)).all()
    acc = (ref.argmax(1) == yte).mean()
    res = fewshot_accuracy(torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte),
                           torch.from_numpy(yte), c, shots=(n_per_class,), seeds=1)
    assert res[n_per_class]["mean"] == pytest.approx(acc, abs=1e-12)


def test_probe_l2_is_chosen_on_held_out_rows():
    from pipeline.eval.linear import choose_probe_l2

    rng = np.random.default_rng(3)
    y = np.repeat(np.arange(3), 20)
    x = torch.from_numpy(rng.normal(size=(60, 6)) + 2.0 * np.eye(3, 6)[y])
    y = torch.from_numpy(y)
    l2, scores = choose_probe_l2(x, y, 3, grid=(1e-4, 1.0, 100.0), holdout_fraction=0.25, seed=0)
    held = torch.from_numpy(np.random.default_rng(0).permutation(60))[:15]
    fit = torch.from_numpy(np.random.default_rng(0).permutation(60))[15:]
    for c, s in scores.items():  # each candidate: fitted on the other 45 rows, scored on the 15 held out
        assert s == linear_probe(x[fit], y[fit], x[held], y[held], 3, l2=c)["top1"]
    assert scores[l2] == max(scores.values()) and l2 == max(c for c, s in scores.items() if s == scores[l2])
    with pytest.raises(ValueError, match="needs 2 or more"):
        choose_probe_l2(x[:1], y[:1], 3)
