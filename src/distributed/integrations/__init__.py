"""Training frameworks on top of torchtp: PEFT LoRA, HF Trainer, accelerate, Lightning.

Each submodule imports its framework when it is imported itself, so
``import torchtp`` never needs them. See docs/integrations.md.

The layer on top of the wrapper: its steps in every wrap (``wrap_steps``, which
``torchtp`` imports: PEFT adapters set aside and put back, framework guards) and
entry points (``lightning``, ``transformers``, which build wrappers). May import:
every layer below, ``wrap`` included; nothing below imports it.
"""
