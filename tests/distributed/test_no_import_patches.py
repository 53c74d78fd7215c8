"""Importing torchtp changes no other library; a model without PEFT never imports PEFT.

Each check runs in a fresh interpreter (``python -c``): what a library looks
like before torchtp is imported is only observable in a process that has not
imported torchtp yet.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torchtp.hf import compat as hf_compat

ROOT = Path(__file__).resolve().parents[2]

# Every attribute torchtp's integrations replace when the user calls them
# (integrations/peft.py and peft_params.py, integrations/ddp_refusal.py,
# integrations/lightning.py; torch's clip, routed by a wrap: training/clip.py). The PEFT
# modules holding the "all-linear" expansion go in as data: the probe process must not
# import torchtp before it records them.
_PATCHED = f"MODULES = {hf_compat.PEFT_ALL_LINEAR_MODULES!r}\nNAME = {hf_compat.PEFT_ALL_LINEAR!r}\n" \
    + """
import importlib
import torch
import peft.tuners.lora as lora
from peft import PeftModel
from accelerate import Accelerator
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDP
from lightning.pytorch.strategies.ddp import DDPStrategy as TrainerDDP
from lightning.pytorch.strategies import ModelParallelStrategy as TrainerMP

def patched():
    return {
        "PeftModel.save_pretrained": PeftModel.save_pretrained,
        "LoraModel._create_new_module": lora.LoraModel.__dict__["_create_new_module"],
        "ParamWrapper._get_in_out_features": lora.ParamWrapper.__dict__["_get_in_out_features"],
        "ParamWrapper.update_layer": lora.ParamWrapper.__dict__["update_layer"],
        **{f"{m}.{NAME}": getattr(importlib.import_module(m), NAME) for m in MODULES},
        "Accelerator.prepare_model": Accelerator.prepare_model,
        "Accelerator.clip_grad_norm_": Accelerator.clip_grad_norm_,
        "ModelParallelStrategy.clip_gradients_norm": ModelParallelStrategy.clip_gradients_norm,
        **{f"{who}.{name}": getattr(cls, name) for who, cls in (("ModelParallelStrategy",
           ModelParallelStrategy), ("TrainerMP", TrainerMP))
           for name in ("save_checkpoint", "load_checkpoint")},
        "FabricDDP.setup_module": FabricDDP.setup_module,
        "TrainerDDP._setup_model": TrainerDDP.__dict__["_setup_model"],
        "torch.nn.utils.clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "clip_grad.clip_grad_norm_": torch.nn.utils.clip_grad.clip_grad_norm_,
    }
"""


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_importing_torchtp_and_its_integrations_patches_nothing() -> None:
    code = _PATCHED + """
import sys
hook = sys.excepthook
before = patched()
import torchtp, torchtp.integrations
import torchtp.integrations.peft, torchtp.integrations.lightning
import torchtp.integrations.transformers, torchtp.integrations.ddp_refusal
import torchtp.integrations.guards, torchtp.integrations.adapter_hosts
after = patched()
print(sys.excepthook is hook)
print(sorted(k for k in before if before[k] is not after[k]))
"""
    same_hook, changed = _run(code)[-2:]
    assert same_hook == "True", "importing torchtp replaced sys.excepthook"
    assert changed == "[]", f"importing torchtp patched {changed}"


def test_the_probe_sees_a_patch() -> None:
    """The check above can fail: a patch installed by the user's call is seen."""
    code = _PATCHED + """
before = patched()
import torchtp.integrations.peft, torchtp.integrations.ddp_refusal, torchtp.training.clip
torchtp.integrations.peft.install()
torchtp.integrations.ddp_refusal.install()
torchtp.integrations.ddp_refusal.install_lightning()
torchtp.training.clip.route_torch_clip()
import torchtp.integrations.accelerate_clip
torchtp.integrations.accelerate_clip.install()
once = patched()
torchtp.integrations.peft.install()
torchtp.integrations.ddp_refusal.install()
torchtp.integrations.ddp_refusal.install_lightning()
torchtp.training.clip.route_torch_clip()
torchtp.integrations.accelerate_clip.install()
print(sorted(k for k in before if before[k] is not once[k]))
print(sorted(k for k in once if once[k] is not patched()[k]))
"""
    changed, changed_again = _run(code)[-2:]
    all_linear = [f"{m}.{hf_compat.PEFT_ALL_LINEAR}" for m in hf_compat.PEFT_ALL_LINEAR_MODULES]
    assert changed == str(sorted(["PeftModel.save_pretrained", "LoraModel._create_new_module",
                                  "ParamWrapper._get_in_out_features",
                                  "ParamWrapper.update_layer", *all_linear, "Accelerator.prepare_model",
                                  "FabricDDP.setup_module", "TrainerDDP._setup_model",
                                  "torch.nn.utils.clip_grad_norm_", "Accelerator.clip_grad_norm_",
                                  "clip_grad.clip_grad_norm_"])), changed
    assert changed_again == "[]", f"a second install patched again: {changed_again}"


