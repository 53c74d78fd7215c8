"""Training frameworks on top of torchtp: PEFT LoRA, HF Trainer, accelerate, Lightning.

Each submodule imports its framework when it is imported itself, so
``import torchtp`` never needs them. See docs/integrations.md.

Layer 7 (the modules the wrapper uses: adapters, framework guards) and entry
points (``lightning``, ``transformers``, which build wrappers). May import: every
layer below ``wrap``; the entry points anything.
"""
