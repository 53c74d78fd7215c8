"""HF conveniences on a wrapped model: consolidated saving, one sampling generator, or an
error that says what to do.

After wrapping, the HF model holds this rank's shards. Its own
``save_pretrained`` would write them under full names, ``push_to_hub`` would
upload them, and ``resize_token_embeddings`` cannot resize a vocabulary split
over ranks; ``generate`` samples from each process's own generator. The wrapper
replaces these methods on the model *instance* (the class is untouched):
``save_pretrained`` becomes torchtp's consolidated, collective save,
``generate`` samples from the TP group's first rank's generators on every rank,
the other two raise with the supported way.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch.distributed as dist
from torch import nn

from ..comm.group_ref import WeakGroup
from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup, get_tensor_parallel_config
from ..guards.agreement import agree
from ..guards.fingerprints import named_tensors, raise_different_inputs, tensor_digest
from ..layers import layouts_of
from ..layers.rng import first_rank_generator, get_state
from ..plans.sources import HUGGINGFACE, is_family

# HF save_pretrained arguments the consolidated save honours (or may ignore:
# rank 0 writes in any case, so is_main_process changes nothing).
_ACCEPTED = {"is_main_process", "max_shard_size", "safe_serialization"}


class _Owner:
    """What the replaced methods need of the wrapper (not the wrapper: the model must not
    own its owner); the group held weakly (comm.group_ref)."""

    group: WeakGroup[ProcessGroup | None] = WeakGroup()

    def __init__(self, base_model: nn.Module, group: ProcessGroup | None, rank: int,
                 world_size: int) -> None:
        self.base_model, self.group, self.rank, self.world_size = (
            base_model, group, rank, world_size)


def guard_hf_model(wrapper: Any) -> None:
    """Replace ``save_pretrained``/``push_to_hub``/``resize_token_embeddings`` on the wrapped
    HF model, and run its ``generate`` with one sampling generator on every rank."""
    model = wrapper.base_model
    owner = _Owner(model, wrapper.group, wrapper.rank, wrapper.world_size)
    # An HF model's, or a PeftModel's: its generate reaches the inner model's own
    if wrapper.world_size > 1 and callable(getattr(model, "generate", None)):
        model.generate = functools.partial(_generate, owner, model.generate)
    if not is_family(model, HUGGINGFACE):
        return
    model.save_pretrained = functools.partial(_save_pretrained, owner)
    model.push_to_hub = functools.partial(_push_to_hub, owner)
    if _vocab_is_split(model):
        model.resize_token_embeddings = functools.partial(_resize, owner)


def _save_pretrained(owner: Any, save_directory: str | os.PathLike[str], *args: Any,
                     **kwargs: Any) -> None:
    """Collective: the consolidated HF directory (= ``wrapped.save_pretrained``)."""
    if args:
        raise TypeError("save_pretrained on a tensor-parallel model takes the directory and "
                        "keyword arguments only; call wrapped.save_pretrained(dir) on every rank")
    if kwargs.get("state_dict") is not None:
        raise ValueError(
            f"save_pretrained(state_dict=...) on a tensor-parallel model (tp={owner.world_size}): "
            "a state_dict of this model holds this rank's shards, not full tensors; call "
            "wrapped.save_pretrained(dir) on every rank, which gathers each tensor")
    if kwargs.pop("push_to_hub", False):
        _push_to_hub(owner)
    if kwargs.get("safe_serialization", True) is False:
        raise ValueError("a tensor-parallel model saves safetensors only; drop "
                         "safe_serialization=False")
    unknown = sorted(k for k, v in kwargs.items() if k not in _ACCEPTED and v is not None)
    if unknown:
        raise TypeError(f"save_pretrained on a tensor-parallel model does not support {unknown}; "
                        "call wrapped.save_pretrained(dir, max_shard_size=...) on every rank")
    save_once(owner, save_directory, kwargs.get("max_shard_size", "5GB"))


def save_once(owner: Any, directory: str | os.PathLike[str], max_shard_size: int | str) -> None:
    """Consolidated save by the first data-parallel replica's TP group; every rank waits for it.

    DP replicas hold the same weights: one TP group writes (collective over
    it), the others only wait and raise its error if it failed.
    """
    from ..checkpoint.save_pretrained import save_pretrained

    cfg = get_tensor_parallel_config()
    error: BaseException | None = None
    if getattr(cfg, "dp_rank", 0) == 0:
        try:
            save_pretrained(owner, directory, max_shard_size)
        except Exception as err:  # raised on every rank of this TP group; passed on below
            error = err
    if dist.is_initialized() and dist.get_world_size() > owner.world_size:
        agree("save_pretrained", error, {}, dist.group.WORLD)
    elif error is not None:
        raise error


def _generate(owner: Any, generate: Any, *args: Any, **kwargs: Any) -> Any:
    """HF ``generate`` on the same prompt on every TP rank, every rank sampling from its
    first rank's generators.

    Sampling (``do_sample=True``, beam sampling, assisted decoding) draws from each
    process's default generator, outside the model's forward. Ranks seeded differently
    (``seed + rank``) would pick different tokens, and then run different forwards: a
    mismatch at the next step, a hang where one rank stops at its end-of-sequence token
    alone, a wrong last token that no forward ever reads. With one generator the ranks
    pick the tokens one process seeded as TP rank 0 would. The prompt is agreed first,
    in the same object gather: a ``PeftModel``'s generate calls the inner model's forward,
    past the forward door's input check on the ``PeftModel``.

    Raises:
        RankMismatchError: on every rank, before generating, when the ranks' prompts
            (any tensor argument) differ.
    """
    group = owner.group
    if group is None:
        return generate(*args, **kwargs)
    prompt = {name: tensor_digest(t) for name, t in named_tensors((), _named(generate, args,
                                                                            kwargs))}
    everyone = all_gather_object((prompt, get_state()), group, "generate's agreement")
    prompts = [p for p, _ in everyone]
    if any(p != prompts[0] for p in prompts):
        raise_different_inputs(prompts, "generate()")
    with first_rank_generator([s for _, s in everyone], owner.rank):
        return generate(*args, **kwargs)


def _named(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``fn``'s arguments by name (``**kwargs`` spread out; a PeftModel's generate takes
    only those)."""
    signature = inspect.signature(fn)
    named: dict[str, Any] = {}
    for name, value in signature.bind_partial(*args, **kwargs).arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        else:
            named[name] = value
    return named


def _push_to_hub(owner: Any, *args: Any, **kwargs: Any) -> None:
    raise ValueError(
        f"push_to_hub on a tensor-parallel model (tp={owner.world_size}) would upload this "
        "rank's shards; call wrapped.save_pretrained(dir) on every rank, then upload dir from "
        "rank 0 (huggingface_hub.upload_folder(repo_id=..., folder_path=dir))")


def _resize(owner: Any, *args: Any, **kwargs: Any) -> None:
    raise ValueError(
        f"resize_token_embeddings after wrapping: the embedding / LM head are split over the "
        f"vocabulary (weight rows) across tp={owner.world_size} ranks and cannot be resized in "
        "place; call model.resize_token_embeddings(n) before DistributedModelWrapper(model)")


def _vocab_is_split(model: Any) -> bool:
    embeddings = (model.get_input_embeddings(), model.get_output_embeddings())
    return any(layouts_of(m) for m in embeddings if m is not None)
