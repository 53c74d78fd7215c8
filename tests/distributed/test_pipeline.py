"""Pipeline parallelism (torchtp.pipeline) on a tiny HF Llama against one process."""

from __future__ import annotations

import pytest

from torchtp.pipeline import SCHEDULES, PipelineSchedule, decoder_stage, stage_layers

from ._pipeline_checks import build_llama, check_bad_microbatches, check_pipeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_train_like_one_process(ranks, schedule):
    # 4 microbatches of one row each: the rows count 4, 7, 1 and 7 tokens, so a
    # per-microbatch mean would weigh them wrongly; the loss is the batch's token mean.
    out = ranks(check_pipeline, 2, schedule, 4, 4, timeout=240)
    assert [o[0] for o in out] == [[0, 1], [2, 3]]
    assert out[0][1] == [] and len(out[1][1]) == 2  # the loss lives on the last stage
    table = out[0][3].splitlines()  # describe(): the same table on every stage
    assert out[1][3] == out[0][3] and table[0].startswith("pipeline: 2 stages, schedule ")
    # Layers of 9,280 parameters (q, o 32x32; k, v 16x32; MLP 3 x 64x32; two norms), the
    # embedding and the head (64 x 32) on either end, the final norm (32) last; float64.
    assert table[2].split() == ["0", "0", "0..1", "input", "(embeddings)", "20,608", "164,864"]
    assert table[3].split() == ["1", "1", "2..3", "output", "(norm,", "head)", "20,640",
                                "165,120"]


def test_four_uneven_stages_train_like_one_process(ranks):
    # 6 layers over 4 stages: 2, 2, 1, 1 (the balanced split rule).
    out = ranks(check_pipeline, 4, "1f1b", 6, 4, 1, timeout=300)
    assert [o[0] for o in out] == [[0, 1], [2, 3], [4], [5]]


def test_a_batch_that_does_not_split_is_refused_on_every_stage(ranks):
    for msg in ranks(check_bad_microbatches, 2):
        assert "input_ids (3, 8) and labels (3, 8): give both as (batch, tokens) with a " \
               "batch that divides into microbatches=2" in msg


def test_stage_splits():
    assert stage_layers(7, 2) == [range(0, 4), range(4, 7)]
    assert stage_layers(7, 2, [2, 5]) == [range(0, 2), range(2, 7)]
    with pytest.raises(ValueError, match=r"split=\[3, 3\]: give 2 positive layer counts "
                                         r"summing to the model's 7 decoder layers"):
        stage_layers(7, 2, [3, 3])
    with pytest.raises(ValueError, match=r"3 decoder layers cannot fill 4 pipeline stages"):
        stage_layers(3, 4)


def test_tied_embeddings_get_their_gradients_summed_across_the_first_and_last_stage(ranks):
    # Three stages: the middle one holds neither copy.
    out = ranks(check_pipeline, 3, "gpipe", 3, 4, 2, True, timeout=240)
    assert [o[0] for o in out] == [[0], [1], [2]]


def test_bad_schedules_are_refused():
    stage = decoder_stage(build_llama(), 0, 2)
    with pytest.raises(ValueError, match=r"schedule='zb' is not a pipeline schedule; "
                                         r"valid: \['1f1b', 'dualpipev', 'gpipe', "
                                         r"'interleaved1f1b', 'interleavedzb', 'loopedbfs', "
                                         r"'zbv'\]"):
        PipelineSchedule(stage, 4, "zb")
    with pytest.raises(ValueError, match=r"microbatches=1: schedule '1f1b' over 2 stages "
                                         r"needs at least 2"):
        PipelineSchedule(stage, 1, "1f1b")


