"""Training frameworks on top of torchtp: PEFT LoRA, HF Trainer, accelerate, Lightning.

Each submodule imports its framework when it is imported itself, so
``import torchtp`` never needs them. See docs/integrations.md.
"""