def test_importing_torchtp_loads_no_framework() -> None:
    code = """
import sys
hook = sys.excepthook
import torchtp, torchtp.integrations
print(sys.excepthook is hook)
print(sorted({m.partition('.')[0] for m in sys.modules} & {'peft', 'accelerate', 'lightning',
                                                          'pytorch_lightning'}))
"""
    same_hook, loaded = _run(code)[-2:]
    assert same_hook == "True", "importing torchtp replaced sys.excepthook"
    assert loaded == "[]", f"importing torchtp imported {loaded}"


def test_wrapping_a_plain_model_imports_no_peft() -> None:
    code = """
import sys
import torch
import torchtp, torchtp.integrations

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
wrapped = torchtp.DistributedModelWrapper(model, world_size=1, rank=0)
wrapped(torch.randn(2, 8)).sum().backward()
print("peft" in sys.modules)
"""
    assert _run(code)[-1] == "False", "wrapping a model without PEFT layers imported peft"


def test_importing_and_wrapping_load_no_compiler() -> None:
    """torch._dynamo (and sympy with it) cost ~1 s of import and 0.3 s of every exit; DTensor too."""
    code = """
import sys
import torch
import torchtp

def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))

torchtp.DistributedModelWrapper(mlp(), world_size=2, rank=0)
# The FSDP2 check a forward at tp > 1 runs (on a tp-1 wrap it does not run)
from torchtp.layers.ddp_guard import check_fsdp
check_fsdp(mlp(), None)
wrapped = torchtp.DistributedModelWrapper(mlp(), world_size=1, rank=0)
wrapped(torch.randn(2, 8)).sum().backward()
print(sorted(m for m in ("torch._dynamo", "sympy", "torch.distributed.tensor") if m in sys.modules))
"""
    assert _run(code)[-1] == "[]", "importing or wrapping imported torch's compiler"


def test_a_group_started_after_import_is_freed_at_destroy_after_an_optimizer_step(
        tmp_path: Path) -> None:
    """torch 2.13's ``torch.distributed.nn.functional`` captures the group that exists when it
    is first imported (an optimizer's first step imports it with dynamo, so does FSDP) in
    its default arguments; torchtp imports it before any group (decision 157)."""
    code = f"""
import sys
import weakref
import torch
import torch.distributed as dist
import torchtp

loaded = "torch._dynamo" in sys.modules
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
ref = weakref.ref(dist.group.WORLD)
param = torch.nn.Parameter(torch.ones(3))
param.grad = torch.ones(3)
torch.optim.SGD([param], lr=0.1).step()
import torch.distributed.fsdp
dist.destroy_process_group()
print(loaded, "torch._dynamo" in sys.modules, ref() is None)
"""
    assert _run(code)[-1] == "False True True", "the group outlived destroy_process_group()"


def test_accelerate_imported_after_a_wrap_is_guarded() -> None:
    """A tp > 1 wrap imports no accelerate; importing it later still installs the refusal."""
    code = """
import sys
import torch
import torchtp

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
torchtp.DistributedModelWrapper(model, world_size=2, rank=0)
print("accelerate" in sys.modules)
from accelerate import Accelerator
print(getattr(Accelerator.prepare_model, "_torchtp", False))
"""
    loaded, guarded = _run(code)[-2:]
    assert loaded == "False", "a wrap imported accelerate"
    assert guarded == "True", "accelerate imported after the wrap was not guarded"