def test_tensor_parallel_stages_train_like_one_process(ranks):
    from ._pipeline_checks import check_pipeline_tp

    out = ranks(check_pipeline_tp, 4, timeout=300)
    assert [o[0] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[2] is None for o in out] == [True, True, False, False]  # the MoE's loss: last stage
    for _, _, _, counts in out:  # sequence parallelism inside each stage: per microbatch
        # (4) and held layer (2), a reduce-scatter out of each block (2) in the forward
        assert all(c.get("reduce_scatter", 0) >= 4 * 2 * 2 for c in counts.values()), counts
    # Every stage's attention and MLP are split over its TP group: the plan verification's
    # probe confirms the heads on the model's one-layer copy (a stage cannot run the
    # model's own forward: its embeddings or head live elsewhere).
    for rank, (layers, split, _, _) in enumerate(out):
        want = {f"model.layers.{i}.{m}.weight" for i in layers
                for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        assert want <= set(split), (rank, sorted(want - set(split)))


def test_a_stage_that_raises_ends_every_stage_promptly(ranks):
    # The last stage raises in its second microbatch (as an out-of-memory error would) in a
    # 1F1B step; its process ends as under torchrun, and the first stage, waiting for
    # gradients, raises within seconds (Gloo reports the lost connection), not at the 60 s
    # group timeout.
    from ._pipeline_checks import check_stage_raises

    out = ranks(check_stage_raises, 2, gloo_timeout=60, timeout=120)
    assert out[1][0].startswith("RuntimeError") and "[Stage 1] failed to run forward" in out[1][0]
    # Gloo's wording varies with timing ("Connection closed by peer", "Read error ...
    # Connection reset"): what matters is that its transport reports the peer gone.
    assert out[0][0].startswith("RuntimeError") and "gloo/transport" in out[0][0], out[0]
    assert out[0][1] < 30, out[0]


def test_labels_and_ids_outside_the_vocabulary_are_refused_on_every_stage(ranks):
    from ._pipeline_checks import check_bad_batch_values

    for labels, ids in ranks(check_bad_batch_values, 2):
        assert labels == ("labels hold 1 value(s) outside the vocabulary [0, 64) (e.g. 71), "
                          "other than ignore_index=-100: every stage refuses the batch before "
                          "the first send")
        assert ids.startswith("input_ids hold 1 value(s) outside the vocabulary [0, 64)")


def test_stages_given_different_batches_are_refused(ranks):
    from ._pipeline_checks import check_different_batches

    for msg in ranks(check_different_batches, 2):
        assert msg.startswith("the pipeline's stages were given different batches")


def test_gradient_accumulation_over_steps_equals_one_big_step(ranks):
    # 2 steps x 2 microbatches = 1 step of 4, with the rows' uneven padding.
    from ._pipeline_checks import check_accumulation

    out = ranks(check_accumulation, 2, timeout=180)
    assert out[1] > 0


def test_several_stages_per_rank_train_like_one_process(ranks):
    # Each of PyTorch's multi-stage schedules at pp 2: 4 stages of two layers, two per rank
    # (looped: 0 and 2 on rank 0; V-shaped: 0 and 3 on rank 0). Tied embeddings: under the
    # V-shaped schedules both copies live on rank 0 and are summed there, under the looped
    # ones over the pair group.
    from ._pipeline_schedule_checks import check_schedules

    schedules = ["interleaved1f1b", "loopedbfs", "interleavedzb", "zbv", "dualpipev"]
    out = ranks(check_schedules, 2, schedules, True, timeout=300)
    assert out[0] == [[0, 2], [0, 2], [0, 2], [0, 3], [0, 3]]
    assert out[1] == [[1, 3], [1, 3], [1, 3], [1, 2], [1, 2]]


def test_pp_dp_tp_on_init_parallels_mesh_trains_like_one_process(ranks):
    # 8 processes: init_parallel(pp=2, dp=2, tp=2); DDP (then FSDP2) over dp around each
    # TP-wrapped stage, each replica with its half of the batch (rows with 4 and 7, and 1
    # and 7 counted tokens: the loss is the token mean over the global batch, not a mean
    # of the replicas' means).
    from ._pipeline_schedule_checks import check_pp_dp_tp

    out = ranks(check_pp_dp_tp, 8, timeout=420)
    for rank, (layout, losses, _) in enumerate(out):
        pp, dp, tp = layout  # pp outermost (strides over dp x tp blocks), tp contiguous
        assert pp == [rank % 4, rank % 4 + 4]
        assert dp == [rank - rank % 4 + rank % 2, rank - rank % 4 + rank % 2 + 2]
        assert tp == [rank - rank % 2, rank - rank % 2 + 1]
        assert all(len(v) == (2 if rank >= 4 else 0) for v in losses.values())
    # manual_seed: one shared stream per stage (its TP and DP ranks alike), a local one per
    # TP rank, and stages drawing differently.
    shared = [o[2][0] for o in out]
    local = [o[2][1] for o in out]
    assert len(set(shared[:4])) == 1 and len(set(shared[4:])) == 1 and shared[0] != shared[4]
    assert local[0] == local[2] and local[0] != local[1] and local[0] != local[4]


def test_stages_seeded_alike_draw_their_own_dropout_masks(ranks):
    # Without torchtp.manual_seed, the wrap starts each stage's shared stream from its TP
    # rank 0's generator: ranks seeded alike gave every stage the same masks, position for
    # position. The TP ranks of a stage still agree (a replicated region's dropout).
    from ._pipeline_schedule_checks import stage_masks

    masks = ranks(stage_masks, 4)
    assert masks[0] == masks[1] and masks[2] == masks[3]  # stage 0: ranks 0, 1; stage 1: 2, 3
    assert masks[0] != masks[2]
    assert 0 < sum(masks[0]) < len(masks[0]) and 0 < sum(masks[2]) < len(masks[2])
    # A TP peer whose streams started already (here: torchtp.manual_seed on rank 2 only)
    # hands its stream over as it is; the stage's offset is not applied twice.
    masks = ranks(stage_masks, 4, 2)
    assert masks[2] == masks[3] and masks[0] == masks[1] and masks[0] != masks[2]


def test_ddp_around_a_stage_needs_find_unused_parameters(ranks):
    # PyTorch's DDP reducer with its defaults fails an internal assert at the second
    # pipeline step; with static_graph=True the last stage's gradients are wrong, silently.
    from ._pipeline_schedule_checks import check_ddp_refused

    for msg in ranks(check_ddp_refused, 2):
        assert "build it as DistributedDataParallel(stage, process_group=cfg.dp_group, " \
               "find_unused_parameters=True)" in msg


def test_each_stage_reads_only_its_own_tensors_from_an_hf_checkpoint(ranks, tmp_path):
    # pp 2 x tp 2 from a tied tiny Llama saved by transformers: stage 0 reads the embedding
    # and layers 0-1, stage 1 layers 2-3, the final norm and its LM head (from the tied
    # embedding's tensor, which the checkpoint stores once).
    from ._pipeline_checks import build_llama
    from ._pipeline_load_checks import check_stage_from_pretrained

    build_llama(tied=True).save_pretrained(tmp_path / "hf")
    out = ranks(check_stage_from_pretrained, 4, str(tmp_path / "hf"), timeout=300)
    layer = [".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
             ".self_attn.o_proj.weight", ".mlp.gate_proj.weight", ".mlp.up_proj.weight",
             ".mlp.down_proj.weight", ".input_layernorm.weight", ".post_attention_layernorm.weight"]
    first = sorted(["model.embed_tokens.weight"]
                   + [f"model.layers.{i}{p}" for i in (0, 1) for p in layer])
    last = sorted(["model.embed_tokens.weight", "model.norm.weight"]
                  + [f"model.layers.{i}{p}" for i in (2, 3) for p in layer])
    assert out == [first, first, last, last]


def test_sequential_and_chains_of_blocks_train_like_one_process(ranks):
    from ._pipeline_block_checks import check_block_stages

    out = ranks(check_block_stages, 2, timeout=180)
    assert [o[0] for o in out] == [[0, 1, 2], [3, 4, 5]]
    assert [o[1] for o in out] == [[0, 1], [2, 3]]
    # The first stage keeps the embeddings, the last the norm and head; names unsplit.
    assert out[0][2][0] == "layers.0.mlp.bias" and "tok_embeddings.weight" in out[0][2]
    assert "output.weight" in out[1][2] and "tok_embeddings.weight" not in out[1][2]


def test_block_stages_refuse_what_is_not_a_chain():
    from torch import nn

    from torchtp.pipeline import block_stage

    with pytest.raises(ValueError, match=r"Linear: blocks=None must name an nn.ModuleList, "
                                         r"nn.ModuleDict or nn.Sequential"):
        block_stage(nn.Linear(2, 2), 0, 2)
    with pytest.raises(ValueError, match=r"first/last modules \['embed'\] are not submodules"):
        block_stage(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 0, 2, first=["embed"])


def test_param_balanced_split_is_the_best_contiguous_split():
    import itertools
    import random

    from torchtp.pipeline.balance import param_balanced_split

    rng = random.Random(0)
    for _ in range(200):
        n, stages = rng.randint(1, 7), rng.randint(1, 4)
        if n < stages:
            continue
        first, last = rng.randint(0, 50), rng.randint(0, 50)
        layers = [rng.randint(1, 20) for _ in range(n)]

        def largest(split, first=first, last=last, layers=layers):
            bounds = [0, *itertools.accumulate(split)]
            sizes = [sum(layers[a:b]) for a, b in itertools.pairwise(bounds)]
            sizes[0] += first
            sizes[-1] += last
            return max(sizes)

        every = [list(c) for c in itertools.product(range(1, n + 1), repeat=stages)
                 if sum(c) == n]
        got = param_balanced_split(first, layers, last, stages)
        assert sum(got) == n and min(got) >= 1
        assert largest(got) == min(largest(c) for c in every), (first, layers, last, stages)


def test_decoder_stage_balances_parameters_when_asked():
    # A 4096-token vocabulary: the embedding and the head weigh 14 layers each, so the end
    # stages take one layer and the middle ones three (layers balanced: 2 each).
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        held = [decoder_stage(LlamaForCausalLM(config), s, 4, split="params").layers
                for s in range(4)]
    assert [len(r) for r in held] == [1, 3, 3, 1]
    with pytest.raises(ValueError, match=r"split='bytes': give layers per stage, None"):
        decoder_stage(build_llama(), 0, 2, split="bytes")


def test_block_stage_balances_parameters_when_asked():
    from torch import nn

    from torchtp.pipeline import block_stage

    def chain() -> nn.Sequential:  # a wide first block, then four narrow ones
        return nn.Sequential(nn.Linear(64, 8), *[nn.Linear(8, 8) for _ in range(4)])

    assert [list(block_stage(chain(), s, 2, split="params").layers) for s in (0, 1)] == \
        [[0], [1, 2, 3, 4]]
    assert [list(block_stage(chain(), s, 2).layers) for s in (0, 1)] == [[0, 1, 2], [3, 4]]


def test_every_schedule_at_four_ranks_trains_like_one_process(ranks):
    # An 8-layer Llama at pp 4: GPipe and 1F1B over 4 stages, the others over 8 of one layer.
    from ._pipeline_schedule_checks import check_schedules

    out = ranks(check_schedules, 4, sorted(SCHEDULES), False, 8, timeout=600)
    assert out[1] == [[1], [1, 6], [1], [1, 5], [1, 5], [1, 5], [1, 6]]  # sorted names


def test_gpt2_mistral_qwen_and_an_moe_train_like_one_process(ranks):
    # GPT-2 has the other decoder layout (blocks in `h`, learned positions `wpe` added on
    # the first stage only, tied embeddings); Qwen3-MoE routes tokens to experts.
    from ._pipeline_block_checks import check_architectures

    archs = ["gpt2", "mistral", "qwen2", "qwen3", "qwen3_moe"]
    out = ranks(check_architectures, 2, archs, timeout=300)
    assert [a for a, _, _ in out[0]] == archs
    assert [t for _, t, _ in out[0]] == [True, False, False, False, False]


def test_stages_refuse_models_whose_forward_is_not_their_chain():
    # A stage runs the decoder on what it receives and the last applies the LM head alone:
    # Gemma 2's final soft-capping was skipped, and Granite's embedding multiplier applied
    # again on every stage, with no error.
    from ._hf_models import build

    with pytest.raises(ValueError, match=r"decoder_stage: Gemma2ForCausalLM's logits are not "
                                         r"its LM head applied to its decoder's output"):
        decoder_stage(build("gemma2"), 0, 2)
    with pytest.raises(ValueError, match=r"decoder_stage: GraniteForCausalLM's logits are not"):
        decoder_stage(build("granite", logits_scaling=16.0), 1, 2)
    with pytest.raises(ValueError, match=r"GraniteForCausalLM's decoder changes the hidden "
                                         r"states outside its blocks and final norm"):
        decoder_stage(build("granite", embedding_multiplier=12.0), 1, 2)
