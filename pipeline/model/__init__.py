"""The ViT model family: architecture, weight conversion/loading, pos-emb resampling, FLOPs."""

from pipeline.model.convert import (
    jax_npz_to_vitp,
    timm_to_vitp,
    vitp_to_jax_npz,
    vitp_to_timm,
)
from pipeline.model.flops import train_step_flops, vit_forward_flops
from pipeline.model.load import LoadReport, load_pretrained, load_state_dict_into
from pipeline.model.posemb import resample_posemb
from pipeline.model.vit import VARIANTS, ViT, build_vit, draw_keep, kept_patches, reset_head

__all__ = [
    "VARIANTS", "LoadReport", "ViT", "build_vit", "draw_keep", "jax_npz_to_vitp", "kept_patches", "load_pretrained",
    "load_state_dict_into", "resample_posemb", "reset_head", "timm_to_vitp",
    "train_step_flops", "vit_forward_flops", "vitp_to_jax_npz", "vitp_to_timm",
]
