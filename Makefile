# make test / make demo work on a fresh machine: they create .venv when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.torchtp-installed

.PHONY: test test-all demo lint bench install clean compat compat-smoke compat-new-venv zoo

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# constraints.txt pins torch==2.13.0 (CPU build) so pip never pulls CUDA wheels.
	$(PY) -m pip install -q -c constraints.txt -e ".[hf,test,dev,peft,lightning]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks launch
	$(PY) -m mypy --warn-unused-ignores src/distributed

# make test skips tests marked slow (long matrices); make test-all runs them too.
# It ends with the compatibility smoke run (oldest supported transformers).
test: lint
	$(PY) -m pytest tests -q -p no:cacheprovider -m "not slow" --durations=30
	$(MAKE) compat-smoke

# Compatibility runs (docs/compat.md). "old": the oldest supported versions:
# torch 2.13.0 (reused from $(VENV), the same wheel) with the oldest supported
# transformers; "new": the newest releases pip can install here, resolved when
# make compat runs (no version is written down), standalone.
# pyproject.toml's lower bounds are COMPAT_OLD's versions.
COMPAT_OLD_TRANSFORMERS ?= 5.3.0
COMPAT_NEW_PACKAGES ?= torch transformers peft lightning accelerate
COMPAT_OLD := .venv-compat-old/.installed-$(COMPAT_OLD_TRANSFORMERS)
# The compat venvs import torchtp from this checkout, whatever is installed.
COMPAT_SHIM := build/compat-shim
COMPAT_PYTEST = PYTHONPATH=$(CURDIR)/$(COMPAT_SHIM) $(1)/bin/python -m pytest -q -p no:cacheprovider
# The HF architecture matrix, slow parts included: test_hf_models.ARCHS (12) at tp 2
# and 4, test_hf_more_archs.SOURCES (24 on transformers 5.24) at tp 4, all of them at
# tp 3, uneven sizes. make compat runs it on the newest
# releases, where a release that changes a model's plan or layout shows first.
HF_MATRIX := tests/distributed/test_hf_models.py tests/distributed/test_hf_more_archs.py \
	tests/distributed/test_hf_matrix_tp3.py tests/distributed/test_uneven.py
HF_PLANS := tests/distributed/test_hf_plans.py
COMPAT_SMOKE ?= tests/distributed/test_compat_fence.py \
	$(HF_PLANS)::test_plan_sources_and_printing \
	$(HF_PLANS)::test_hf_models_without_a_plan_say_what_stays_replicated_and_why \
	$(HF_PLANS)::test_unknown_and_moe_styles_are_refused_not_replicated \
	$(HF_PLANS)::test_tied_weights_stay_one_parameter \
	$(HF_PLANS)::test_more_ranks_than_heads_raise_at_wrap_time_with_valid_sizes \
	$(HF_PLANS)::test_kv_groups_stay_together_and_kv_heads_replicate_when_fewer \
	"tests/distributed/test_hf_models.py::test_architectures_match_the_unsharded_model[2-None]" \
	tests/distributed/test_collective_counts.py \
	tests/distributed/test_context_parallel.py::test_hf_models_match_one_process_at_cp2 \
	tests/distributed/test_moe.py::test_experts_split_inside_match_one_process

$(COMPAT_OLD): $(STAMP) .ci/compat_venv.py
	$(PY) .ci/compat_venv.py .venv-compat-old --base $(VENV) transformers==$(COMPAT_OLD_TRANSFORMERS)
	touch $@

# Phony: resolves the newest releases every time; reinstalls only when one changed.
compat-new-venv: $(STAMP)
	$(PY) .ci/compat_venv.py .venv-compat-new --newest $(COMPAT_NEW_PACKAGES)

$(COMPAT_SHIM)/torchtp:
	mkdir -p $(COMPAT_SHIM)
	ln -sfn $(CURDIR)/src/distributed $@

compat-smoke: $(COMPAT_OLD) $(COMPAT_SHIM)/torchtp
	$(call COMPAT_PYTEST,.venv-compat-old) $(COMPAT_SMOKE)

compat: $(COMPAT_OLD) compat-new-venv $(COMPAT_SHIM)/torchtp
	$(call COMPAT_PYTEST,.venv-compat-old) tests -m "not slow"
	$(call COMPAT_PYTEST,.venv-compat-new) tests -m "not slow"
	$(call COMPAT_PYTEST,.venv-compat-new) $(HF_MATRIX) -m slow

# Every causal-LM type of the installed transformers, tiny, at tp 2 against one process
# (a line per type; about 6 minutes). ZOO_PY=.venv-compat-new/bin/python for the newest;
# ZOO_HEAD=masked-lm, seq2seq, seq-cls or token-cls for the types of another head;
# ZOO_LORA=1 with PEFT LoRA on every Linear of both sides; ZOO_OPTIONS="loss_parallel
# sequence_parallel" wraps with those flags, "train" runs both in training mode,
# "checkpointing" also with HF activation checkpointing, "compile" under torch.compile,
# "memory" with plan="auto-memory" (every split; the default keeps tiny layers whole).
ZOO_PY ?= $(PY)
ZOO_TP ?= 2
ZOO_HEAD ?= causal-lm
ZOO_LORA ?=
ZOO_OPTIONS ?=
zoo: $(STAMP) $(COMPAT_SHIM)/torchtp
	PYTHONPATH=$(CURDIR)/$(COMPAT_SHIM) $(ZOO_PY) tests/distributed/hf_zoo.py --tp $(ZOO_TP) \
		--head $(ZOO_HEAD) $(if $(ZOO_LORA),--lora) $(foreach o,$(ZOO_OPTIONS),--option $(o))

test-all: lint
	$(PY) -m pytest tests -q -p no:cacheprovider

demo: $(STAMP)
	$(VENV)/bin/torchtp demo

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) .venv-compat-old .venv-compat-new $(COMPAT_SHIM) .pytest_cache .ruff_cache
