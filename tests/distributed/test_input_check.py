"""Every forward checks that all TP ranks got the same inputs (torchtp.guards.input_check).

One 2-rank run per model family covers the cases: different batches at step 2
of training, in eval, through ``base_model``, through a PEFT model and through
``generate``; a model whose first parallel layer takes per-rank input shards
(``rowwise``: weight columns = ``in_features`` split) trains exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchtp

from ._models import deep_mlp, gather_param, mlp
from ._reference import seeded

DIFFERENT = r"argument 0 differs on TP ranks \[1\] .*data sampler"


def _per_rank(rank: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + rank))


def _plain(rank: int, world_size: int) -> list[str]:
    """An MLP in training and eval, through the wrapper and base_model."""
    ref = mlp()
    wrapped = torchtp.DistributedModelWrapper(mlp())
    x = seeded(2, 16, seed=3)
    for _step in range(2):  # the same batch everywhere: exact, no error
        torch.testing.assert_close(wrapped(x), ref(x))
    with pytest.raises(torchtp.RankMismatchError, match=DIFFERENT):
        wrapped(_per_rank(rank, 2, 16))  # step 3 of training: a sampler bug
    with pytest.raises(torchtp.RankMismatchError, match=r"argument 'input' differs"):
        wrapped.base_model(input=_per_rank(rank, 2, 16))  # direct call of the wrapped model
    wrapped.train(rank == 0)  # rank 1 forgot model.train(): dropout would split
    with pytest.raises(torchtp.RankMismatchError, match=r"ranks run the model in different "
                       r"modes \(\{0: 'train\(\)', 1: 'eval\(\)'\}, by TP rank\)"):
        wrapped(x)
    wrapped.eval()
    with torch.no_grad():
        with pytest.raises(torchtp.RankMismatchError, match=DIFFERENT):
            wrapped(_per_rank(rank, 2, 16))
        # The group is still in step after every rank raised together.
        torch.testing.assert_close(wrapped(x), ref(x))
    with torchtp.count_collectives() as rides:
        wrapped(x)  # the digest rides the model's one all-reduce: no collective of its own
    # bf16 activations carry it too (bits: sums are exact small integers).
    half = torchtp.DistributedModelWrapper(mlp(dtype=torch.bfloat16))
    with torch.no_grad(), torchtp.count_collectives() as bf16:
        half(x.bfloat16())
    with pytest.raises(torchtp.RankMismatchError, match=DIFFERENT):
        half(_per_rank(rank, 2, 16).bfloat16())
    # A forward without an all-reduce (everything replicated): one small one of its own.
    replicated = torchtp.DistributedModelWrapper(mlp(), plan={"*": "replicate"})
    with torch.no_grad(), torchtp.count_collectives() as separate:
        torch.testing.assert_close(replicated(x), ref(x))
    with pytest.raises(torchtp.RankMismatchError, match=DIFFERENT):
        replicated(_per_rank(rank, 2, 16))
    # Shapes differ: every rank raises at the first collective (its shape agreement).
    with pytest.raises(torchtp.RankMismatchError):
        wrapped(seeded(2 + rank, 16, seed=3))
    return ["ok", dict(rides.counts), dict(bf16.counts), dict(separate.counts)]


def _rowwise_first(rank: int, world_size: int) -> list[str]:
    """First layer ``rowwise`` (ColumnParallelLinear, in_features split): per-rank input shards."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    wrapped = torchtp.DistributedModelWrapper(model, plan={"0": "rowwise"})
    wrapped.train()
    for step in range(2):
        x = seeded(4, 16, seed=step)
        shard = x.chunk(world_size, dim=-1)[rank].clone()  # this rank's in_features slice
        y, yr = wrapped(shard), ref(x)
        torch.testing.assert_close(y, yr)
        y.square().sum().backward()
        yr.square().sum().backward()
        for name, p in wrapped.base_model.named_parameters():
            full = gather_param(wrapped.base_model, name, p.grad, world_size)
            torch.testing.assert_close(full, dict(ref.named_parameters())[name].grad)
    # Shape only: the sharded input's batch dimension still has to agree.
    with pytest.raises(torchtp.RankMismatchError):
        wrapped(seeded(4 + rank, 8, seed=1))
    return ["ok"]


def test_every_forward_is_checked(ranks):
    want = ["ok", {"all_reduce": 1}, {"all_reduce": 1}, {"all_reduce": 1}]
    assert ranks(_plain, 2) == [want, want]


def test_rowwise_first_layer_takes_input_shards_in_training(ranks):
    assert ranks(_rowwise_first, 2) == [["ok"], ["ok"]]


