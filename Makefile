# Entry points for people and CI. Each target installs missing Debian packages first
# (scripts/install-deps.sh; needs root or sudo only when something is missing): `make train` only
# what building and training need (scripts/install-deps.sh train), the test targets what the tests
# add (test), `make fuzz` clang too (all).
#   make train      build the meshgrad program and run the main job (meshgrad train, threads backend,
#                   defaults): on a fresh 2-core machine the first step comes within 5 minutes
#   make test       build everything (library, program, tests, benchmarks, Python module) and run the
#                   whole test suite with ctest (docs/BENCHMARKS.md, "First run": its time after make train)
#   make test-asan  the suite under AddressSanitizer + UndefinedBehaviorSanitizer
#   make test-tsan  the threads-backend communication and tensor (caching allocator) tests under TSan
#   make fuzz       the libFuzzer targets (clang), 20000 runs each from fuzz/corpus
JOBS ?= $(shell nproc)
BUILD ?= build
CMAKE_FLAGS ?=
# -march=native for this machine's speed; NATIVE=OFF builds what runs on any x86-64 (e.g. to install).
NATIVE ?= ON
# ccache, when installed (scripts/install-deps.sh test installs it), caches every compile of the
# builds below (release, ASan, TSan, fuzz): a rebuild, or CI on a machine that built the same sources
# before, compiles only what changed. Paths are hashed relative to this checkout (CCACHE_BASEDIR), so
# two clones of the same commit share their objects. `make CCACHE=` builds without it.
CCACHE ?= $(shell command -v ccache 2>/dev/null)
ifneq ($(CCACHE),)
LAUNCHER := -DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE) -DCMAKE_C_COMPILER_LAUNCHER=$(CCACHE)
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := true
endif

.PHONY: deps deps-test deps-train build build-program train gradcheck test test-asan test-tsan fuzz clean

deps:
	@scripts/install-deps.sh all

deps-test:
	@scripts/install-deps.sh test

deps-train:
	@scripts/install-deps.sh train

# The program alone, configured without the tests, benchmarks and Python module (whose packages
# `make train` does not install); the same build directory and compile flags as `build`, so a later
# `make test` reuses every object and only adds the rest.
build-program: deps-train
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DMESHGRAD_NATIVE=$(NATIVE) -DMESHGRAD_BUILD_TESTS=OFF \
	      -DMESHGRAD_BUILD_BENCH=OFF -DMESHGRAD_PYTHON=OFF $(LAUNCHER) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS) --target meshgrad_cli

build: deps-test
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DMESHGRAD_NATIVE=$(NATIVE) -DMESHGRAD_BUILD_TESTS=ON \
	      -DMESHGRAD_BUILD_BENCH=ON -DMESHGRAD_PYTHON=ON $(LAUNCHER) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

train: build-program
	$(BUILD)/meshgrad train

gradcheck: build-program
	$(BUILD)/meshgrad gradcheck

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-asan: deps-test
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DMESHGRAD_SANITIZER=address,undefined \
	      -DMESHGRAD_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" $(LAUNCHER)
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/lsan-suppressions.txt \
	  ctest --output-on-failure -j $(JOBS) -LE mpi

# TSan without oneDNN: its OpenMP runtime (libgomp) is not instrumented, so TSan would report its
# own barriers; the products run on OpenBLAS there.
test-tsan: deps-test
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DMESHGRAD_SANITIZER=thread -DMESHGRAD_WITH_MPI=OFF -DMESHGRAD_ONEDNN=OFF \
	      -DMESHGRAD_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" $(LAUNCHER)
	cmake --build build-tsan -j $(JOBS) --target test_comm test_tensor
	cd build-tsan && ctest --output-on-failure -j $(JOBS) -L 'comm|tensor'

fuzz: deps
	JOBS=$(JOBS) FUZZ_LAUNCHER="$(LAUNCHER)" scripts/fuzz.sh

clean:
	rm -rf build build-asan build-tsan build-fuzz
