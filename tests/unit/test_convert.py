"""Conversions and loading: official JAX .npz layouts, timm files, vitp safetensors, refusals."""

import os
import pickle

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file

from pipeline.model import (
    build_vit,
    jax_npz_to_vitp,
    load_pretrained,
    load_state_dict_into,
    timm_to_vitp,
    vitp_to_jax_npz,
    vitp_to_timm,
)
from pipeline.weights import save_model as save_safetensors  # noqa: E402

TINY = dict(width=32, depth=2, heads=4, mlp_dim=64, patch=4, img_size=16, num_classes=5)


def _random_vit(seed=0, **kw):
    m = build_vit(**{**TINY, **kw}).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def _logits(m, x):
    with torch.no_grad():
        return m.eval()(x)


@pytest.mark.parametrize("naming", ["released", "current"])
@pytest.mark.parametrize("kw", [
    dict(pool="token"), dict(pool="gap", class_token=False),
    dict(pool="token", representation_size=24), dict(pool="gap", class_token=False,
                                                     representation_size=24),
])
def test_jax_npz_round_trip(tmp_path, naming, kw):
    src = _random_vit(**kw)
    arrays = vitp_to_jax_npz(src, naming=naming)
    d = TINY["width"]
    # the official layout, key by key
    blk = "Transformer/encoderblock_1/"
    mha = "MultiHeadDotProductAttention_1" if naming == "released" else "MultiHeadDotProductAttention_0"
    mlp = "MlpBlock_3" if naming == "released" else "MlpBlock_0"
    assert arrays[f"{blk}{mha}/query/kernel"].shape == (d, 4, d // 4)
    assert arrays[f"{blk}{mha}/out/kernel"].shape == (4, d // 4, d)
    assert arrays[f"{blk}{mlp}/Dense_0/kernel"].shape == (d, 64)
    assert arrays["embedding/kernel"].shape == (4, 4, 3, d)
    n_tok = 16 + (1 if kw.get("class_token", True) else 0)
    assert arrays["Transformer/posembed_input/pos_embedding"].shape == (1, n_tok, d)
    assert ("cls" in arrays) == kw.get("class_token", True)
    assert ("pre_logits/kernel" in arrays) == ("representation_size" in kw)
    path = tmp_path / "ckpt.npz"
    np.savez(path, **arrays)
    dst = build_vit(**{**TINY, **kw})
    report = load_pretrained(dst, path)
    assert report.missing == [] and report.unexpected == []
    assert report.resampled_posemb is None and not report.head_reset
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(_logits(dst, x), _logits(src, x), atol=1e-5, rtol=0)


def test_jax_to_vitp_inverts_export_exactly():
    src = _random_vit()
    back = jax_npz_to_vitp(vitp_to_jax_npz(src.state_dict(), "current", heads=4))
    for k, v in src.state_dict().items():
        assert torch.equal(back[k], v), k


def test_big_vision_layout_posemb_without_cls_row():
    src = _random_vit()
    arrays = vitp_to_jax_npz(src, naming="current")
    pe = arrays.pop("Transformer/posembed_input/pos_embedding")
    # big_vision adds pos-emb before prepending cls: fold the cls row into the token
    arrays["pos_embedding"] = pe[:, 1:]
    arrays["cls"] = arrays["cls"] + pe[:, :1]
    dst = build_vit(**TINY)
    load_state_dict_into(dst, jax_npz_to_vitp(arrays))
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(_logits(dst, x), _logits(src, x), atol=1e-5, rtol=0)


def _timm_vit(**kw):
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0,
                             num_classes=5, global_pool="token", **kw).eval()


@pytest.mark.parametrize("layout", ["released", "big_vision"])
def test_npz_export_read_by_timm_and_by_vitp_gives_the_same_logits(tmp_path, layout):
    """An independent reader: timm's own loader for Google's .npz files (VisionTransformer.load_pretrained)
    reads the file vitp exports, and vitp's loader reads the same file; both models compute the source's
    logits. A layout mistake that vitp's exporter and loader share cannot pass this."""
    src = _random_vit()
    if layout == "released":  # google-research/vision_transformer checkpoints: pos-emb with the cls row
        arrays = vitp_to_jax_npz(src, naming="released")
        ref = _timm_vit()
    else:  # big_vision: per-type naming, pos-emb of the patches only, added before the cls token is prepended
        arrays = vitp_to_jax_npz(src, naming="current")
        pe = arrays.pop("Transformer/posembed_input/pos_embedding")
        arrays["pos_embedding"], arrays["cls"] = pe[:, 1:], arrays["cls"] + pe[:, :1]
        ref = _timm_vit(no_embed_class=True)
    path = tmp_path / f"{layout}.npz"
    np.savez(path, **arrays)
    with torch.no_grad():
        for p in ref.parameters():
            p.fill_(7.0)  # every weight timm fails to read shows up in the logits
    ref.load_pretrained(str(path))
    assert all((p != 7.0).any() for p in ref.parameters())
    ours = build_vit(**TINY)
    report = load_pretrained(ours, path)
    assert report.missing == [] and report.unexpected == []
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    want = _logits(src, x)
    assert want.abs().max() > 0.1  # logits with something in them
    torch.testing.assert_close(_logits(ref, x), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_logits(ours, x), want, atol=1e-4, rtol=1e-4)


def test_npz_into_larger_model_resamples_posemb_and_resets_head(tmp_path):
    src = _random_vit(representation_size=24)
    np.savez(tmp_path / "p.npz", **vitp_to_jax_npz(src))
    dst = build_vit(**{**TINY, "img_size": (24, 32), "num_classes": 7})  # fine-tune: no pre-logits
    r = load_pretrained(dst, tmp_path / "p.npz")
    assert r.resampled_posemb == ((4, 4), (6, 8)) and r.head_reset
    assert r.unexpected == ["pre_logits.bias", "pre_logits.weight"] and r.missing == []
    assert torch.count_nonzero(dst.head.weight) == 0
    torch.testing.assert_close(dst.pos_embed[:, :1], src.pos_embed[:, :1])  # cls row kept aside
    torch.testing.assert_close(dst.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight)


@pytest.mark.parametrize("suffix", [".pth", ".bin", ".safetensors"])
def test_timm_files_load(tmp_path, suffix):
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4,
                            embed_dim=32, depth=2, num_heads=4, mlp_ratio=2, num_classes=5).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    path = tmp_path / f"timm{suffix}"
    if suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    else:
        torch.save({"state_dict": ref.state_dict()}, path)
    dst = build_vit(**TINY)
    r = load_pretrained(dst, path)
    assert r.missing == [] and r.unexpected == [] and "timm" in r.source
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(_logits(dst, x), _logits(ref, x), atol=1e-5, rtol=0)