def _hf(rank: int, world_size: int) -> list[str]:
    """Tiny Llama: generate with a different prompt per rank, a PEFT model around the base."""
    from peft import LoraConfig, get_peft_model

    from ._hf_models import build

    ref = build("llama")
    wrapped = torchtp.DistributedModelWrapper(build("llama"))
    prompt = torch.tensor([[3, 5, 7, 9]])
    same = wrapped.base_model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(same, ref.generate(prompt, max_new_tokens=3, do_sample=False))
    # generate agrees on its prompt ('inputs') before the forwards ('input_ids') see it
    with pytest.raises(torchtp.RankMismatchError, match=r"'inputs' differs on TP ranks \[1\]"):
        wrapped.base_model.generate(prompt + rank, max_new_tokens=3, do_sample=False)
    torch.manual_seed(5)
    peft = get_peft_model(wrapped.base_model, LoraConfig(r=4, target_modules=["q_proj"]))
    peft.train()
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5, 6]]) + rank}
    with pytest.raises(torchtp.RankMismatchError, match=r"'input_ids' differs on TP ranks \[1\]"):
        peft(**batch, labels=batch["input_ids"])
    # Prompts that differ in one token only, past the 256 elements a float input is sampled by
    long = torch.randint(3, 60, (1, 300), generator=torch.Generator().manual_seed(3))
    long[0, -1] += rank
    with pytest.raises(torchtp.RankMismatchError, match=r"'input_ids' differs on TP ranks \[1\]"):
        wrapped(input_ids=long)
    # Sampling: ranks seeded apart sample as one process seeded as TP rank 0 (the last token
    # too, which no forward reads back), and keep their own streams after it; ranks seeded
    # alike sample and move on as one process.
    sampled = []
    for seeds, new in (((0, 1), 1), ((0, 1), 5), ((4, 4), 5)):
        torch.manual_seed(seeds[0])
        want = ref.generate(prompt, max_new_tokens=new, do_sample=True, top_k=0)
        after_one_process = torch.get_rng_state()
        torch.manual_seed(seeds[rank])
        before = torch.get_rng_state()
        got = wrapped.generate(prompt, max_new_tokens=new, do_sample=True, top_k=0)
        assert torch.equal(got, want), (seeds, new, got.tolist(), want.tolist())
        mine = after_one_process if rank == 0 or seeds[0] == seeds[1] else before
        assert torch.equal(torch.get_rng_state(), mine), (seeds, new)
        sampled.append(got[0, prompt.shape[1]:].tolist())
    # A PeftModel wrapped as a whole: its generate runs the inner model's forward (past the
    # forward door on the PeftModel); the prompt is agreed and the sampling shared at its call
    def lora(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(7)
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"],
                                                init_lora_weights="gaussian"))

    one_peft, tp_peft = lora(build("llama")), torchtp.DistributedModelWrapper(lora(build("llama")))
    with pytest.raises(torchtp.RankMismatchError, match=r"'input_ids' differs on TP ranks \[1\]"):
        tp_peft.generate(input_ids=prompt + rank, max_new_tokens=2, do_sample=False)
    torch.manual_seed(0)
    want = one_peft.generate(input_ids=prompt, max_new_tokens=3, do_sample=True, top_k=0)
    torch.manual_seed(rank)
    got = tp_peft.generate(input_ids=prompt, max_new_tokens=3, do_sample=True, top_k=0)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    sampled.append(got[0, prompt.shape[1]:].tolist())
    # Sequence parallelism's forward gathers and reduce-scatters: a separate all-reduce.
    sp = torchtp.DistributedModelWrapper(build("llama"), sequence_parallel=True)
    with torch.no_grad():
        torch.testing.assert_close(sp(input_ids=prompt).logits, ref(input_ids=prompt).logits)
        with pytest.raises(torchtp.RankMismatchError, match=r"'input_ids' differs"):
            sp(input_ids=prompt + rank)
    return ["ok", sampled]


def test_generate_and_peft_are_checked(ranks):
    got = ranks(_hf, 2)
    assert got[0] == got[1] and got[0][0] == "ok"  # the same tokens sampled on every rank


def _disabled(rank: int, world_size: int) -> list[str]:
    wrapped = torchtp.DistributedModelWrapper(mlp())
    with torchtp.count_collectives() as c:
        wrapped(_per_rank(rank, 2, 16))  # TP_CHECK_INPUTS=0: not checked
    return [dict(c.counts)]  # type: ignore[list-item]


def test_check_can_be_turned_off(ranks):
    out = ranks(_disabled, 2, env={"TP_CHECK_INPUTS": "0"})
    assert out == [[{"all_reduce": 1}], [{"all_reduce": 1}]]


def _edited_in_eval(rank: int, world_size: int) -> list[object]:
    """A replicated weight changed on one rank after wrapping, eval only (no optimizer
    step ever checks it): caught within TP_STEP_CHECK forwards, riding the input check."""
    wrapped = torchtp.DistributedModelWrapper(deep_mlp().eval())
    x = seeded(2, 16, seed=3)
    with torch.no_grad():
        wrapped(x)  # the first forward checks the weights too
        if rank == 1:
            wrapped.base_model[4].weight.mul_(1.01)  # the replicated LayerNorm's weight
        raised_at = None
        for forward in range(1, 12):
            try:
                wrapped(x)
            except torchtp.RankMismatchError as err:
                raised_at, message = forward, str(err)
                break
        with torchtp.count_collectives() as counted:
            wrapped.base_model[4].weight.copy_(deep_mlp()[4].weight)  # repaired
            wrapped(x)
    return [raised_at, message, dict(counted.counts)]


def test_a_replicated_weight_edited_on_one_rank_is_caught_in_eval(ranks):
    for raised_at, message, counts in ranks(_edited_in_eval, 2):
        assert raised_at == 10  # the 11th forward: TP_STEP_CHECK (10) after the first
        assert message.startswith("replicated weight '4.weight' differs on TP ranks [1] from "
                                  "TP rank 0 (the replicated weights are checked every "
                                  "TP_STEP_CHECK forwards, eval included")
        assert counts == {"all_reduce": 2}  # the model's two pairs: nothing of its own


def test_sampling_leaves_storages_resizable():
    """numpy sees copies only: Tensor.numpy() marks a storage not resizable for good, and
    FSDP2 frees an unsharded parameter (a replicated weight the check samples) by resizing."""
    from torchtp.guards.fingerprints import sample_bytes

    for t in (torch.arange(8), torch.zeros(8), torch.zeros(1000), torch.zeros(8, requires_grad=True)):
        sample_bytes(t)
        t.untyped_storage().resize_(0)  # raises if numpy saw this storage
