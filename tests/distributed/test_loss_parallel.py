"""Loss-parallel cross-entropy and DistributedModelWrapper(loss_parallel=True) vs unsharded."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import torchtp

from ._sp_checks import check_loss_parallel_suite, cross_entropy_cases


def test_one_rank_equals_cross_entropy_in_float64():
    # fp64 stays fp64, so only summation order differs: 1e-12 is ample.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 13, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (4, 6), generator=gen)
    labels[1, 2] = -100
    for smoothing in (0.0, 0.3):
        got = torchtp.vocab_parallel_cross_entropy(logits, labels, label_smoothing=smoothing)
        want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=smoothing)
        g_got, = torch.autograd.grad(got, logits)
        g_want, = torch.autograd.grad(want, logits)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


def test_double_backward_raises_instead_of_dropping_the_softmax_term():
    # A gradient penalty through the loss: the logit gradient depends on the logits
    # through the softmax, which the saved-softmax backward does not differentiate.
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(4, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 7, (6,), generator=gen)
    loss = torchtp.vocab_parallel_cross_entropy(h @ w, labels)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        gw, = torch.autograd.grad(loss, w, create_graph=True)
        gw.square().sum().backward()  # would miss the softmax's dependence on h


def test_arguments_are_checked():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"local_logits \(2, 3, 5\) must be labels' shape \(2, 4\)"):
        torchtp.vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction='avg'; use one of"):
        torchtp.vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long),
                                             reduction="avg")
    with pytest.raises(TypeError, match="labels must be integer class ids"):
        torchtp.vocab_parallel_cross_entropy(logits, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"label_smoothing=1\.5 must be in"):
        torchtp.vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long),
                                             label_smoothing=1.5)


def test_uneven_vocabulary_split_matches_cross_entropy(ranks):
    # Vocab 11 over 3 ranks: slices of 4, 4 and 3 rows (balanced, first ranks larger).
    results = ranks(cross_entropy_cases, 3, 11)
    for res in results:
        # Two all-reduces (max + sizes, then sum-exp/target/smoothing), each O(tokens):
        # 15 tokens -> at most 3 * 15 elements; never the (15, 11) logits.
        assert res["ops"] == {"all_reduce": 2}
        assert res["largest"] <= 3 * 15
        assert "label 11 is outside the vocabulary 0..10" in res["error"]
        assert res["all_ignored_nan"]
        assert res["empty_slice_ok"]
    assert [res["empty_slice_width"] for res in results] == [1, 1, 0]


def test_wrapper_loss_parallel_matches_unsharded_model(ranks):
    results = ranks(check_loss_parallel_suite, 2, timeout=300, gloo_timeout=60)
    got = results[0]
    # Llama: 2 per layer + 2 for the loss; the LM head is not gathered, the embedding
    # (vocabulary 128, untied) kept whole by cost.
    assert got["llama"]["forward"] == {"all_reduce": 6}
    assert got["llama"]["grads_checked"] == 21
    assert got["gpt2"]["forward"] == {"all_reduce": 7}  # wte + lm_head vocab-split (tied)
    assert got["generated"] == 5
    assert "loss is not transformers' ForCausalLMLoss" in got["bert error"]
    assert re.search(r"BartForConditionalGeneration.forward computes its loss itself .* not "
                     r"through self.loss_function", got["bart error"]), got["bart error"]
    assert "needs a HuggingFace causal LM (got Sequential)" in got["plain error"]


def test_a_subclass_whose_forward_calls_the_parent_keeps_loss_parallelism():
    from transformers import BartForCausalLM, LlamaForCausalLM

    from torchtp.hf.loss_parallel import _forward_calls_loss_function

    class Mine(LlamaForCausalLM):
        def forward(self, *args, **kwargs):  # the parent computes the loss
            return super().forward(*args, **kwargs)

    assert _forward_calls_loss_function(Mine)
    assert not _forward_calls_loss_function(BartForCausalLM)  # a CrossEntropyLoss inline