def test_vitp_safetensors_round_trip_nonsquare_grid(tmp_path):
    src = _random_vit(img_size=(16, 24), representation_size=8)
    save_safetensors(src, tmp_path / "m.safetensors")
    same = build_vit(**src.config)
    r = load_pretrained(same, tmp_path / "m.safetensors")
    assert (r.missing, r.unexpected, r.resampled_posemb) == ([], [], None)
    x = torch.randn(1, 3, 16, 24)
    torch.testing.assert_close(_logits(same, x), _logits(src, x), atol=0, rtol=0)
    # a 4x6 grid has 24 positions, not a square: the grid comes from the file's config metadata
    bigger = build_vit(**{**src.config, "img_size": (32, 32)})
    assert load_pretrained(bigger, tmp_path / "m.safetensors").resampled_posemb == ((4, 6), (8, 8))


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_that_runs_code_is_refused(tmp_path):
    victim = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"pos_embed": _Evil(str(victim))}, f, protocol=2)
    with pytest.raises(ValueError, match="evil.pth"):
        load_pretrained(build_vit(**TINY), path)
    torch.save({"x": _Evil(str(victim))}, tmp_path / "evil_zip.bin")
    assert not victim.exists()  # torch.save pickles the reduce tuple; nothing ran yet
    with pytest.raises(ValueError, match="evil_zip.bin"):
        load_pretrained(build_vit(**TINY), tmp_path / "evil_zip.bin")
    assert not victim.exists()
    assert not os.path.exists(victim)


def test_shape_mismatch_names_key_and_shapes():
    sd = _random_vit().state_dict()
    sd["blocks.0.mlp.fc1.weight"] = torch.zeros(99, 32)
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.fc1\.weight.*\(99, 32\).*\(64, 32\)"):
        load_state_dict_into(build_vit(**TINY), sd, source="x")


def test_report_lists_missing_and_unexpected_exactly():
    sd = _random_vit().state_dict()
    del sd["norm.weight"]
    sd["extra.thing"] = torch.zeros(1)
    r = load_state_dict_into(build_vit(**TINY), {"module." + k: v for k, v in sd.items()})
    assert r.missing == ["norm.weight"] and r.unexpected == ["extra.thing"]


def test_class_token_checkpoint_into_gap_model():
    src = _random_vit()
    dst = build_vit(**TINY, pool="gap", class_token=False)
    r = load_state_dict_into(dst, src.state_dict())
    assert r.unexpected == ["cls_token"] and r.resampled_posemb is None
    torch.testing.assert_close(dst.pos_embed, src.pos_embed[:, 1:])


def test_timm_only_features_are_refused():
    sd = vitp_to_timm(_random_vit().state_dict())
    with pytest.raises(ValueError, match="fc_norm.weight"):
        timm_to_vitp({**sd, "fc_norm.weight": torch.ones(32)})
    with pytest.raises(ValueError, match="ls1"):
        timm_to_vitp({**sd, "blocks.0.ls1.gamma": torch.ones(32)})
    with pytest.raises(ValueError, match="pre_logits"):
        vitp_to_timm(_random_vit(representation_size=8).state_dict())
