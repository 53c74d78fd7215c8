"""Rank functions: ``nn.Sequential`` and a torchtitan-style chain of blocks as pipeline
stages (``block_stage``), against one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtp.pipeline import PipelineSchedule, block_stage, decoder_stage

from ._pipeline_checks import TOL, VOCAB, batch

ROWS, FEATURES, CLASSES = 8, 16, 5


def build_sequential() -> nn.Sequential:
    """Six blocks (Linear + Tanh pairs and a head), float64, the same on every rank."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(5):
        blocks += [nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh())]
    return nn.Sequential(*blocks, nn.Linear(FEATURES, CLASSES)).double()


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))  # (B, T, H)


class TitanLM(nn.Module):
    """A torchtitan-style LM: embeddings, a ModuleDict of blocks, norm, output head."""

    def __init__(self, layers: int = 4, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict({str(i): _Block(dim) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, H); hidden states on later stages
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))  # (B, T, V)


def _summed_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="sum")


def check_block_stages(rank: int, world_size: int) -> list[Any]:
    """An ``nn.Sequential`` classifier (a user loss, a mean over rows) under GPipe and a
    torchtitan-style LM (the default causal-LM loss) under 1F1B: the loss and every
    gradient equal to one process's."""
    ref, seq = build_sequential(), build_sequential()
    stage = block_stage(seq, rank, world_size)
    x = torch.randn(ROWS, FEATURES, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, CLASSES, (ROWS,), generator=torch.Generator().manual_seed(2))
    loss = PipelineSchedule(stage, 4, "gpipe", loss_fn=_summed_ce).step(x, y)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    _compare(stage, ref, loss, ref_loss)
    ref_lm, lm = TitanLM(), TitanLM()
    titan = block_stage(lm, rank, world_size, blocks="layers", first=["tok_embeddings"],
                        last=["norm", "output"])
    loss = PipelineSchedule(titan, 4, "1f1b").step(*batch(0))
    ids, labels = batch(0)
    ref_loss = F.cross_entropy(ref_lm(ids)[:, :-1].reshape(-1, VOCAB),  # as HF's: shifted
                               labels[:, 1:].reshape(-1), ignore_index=-100)
    ref_loss.backward()
    _compare(titan, ref_lm, loss, ref_loss)
    return [list(stage.layers), list(titan.layers),
            sorted(n for n, _ in titan.model.named_parameters())]


def _compare(stage: Any, ref: nn.Module, loss: torch.Tensor | None,
             ref_loss: torch.Tensor) -> None:
    if stage.is_last:
        assert loss is not None
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    want = dict(ref.named_parameters())
    for name, p in stage.model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, **TOL, msg=name)


def build_arch(arch: str) -> nn.Module:
    """A tiny 4-layer float64 causal LM of ``arch`` (the same weights on every rank)."""
    import transformers as tf

    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 32}
    configs = {
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4,
                                      n_positions=32, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "mistral": lambda: tf.MistralConfig(**common),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=8),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, head_dim=8, num_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=16),
    }
    torch.manual_seed(0)
    config = configs[arch]()
    # transformers' default experts kernel (grouped_mm) has no float64 kernel on CPU; the
    # loop over experts computes the same sums (as in _moe_checks).
    config._experts_implementation = "eager"
    return tf.AutoModelForCausalLM.from_config(config).double()


def check_architectures(rank: int, world_size: int, archs: list[str]) -> list[Any]:
    """Each architecture as pp 2 (1F1B, 4 microbatches, uneven padding): the loss and every
    gradient equal to one process's (GPT-2: tied embeddings, learned positions)."""
    held = []
    for arch in archs:
        ref, model = build_arch(arch), build_arch(arch)
        stage = decoder_stage(model, rank, world_size)
        loss = PipelineSchedule(stage, 4, "1f1b").step(*batch(0))
        ids, labels = batch(0)
        ref_loss = F.cross_entropy(ref(input_ids=ids).logits[:, :-1].reshape(-1, VOCAB),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        ref_loss.backward()
        if stage.is_last:
            assert loss is not None
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=arch)
        want = dict(ref.named_parameters(remove_duplicate=False))
        for name, p in stage.model.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, **TOL, msg=f"{arch}: {name}")
        held.append((arch, stage.tied, sum(1 for _ in stage.model.parameters())))
    return held
