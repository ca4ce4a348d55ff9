# Entry points for people and CI. Each target installs missing Debian packages first
# (scripts/install-deps.sh; needs root or sudo only when something is missing).
#   make train      build and run the main job (meshgrad train on the threads backend, defaults)
#   make test       build and run the whole test suite with ctest
#   make test-asan  the suite under AddressSanitizer + UndefinedBehaviorSanitizer
#   make test-tsan  the threads-backend communication and tensor (caching allocator) tests under TSan
#   make fuzz       the libFuzzer targets (clang), 20000 runs each from fuzz/corpus
JOBS ?= $(shell nproc)
BUILD ?= build
CMAKE_FLAGS ?=
# -march=native for this machine's speed; NATIVE=OFF builds what runs on any x86-64 (e.g. to install).
NATIVE ?= ON

.PHONY: deps build train gradcheck test test-asan test-tsan fuzz clean

deps:
	@scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DMESHGRAD_NATIVE=$(NATIVE) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

train: build
	$(BUILD)/meshgrad train

gradcheck: build
	$(BUILD)/meshgrad gradcheck

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DMESHGRAD_SANITIZER=address,undefined \
	      -DMESHGRAD_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g"
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j $(JOBS) -LE mpi

test-tsan: deps
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DMESHGRAD_SANITIZER=thread -DMESHGRAD_WITH_MPI=OFF \
	      -DMESHGRAD_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g"
	cmake --build build-tsan -j $(JOBS) --target test_comm test_tensor
	cd build-tsan && ctest --output-on-failure -j $(JOBS) -L 'comm|tensor'

fuzz: deps
	JOBS=$(JOBS) scripts/fuzz.sh

clean:
	rm -rf build build-asan build-tsan build-fuzz
