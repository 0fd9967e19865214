# kvlab: `make help` lists the targets and the defconfigs.
#
#   make defconfig-NAME   start from defconfigs/NAME
#   make menuconfig       change the configuration (.config)
#   make                  build one binary per ablation step and run the steps
#
# Out-of-tree use, as in kbuild: make O=DIR keeps .config, include/ and the
# build trees in DIR (the tests use this).

.DEFAULT_GOAL := all
MAKEFLAGS += --no-builtin-rules --no-builtin-variables --no-print-directory
.SUFFIXES:
SHELL := /bin/bash

PYTHON := /usr/bin/python3
KCONFIG := $(PYTHON) scripts/kconfig.py
O ?= .
KCONFIG_CONFIG ?= $(O)/.config
export KCONFIG_CONFIG
BUILD := $(O)/build$(if $(filter 1,$(SANITIZE)),-san)
KCONFIG_FILES := Kconfig $(wildcard */Kconfig)
NPROC := $(shell nproc)
# Parallel compilation inside each step unless the user chose -j.
SUBMAKE_J := $(if $(filter -j%,$(MAKEFLAGS)),,-j$(NPROC))

# Goals that work without a .config.
no-config-goals := help menuconfig oldconfig olddefconfig savedefconfig defconfig-% clean mrproper \
                   deps test bench bench-decode cuda-resources check-config check-act paper paper-report
need-config := $(if $(MAKECMDGOALS),$(filter-out $(no-config-goals),$(MAKECMDGOALS)),all)

# ---------------------------------------------------------------- configuration

comma := ,

# A configuration that scripts/kconfig.py refuses stops make here: auto.conf
# is include'd, not -include'd, whenever there is a .config to make it from
# (a failed remake of an -include'd file would be ignored, and make would go
# on with the previous values, or with none on the first make after a
# defconfig, and print the error again for a step of its own).
ifneq ($(need-config),)
ifeq ($(wildcard $(KCONFIG_CONFIG)),)
# no configuration at all: what needs one stops at its rule's one line (deps comes first in every recipe
# that reads the configuration), instead of going on without values
deps $(need-config): $(KCONFIG_CONFIG)
else
include $(O)/include/config/auto.conf
endif
endif

# Configuration strings are data. scripts/kconfig.py lets only a
# conservative set of characters into those make uses (docs/build.md,
# "String symbols"); on top of that make reads them without expanding them
# ($(value): a '$' stays a '$') and recipes hand them to the shell in single
# quotes (shq), so nothing in a value is ever evaluated.
cfg-string = $(patsubst %",%,$(patsubst "%,%,$(value CONFIG_$(1))))
shq = '$(subst ','\'',$(1))'

RUN := $(call cfg-string,RUN_NAME)
OUTDIR := $(call cfg-string,OUTPUT_DIR)
STEPS_DIR := $(call cfg-string,ABLATION_STEPS_DIR)
STEPS := $(if $(CONFIG_ABLATION),$(strip $(subst $(comma), ,$(call cfg-string,ABLATION_STEPS))),base)
STEP_BUILD = $(BUILD)/$(RUN)/$(1)

$(KCONFIG_CONFIG):
	@echo "error: no configuration ($(KCONFIG_CONFIG)) (hint: start from a defconfig with make defconfig-NAME, \
	make help lists them, or run make menuconfig)" >&2; exit 1

# The base configuration as autoconf.h, config.json and auto.conf (read above).
$(O)/include/config/auto.conf: $(KCONFIG_CONFIG) $(KCONFIG_FILES)
	@scripts/deps.sh
	@$(KCONFIG) genconfig $(KCONFIG_CONFIG) $(O)
	@touch $@

# ---------------------------------------------------------------- build and run

.PHONY: all build run deps FORCE
FORCE:

deps:
	@scripts/deps.sh

# A sweep (Kconfig "Sweep": a grid, or more than one seed): scripts/sweep.py plans every (step, point, seed),
# builds each distinct build-time configuration once and runs them; SHARD=K/N takes one N-th of the runs.
SWEEPING := $(if $(or $(call cfg-string,SWEEP),$(filter-out 1,$(CONFIG_SWEEP_SEEDS))),y)
SWEEP_RUN = $(PYTHON) scripts/sweep.py --config $(KCONFIG_CONFIG) --build $(call shq,$(BUILD)/$(RUN)) \
            --out $(call shq,$(OUTDIR)/$(RUN)) --steps $(call shq,$(STEPS)) \
            --steps-dir $(call shq,$(or $(STEPS_DIR),defconfigs/steps)) $(if $(SHARD),--shard $(call shq,$(SHARD))) \
            $(if $(filter 1,$(FORCE)),--force) $(if $(filter 1,$(SANITIZE)),--sanitize 1)

RUN_STEPS = $(PYTHON) scripts/run_steps.py --build $(call shq,$(BUILD)/$(RUN)) --out $(call shq,$(OUTDIR)/$(RUN)) \
            --steps $(call shq,$(STEPS)) $(if $(filter 1,$(FORCE)),--force)

