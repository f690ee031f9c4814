# Two commands for a new checkout: `make run` and `make test` (both install what is
# missing first). Debian 12 packages only; apt-get runs as root or through sudo.
# RUN_DEBS is what `make run` needs: the compilers (clang++; g++ for libstdc++), the libraries of mglaunch and mgtrain,
# the Fashion-MNIST data, and python3-torch for the README's example (examples/ddp_train.py).
# DEBS is everything the build and every test use
# (tests/support/skip.h: a test whose package is missing skips, and fails under CI=true).
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
# The compiler of a fresh build directory: clang++ (a third less build CPU than g++ 12, #36:
# README "Tests", docs/benchmarks.md). An existing build directory keeps the compiler it was
# configured with; CXX_COMPILER=g++ (or a plain `cmake -S . -B DIR`) builds with GCC.
CXX_COMPILER ?= clang++
CONFIGURE = cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=$(CXX_COMPILER)
RUN_DEBS := cmake ninja-build clang g++ ccache libboost1.81-dev nlohmann-json3-dev libfmt-dev libcli11-dev libssl-dev \
            zlib1g-dev libtorch-dev libgloo-dev dataset-fashion-mnist python3-torch
DEBS := $(RUN_DEBS) catch2 \
        libclang-rt-14-dev openssh-server openssh-client slurm-wlm prometheus \
        chromium chromium-driver python3-selenium help2man etcd-server etcd-client lld \
        python3 openssl dpkg-dev systemd iproute2 nftables hyperfine time gnuplot-nox strace
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
MGLAUNCH := $(BUILD_DIR)/bin/mglaunch

.PHONY: all setup setup-run build run test soak test-all chaos bench package clean

all: build

