"""One head-boundary rule for every layer that touches heads, checked at wrap time.

At tp 3 the 8 heads of the tiny BERT/RoBERTa split 3/3/2 (24/24/16 features):
q/k/v by whole heads and ``attention.output.dense`` (in the sibling
``BertSelfOutput``) by the same heads, not by balanced columns (22/21/21).
The automatic plan splits uneven-head attention of a torchtitan-style Llama
(4 heads, 2 KV heads: 1/1/2) and a timm-style ViT (fused ``qkv``, 4 heads:
2/1/1) instead of keeping it replicated, and Qwen3's (per-head_dim
``q_norm``/``k_norm``). BLOOM's ALiBi slopes and KV cache follow the same heads
(generate). A plan whose output projection cuts other
boundaries is refused at wrap time on every rank.
"""

from __future__ import annotations

import pytest

from torchtp import DistributedModelWrapper
from torchtp.core.layouts import head_share
from torchtp.plans import Rowwise
from torchtp.plans.styles_heads import HeadColumns

from ._hf_checks import check_arch
from ._hf_models import build
from .test_auto_plan import AUTO, _check_kinds

BERT_PLAN = {
    "bert.encoder.layer.*.attention.self.query": "colwise",
    "bert.encoder.layer.*.attention.self.key": "colwise",
    "bert.encoder.layer.*.attention.self.value": "colwise",
}