ifeq ($(SWEEPING),y)
all run: deps
	@$(SWEEP_RUN)

build: deps
	@$(SWEEP_RUN) --build-only

else
all: build
	@$(RUN_STEPS)

run:
	@$(RUN_STEPS)

build: $(addprefix build-step-,$(STEPS))
endif

# One specialised build per step: its configuration is the base .config with
# the step's fragment merged over it, its headers and objects its own.
build-step-%: deps FORCE
	@$(KCONFIG) step $(call shq,$(call STEP_BUILD,$*)) $(KCONFIG_CONFIG) $(if $(filter base,$*),,$(call shq,$(STEPS_DIR)/$*))
	@printf '  BUILD   step %s -> %s\n' $(call shq,$*) $(call shq,$(call STEP_BUILD,$*))
	@$(MAKE) $(SUBMAKE_J) -f scripts/Makefile.build B=$(call shq,$(call STEP_BUILD,$*)) SANITIZE=$(SANITIZE)

# The paper's experiments (scripts/paper.py): each one's sweep defconfig, once per row (data set, direction),
# out of tree in build/paper/<run>; PAPER=full for the full forms, ONLY=table3,fig6 for some of them, SHARD=K/N
# for one share of each sweep. The report covers every experiment, and is written even when a row failed.
PAPER_FORM = --form $(call shq,$(or $(PAPER),quick))
.PHONY: paper paper-report
paper: deps
	@rc=0; $(PYTHON) scripts/paper.py run $(PAPER_FORM) $(if $(ONLY),--only $(call shq,$(ONLY))) || rc=$$?; \
	 $(PYTHON) scripts/paper.py report $(PAPER_FORM) || rc=$$?; exit $$rc

paper-report: deps
	@$(PYTHON) scripts/paper.py report $(PAPER_FORM)

# ---------------------------------------------------------------- configuration targets

.PHONY: menuconfig oldconfig olddefconfig savedefconfig check-config check-act

defconfig-%: deps
	@test -f defconfigs/$* || { echo "error: no defconfig named '$*' in defconfigs/ (hint: make help lists them)" >&2; exit 1; }
	@$(KCONFIG) defconfig defconfigs/$* $(KCONFIG_CONFIG)

menuconfig: deps
	@MENUCONFIG_STYLE=aquatic $(PYTHON) -m menuconfig Kconfig

oldconfig: deps
	@$(PYTHON) -m oldconfig Kconfig

olddefconfig: deps
	@$(KCONFIG) olddefconfig $(KCONFIG_CONFIG)

savedefconfig: deps
	@$(KCONFIG) savedefconfig $(KCONFIG_CONFIG) $(O)/defconfig

check-config: deps
	@$(KCONFIG) check-symbols
	@$(PYTHON) scripts/check_layers.py

# The code above the kernels with a 2-byte act_t (kernels/kernels.h): activations mixed with float fail to compile.
check-act: deps
	@$(KCONFIG) step $(O)/build/act-check tests/configs/base tests/configs/act-check >/dev/null
	@$(MAKE) $(SUBMAKE_J) -f scripts/Makefile.build B=$(O)/build/act-check MECHINT=y BENCH=y check-act

# ---------------------------------------------------------------- tests, benchmarks

.PHONY: test bench bench-decode cuda-resources

test: deps
	@$(PYTHON) tests/run_tests.py $(if $(filter 1,$(SANITIZE)),--sanitize)

# AGAINST=DIR: another checkout's benchmark runs beside this one's (scripts/bench.py --against).
# TARGET=cuda: the variants on this machine's GPU, with MFU and GPU memory (PRECISION=tf32|bf16|bf16-matmul).
# BENCH_ARGS passes more options to scripts/bench.py (--peer torch: PyTorch running the same model beside it).
bench: deps
	@$(PYTHON) scripts/bench.py $(if $(AGAINST),--against "$(AGAINST)") $(if $(TARGET),--target "$(TARGET)") \
		$(if $(PRECISION),--precision "$(PRECISION)") $(BENCH_ARGS)

# Cached generation (tokens/s at context 128, 512 and the maximum) and KV-cache bytes per token of every
# variant and K/V head count (scripts/bench.py --only decode; BENCH_ARGS passes more options to it).
bench-decode: deps
	@$(PYTHON) scripts/bench.py --only decode $(if $(TARGET),--target "$(TARGET)") \
		$(if $(PRECISION),--precision "$(PRECISION)") $(BENCH_ARGS)

# What every CUDA kernel holds (registers, the warps an SM keeps by them, stack frame and spills), read off ptxas
# at build time, no GPU needed: scripts/cuda_resources.py (PRECISION=fp32|tf32|bf16|bf16-matmul, ARCH=80|86|89|90|100).
cuda-resources: deps
	@$(PYTHON) scripts/cuda_resources.py $(if $(PRECISION),--precision "$(PRECISION)") $(if $(ARCH),--arch "$(ARCH)")