# Installs only the missing packages of $(1) (and EXTRA_DEBS); does nothing when all are present.
define install_missing
	@missing=$$(for p in $(1) $(EXTRA_DEBS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "make: installing" $$missing; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing; \
	fi
endef

setup:
	$(call install_missing,$(DEBS))

setup-run:
	$(call install_missing,$(RUN_DEBS))

# Everything, tests included (a build directory that `make run` made without tests gets them).
build: setup
	@if [ ! -f $(BUILD_DIR)/build.ninja ]; then $(CONFIGURE); \
	elif ! grep -qx 'MGLAUNCH_TESTS:BOOL=ON' $(BUILD_DIR)/CMakeCache.txt; then cmake -S . -B $(BUILD_DIR) -DMGLAUNCH_TESTS=ON; fi
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The main job: mgtrain, 4 data-parallel workers (gloo on CPU), one Fashion-MNIST epoch.
# Only RUN_DEBS, and only mglaunch and mgtrain are built (a fresh build directory without
# the tests; `make build` or `make test` adds them later).
run: setup-run
	@[ -f $(BUILD_DIR)/build.ninja ] || $(CONFIGURE) -DMGLAUNCH_TESTS=OFF
	cmake --build $(BUILD_DIR) -j $(JOBS) --target mglaunch mgtrain
	$(MGLAUNCH) --standalone --nproc_per_node=4 $(BUILD_DIR)/bin/mgtrain --dataset fashion-mnist --model cnn --epochs 1

# Every test but the soaks (label soak: long twins of short checks; README "Tests"); then
# the skipped tests, each with its reason. ctest runs twice as many tests as there are
# cores: most tests wait on the processes, sockets and daemons they start (at -j2 the tests
# kept the 2 cores about a third busy). The CPU-heavy ones (RESOURCE_GROUPS cpus:1 in
# tests/CMakeLists.txt) each hold one of ctest's `cpus` slots, one per core (CPUS_SPEC,
# ctest's resource spec file), so at most one per core runs beside the waiting tests.
# TEST_JOBS=N overrides.
TEST_JOBS ?= $(shell echo $$(( 2 * $(JOBS) )))
CPUS_SPEC = $(abspath $(BUILD_DIR))/ctest-cpus.json
CTEST := printf '{"version":{"major":1,"minor":0},"local":[{"cpus":[{"id":"0","slots":%d}]}]}\n' $(JOBS) > $(CPUS_SPEC) && \
         ctest --test-dir $(BUILD_DIR) -j $(TEST_JOBS) --resource-spec-file $(CPUS_SPEC) --output-on-failure --timeout 600
test: build
	@rc=0; $(CTEST) -LE soak || rc=$$?; tests/support/skipped.sh $(BUILD_DIR); tests/support/failed.sh $(BUILD_DIR); exit $$rc

# Only the soaks; test-all: everything (what CI runs).
soak: build
	@rc=0; $(CTEST) -L soak || rc=$$?; tests/support/skipped.sh $(BUILD_DIR); tests/support/failed.sh $(BUILD_DIR); exit $$rc

test-all: build
	@rc=0; $(CTEST) || rc=$$?; tests/support/skipped.sh $(BUILD_DIR); tests/support/failed.sh $(BUILD_DIR); exit $$rc

# The chaos soak (tests/chaos.py, issue #26): 12 minutes on the daemon, then 8 on a 3-member
# etcd, faults at random, network faults among them (--netns: every node and the rendezvous
# on a host of its own, #34); reports in bench/results/chaos-*.json (README "Chaos"). Each job
# must end within 1.25 times its plan (--plan-bound; #34).
CHAOS_SECONDS ?= 720
# Both soaks run and the README gets both reports, failed ones included; the exit status is
# the first failure's.
chaos: build
	@rc=0; \
	/usr/bin/python3 tests/chaos.py $(BUILD_DIR) --seconds $(CHAOS_SECONDS) --backend daemon --netns --plan-bound 1.25 --report bench/results/chaos-daemon.json || rc=$$?; \
	/usr/bin/python3 tests/chaos.py $(BUILD_DIR) --seconds $$(( $(CHAOS_SECONDS) * 2 / 3 )) --backend etcd --netns --plan-bound 1.25 --report bench/results/chaos-etcd.json || [ $$rc -ne 0 ] || rc=$$?; \
	/usr/bin/python3 bench/render_chaos.py bench/results/chaos-daemon.json bench/results/chaos-etcd.json || [ $$rc -ne 0 ] || rc=$$?; \
	exit $$rc

# Every benchmark case, mglaunch and torchrun in one run (bench/bench.py; docs/benchmarks.md):
# bench/results/latest.json, then the tables and guardrails of docs/benchmarks.md, the
# README's headline and docs/bench_*.png from it (bench/render.py).
# BENCH_QUICK=1: every case once at smaller sizes, written under $(BUILD_DIR)/bench-quick
# (copies of README.md and docs/benchmarks.md rendered there; the tree is left untouched).
QUICK_DIR := $(BUILD_DIR)/bench-quick
bench:
	$(MAKE) build
	cmake --build $(BUILD_DIR) -j $(JOBS) --target benches
ifeq ($(filter-out 0,$(BENCH_QUICK)),)
	/usr/bin/python3 bench/bench.py $(BUILD_DIR)
	/usr/bin/python3 bench/render.py
else
	mkdir -p $(QUICK_DIR)/docs && cp README.md $(QUICK_DIR)/README.md && cp docs/benchmarks.md $(QUICK_DIR)/docs/benchmarks.md
	/usr/bin/python3 bench/bench.py $(BUILD_DIR) --out $(QUICK_DIR)/quick.json
	/usr/bin/python3 bench/render.py --json $(QUICK_DIR)/quick.json --out $(QUICK_DIR)/docs/benchmarks.md \
	  --readme $(QUICK_DIR)/README.md --docs $(QUICK_DIR)/docs
endif

# A .deb of the build (binaries, man pages, README and docs/, the mglaunch-rdzv systemd unit) in $(BUILD_DIR).
package: build
	cd $(BUILD_DIR) && cpack -G DEB

clean:
	rm -rf $(BUILD_DIR)