# A plan written for PyTorch's parallelize_module: Qwen3's per-head_dim q_norm/k_norm not
# named (so plainly replicated), k/v in transformers 5.25's "unit_colwise".
QWEN3_USER_PLAN = {"model.layers.*.self_attn.q_proj": "colwise",
                   "model.layers.*.self_attn.k_proj": "unit_colwise",
                   "model.layers.*.self_attn.v_proj": "unit_colwise",
                   "model.layers.*.self_attn.o_proj": "rowwise",
                   "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                   "model.layers.*.mlp.down_proj": "rowwise"}


class _BalancedColumns(Rowwise):
    """A user style that splits input columns balanced, ignoring heads (22/21/21 of 64)."""


def _at_tp_3(rank: int, world_size: int) -> dict:
    out: dict = {}
    # HF path: torchtp's built-in plan (also what plan="auto" picks for BERT/RoBERTa),
    # and the dataflow automatic plan on a BERT whose plans are hidden.
    # Qwen3 without a plan: per-head_dim q_norm/k_norm replicated, gradients summed.
    for arch, unplanned in (("bert", False), ("roberta", False), ("bert", True), ("bloom", False),
                            ("qwen3", True)):
        got = check_arch(rank, world_size, arch, 1, unplanned)
        out[f"{arch}{'-auto' if unplanned else ''}"] = got
    # Plans that keep q_norm/k_norm plainly replicated inside the head split: the HF plan
    # (as transformers 5.25's Param2MoE ships its own) and the user's.
    out["qwen3-bare-norms"] = check_arch(rank, world_size, "qwen3-bare-norms", 1)
    out["qwen3-user"] = check_arch(rank, world_size, "qwen3", 1, plan=QWEN3_USER_PLAN)
    # The same inside an MLP: Apertus's xIELU scalars between up_proj and down_proj.
    out["apertus"] = check_arch(rank, world_size, "apertus", 1)
    # torchtitan-style Llama and timm-style ViT through the automatic plan.
    out.update(_check_kinds(rank, world_size, ["titan", "vit"]))
    return out


def test_uneven_heads_at_tp_3_are_exact_and_split(ranks):
    # Outputs, every gradient and one SGD step equal the unsharded model's (check_arch,
    # _check_kinds); BLOOM generates the same tokens (ALiBi slopes, KV cache per head).
    results = ranks(_at_tp_3, 3, timeout=300, gloo_timeout=60)
    for arch in ("bert", "roberta", "bert-auto", "bloom", "qwen3-auto"):
        got = results[0][arch]
        # Two all-reduces per layer: attention (heads split) and MLP; nothing replicated.
        assert got["collectives"]["all_reduce"] == 4, (arch, got)
        assert not [n for n in got["notes"] if "attention" in n], (arch, got["notes"])
    assert results[0]["bert-auto"]["source"] == "auto: dataflow pairs (any model)"
    # Their gradients summed over the group (check_arch compared every gradient), and said.
    for arch in ("qwen3-bare-norms", "qwen3-user"):
        got = results[0][arch]
        assert got["collectives"]["all_reduce"] == 4, (arch, got)
        for norm in ("q_norm", "k_norm"):
            assert f"'model.layers.*.self_attn.{norm}' gets replicated_with_grad_allreduce: the " \
                "plan" in "\n".join(got["notes"]), (arch, got["notes"])
    assert "'model.layers.*.mlp.act_fn' gets replicated_with_grad_allreduce: the plan (HF " \
        "plan" in "\n".join(results[0]["apertus"]["notes"]), results[0]["apertus"]["notes"]
    assert results[0]["bloom"]["generated"] == 6
    for kind in ("titan", "vit"):
        for rank in results:
            assert rank[kind]["fwd"] == rank[kind]["planned"] == AUTO[kind], (kind, rank[kind])


def test_the_head_rule_cuts_bert_output_projection_by_heads_at_every_rank():
    want = [(0, 24), (24, 24), (48, 16)]  # 8 heads of 8 features: 3/3/2
    assert [head_share(8, 8, 3, r)[0] for r in range(3)] == [(0, 3), (3, 3), (6, 2)]
    for rank in range(3):
        wrapped = DistributedModelWrapper(build("bert"), world_size=3, rank=rank)
        plan = wrapped.resolved_plan
        dense = "bert.encoder.layer.0.attention.output.dense"
        assert isinstance(plan.assignments[dense], HeadColumns)
        assert plan.layers[dense].layouts["weight"].segments == (want[rank],)
        assert plan.layers["bert.encoder.layer.0.attention.self.query"].layouts[
            "weight"].segments == (want[rank],)
        attention = wrapped.base_model.bert.encoder.layer[0].attention.self
        assert attention.num_attention_heads == want[rank][1] // 8


@pytest.mark.parametrize("consumer", [_BalancedColumns(), "rowwise_split_input"])
def test_an_output_projection_cutting_other_heads_is_refused_at_wrap_time(consumer):
    plan = {**BERT_PLAN, "bert.encoder.layer.*.attention.output.dense": consumer}
    for rank in range(3):  # the verdict comes from the plan alone: the same on every rank
        with pytest.raises(ValueError, match=(
                r"attention 'bert.encoder.layer.0.attention.self' \(8 heads, head_dim 8\) at "
                r"world_size=3.*'bert.encoder.layer.0.attention.self.query' splits its "
                r"out_features \(weight rows\) by whole heads, giving ranks 0..2 the attention "
                r"output features \[0:24\), \[24:48\), \[48:64\), but "
                r"'bert.encoder.layer.0.attention.output.dense'.*splits its in_features "
                r"\(weight columns\) as (\[0:22\), \[22:43\), \[43:64\)|its full input)")):
            DistributedModelWrapper(build("bert"), world_size=3, rank=rank, plan=plan)
    # At tp 2 the heads divide (4/4): balanced columns agree with them and the plan is taken.
    DistributedModelWrapper(build("bert"), world_size=2, rank=1,
                            plan={**BERT_PLAN, "bert.encoder.layer.*.attention.output.dense":
                                  _BalancedColumns()})


def test_describe_plan_names_the_sibling_output_projection():
    text = DistributedModelWrapper(build("roberta"), world_size=3, rank=2).describe_plan()
    assert ("input columns by the whole query heads of attention "
            "'roberta.encoder.layer.*.attention.self'") in text