# ---------------------------------------------------------------- analysis

.PHONY: mechint

# Analyses every checkpoint of MODELS (default: this configuration's run
# folder), each with a mechint built from the checkpoint's own configuration
# plus the MECHINT_* options here; reports under <run>/mechint/ (docs/mechint.md).
mechint: deps
	@SANITIZE=$(SANITIZE) $(PYTHON) scripts/mechint.py --config $(KCONFIG_CONFIG) --models $(call shq,$(or $(MODELS),$(OUTDIR)/$(RUN)))

# ---------------------------------------------------------------- experiment tracking

.PHONY: wandb-sync

# Uploads the W&B runs spooled under MODELS (default: this run's output
# folder): offline runs, and online runs whose upload stopped. Resumes where
# an interrupted sync stopped (docs/wandb.md).
WANDB_SYNC_BUILD := $(BUILD)/wandb-sync
wandb-sync: deps
	@$(KCONFIG) step $(WANDB_SYNC_BUILD) $(KCONFIG_CONFIG)
	@$(MAKE) $(SUBMAKE_J) -f scripts/Makefile.build B=$(WANDB_SYNC_BUILD) WANDB_SYNC=y SANITIZE=$(SANITIZE) \
	    $(WANDB_SYNC_BUILD)/wandb/wandb_sync
	@url=$(call shq,$(call cfg-string,WANDB_BASE_URL)); WANDB_BASE_URL="$${WANDB_BASE_URL:-$$url}" \
	    $(WANDB_SYNC_BUILD)/wandb/wandb_sync $(call shq,$(or $(MODELS),$(OUTDIR)/$(RUN)))

# ---------------------------------------------------------------- cleaning

.PHONY: clean mrproper help

clean:
	rm -rf $(O)/build $(O)/build-san

mrproper: clean
	rm -rf $(O)/include/generated $(O)/include/config $(KCONFIG_CONFIG) $(KCONFIG_CONFIG).old $(O)/defconfig

help:
	@echo "kvlab: does attention need Q, K and V?"
	@echo
	@echo "Configuration:"
	@echo "  defconfig-NAME   start from defconfigs/NAME (list below)"
	@echo "  menuconfig       edit the configuration in a terminal menu"
	@echo "  oldconfig        update .config after a Kconfig change, asking about new symbols"
	@echo "  olddefconfig     update .config, new symbols take their defaults"
	@echo "  savedefconfig    write the minimal equivalent of .config to ./defconfig"
	@echo "  scripts/config NAME=VALUE...   change values from the command line"
	@echo
	@echo "Build and run:"
	@echo "  all (default)    build one binary per ablation step and run the steps;"
	@echo "                   completed steps are skipped (FORCE=1 redoes them)"
	@echo "  build            build only"
	@echo "  run              run only (after build)"
	@echo "                   a sweep (Kconfig Sweep) builds as it goes; SHARD=K/N runs one N-th of its runs"
	@echo "  test             unit and integration tests (SANITIZE=1: with ASan/UBSan)"
	@echo "  bench            kernel benchmark: output/bench/bench.json (AGAINST=DIR: beside another checkout; TARGET=cuda: on the GPU;"
	@echo "                   BENCH_ARGS=\"--peer torch\": beside PyTorch running the same model)"
	@echo "  bench-decode     cached-generation tok/s and KV-cache bytes/token of every variant and K/V head"
	@echo "                   count: output/bench/decode.json (BENCH_ARGS=...: more scripts/bench.py options)"
	@echo "  cuda-resources   registers, occupancy by registers, stack and spills of every CUDA kernel, from the"
	@echo "                   compiler, no GPU needed (PRECISION=..., ARCH=90): output/bench/resources-*.json"
	@echo "  mechint          analyse the KV circuits of every checkpoint of this run (MODELS=DIR: another folder)"
	@echo "  wandb-sync       upload spooled W&B runs of this run (MODELS=DIR: another folder)"
	@echo "  paper            run the paper's experiments (quick forms; PAPER=full, ONLY=table3,fig6) and write"
	@echo "                   output/paper/report.md beside the paper's numbers (docs/paper.md)"
	@echo "  paper-report     only write that report from the runs done so far"
	@echo "  check-config     Kconfig consistency (every symbol defined and used)"
	@echo "  check-act        the code above the kernels treats activations as opaque (bf16-safe)"
	@echo "  clean            remove build trees (keeps .config and output/)"
	@echo "  mrproper         clean, and remove .config and generated headers (keeps output/)"
	@echo
	@echo "Defconfigs:"
	@for f in defconfigs/*; do [ -f "$$f" ] || continue; \
	    printf "  defconfig-%-32s %s\n" "$${f#defconfigs/}" "$$(head -n1 "$$f" | sed 's/^# *//')"; done
