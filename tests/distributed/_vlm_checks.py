"""Tiny HuggingFace vision-language models and their rank-side check against one process.

Llava (CLIP vision tower, Llama text model), Gemma 3 (SigLIP, per-image
bidirectional attention over image tokens) and Qwen2-VL (its own vision tower,
multimodal RoPE): images and text in one batch, float64.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import torchtp

from ._hf_checks import compare_params

IMAGE = 95  # the image token id of every model here (vocabulary 96)
# float64: sharding only reorders additions, whose error is ~1e-16 relative; a wrong
# slice, a missing sum or a per-rank replica differ by O(1e-2) and more on these sizes.
F64 = {"rtol": 1e-9, "atol": 1e-12}
# Gemma 3's RMSNorm computes in float32 whatever the model's dtype (``x.float()``): a
# q/k norm's weight gradient, summed over the ranks' heads, carries float32 rounding
# (1.7e-7 relative seen), still far below a wrong sum's O(1e-2).
TOL = {"llava": F64, "gemma3": {"rtol": 1e-6, "atol": 1e-9}, "qwen2_vl": F64}


def _text() -> dict[str, Any]:
    return {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128}


def build_vlm(arch: str) -> nn.Module:
    """A tiny ``arch`` model in float64, training mode, weights from seed 0."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "llava":  # 16 px images, 8 px patches: 4 image tokens
        vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=16, patch_size=8,
                                     projection_dim=32)
        model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(
            vision_config=vision, text_config=tf.LlamaConfig(**_text()), image_token_index=IMAGE,
            vision_feature_layer=-1))
    elif arch == "gemma3":  # 16 px images, 4 px patches pooled to 4 image tokens
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, image_size=16, patch_size=4)
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            vision_config=vision, text_config=tf.Gemma3TextConfig(**_text(), head_dim=8),
            mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=94,
            eoi_token_index=93))
    else:  # qwen2_vl: a 4 x 4 grid of 4 px patches, merged 2 x 2: 4 image tokens
        model = tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(
            text_config={**_text(), "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}},
            vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4,
                           "mlp_ratio": 2, "patch_size": 4, "spatial_merge_size": 2,
                           "temporal_patch_size": 1, "in_channels": 3},
            image_token_id=IMAGE, vision_start_token_id=94, vision_end_token_id=93,
            video_token_id=92))
    return model.double().train()


def vlm_batch(arch: str) -> dict[str, torch.Tensor]:
    """Two sequences, each with one image of 4 tokens at positions 2..5 (the same on every rank)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 12), generator=gen)
    ids[:, 1], ids[:, 2:6], ids[:, 6] = 94, IMAGE, 93  # image start, image, image end
    if arch == "qwen2_vl":  # 16 patches of 3 x 4 x 4 values per image
        return {"input_ids": ids, "pixel_values": torch.randn(32, 48, generator=gen).double(),
                "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
                "mm_token_type_ids": (ids == IMAGE).long()}
    batch = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=gen).double()}
    if arch == "gemma3":
        batch["token_type_ids"] = (ids == IMAGE).long()
    return batch


def check_vlms(rank: int, world_size: int, archs: list[str],
               lora_arch: str) -> dict[str, dict[str, Any]]:
    """Per architecture: logits, every gradient, the parameters after one SGD step, the
    next logits and greedy generation from the images equal one process's; the share of
    parameters this rank holds. Then LoRA on ``lora_arch`` (:func:`_lora`)."""
    results = {}
    for arch in archs:
        ref, wrapped = build_vlm(arch), torchtp.DistributedModelWrapper(build_vlm(arch))
        batch = vlm_batch(arch)
        results[arch] = _train_step(ref, wrapped, batch, TOL[arch])
        ref.eval(), wrapped.eval()
        greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(wrapped.generate(**batch, **greedy), ref.generate(**batch, **greedy))
    results["lora"] = {"grads": _lora(lora_arch)}
    return results


def _lora(arch: str) -> int:
    """LoRA on every Linear (``target_modules="all-linear"``: the vision tower's and the
    projector's too) added to the wrapped model, as docs/integrations.md shows: one
    training step as plain PEFT's on one process. Returns the gradients compared."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)  # B != 0
    models = []
    for wrap in (False, True):
        model = build_vlm(arch)
        wrapped = torchtp.DistributedModelWrapper(model) if wrap else None
        torch.manual_seed(5)  # the same adapters drawn at full size on both sides
        models.append((get_peft_model(model, config), wrapped))
    (ref, _), (lora, wrapped) = models
    assert wrapped is not None
    return int(_train_step(ref, wrapped, vlm_batch(arch), TOL[arch], lora)["grads"])


def _train_step(ref: nn.Module, wrapped: nn.Module, batch: dict[str, torch.Tensor],
                tol: dict[str, float], run: nn.Module | None = None) -> dict[str, Any]:
    """One SGD step of ``ref`` and of ``wrapped`` (called as ``run`` when given: a PEFT
    model around its base model, named as ``ref``), compared before and after."""
    named = run or wrapped.base_model
    run = run or wrapped
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, run)]
    logits = [m(**batch).logits for m in (ref, run)]  # (2, 12, 96) on every rank
    torch.testing.assert_close(logits[1], logits[0], **tol)
    for out, opt in zip(logits, opts, strict=True):
        out.square().mean().backward()  # reaches every logit, image positions included
        opt.step()
    grads = compare_params(wrapped, ref, True, tol, named=named, unused_ok=True)
    compare_params(wrapped, ref, False, tol, named=named)
    torch.testing.assert_close(run(**batch).logits, ref(**batch).logits, **tol)
    mine = sum(p.numel() for p in wrapped.base_model.parameters())
    return {"grads": grads, "share": mine / sum(p.numel() for p in ref.parameters()),
            "split": len(wrapped.parallelized_layers)}
