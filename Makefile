# moerail — the two commands of the README, and the steps they are made of.
#   make run    bootstrap, build, run the main job (`moerail run`) on its default configuration
#   make test   bootstrap, build, run every test (GPU tests skip where no GPU is present)
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# The Python the package is built and tested for: the system one, where scripts/bootstrap installs NumPy, pytest and
# PyTorch from Debian.
PYTHON ?= $(shell if [ -x /usr/bin/python3 ]; then echo /usr/bin/python3; else command -v python3; fi)

.PHONY: all bootstrap configure build test run install clean

all: build

bootstrap:
	@scripts/bootstrap --quiet

$(BUILD)/build.ninja: CMakeLists.txt | bootstrap
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(PYTHON) $(CMAKE_FLAGS)

configure: bootstrap $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

run: build
	$(BUILD)/tools/moerail run

install: build
	cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf $(BUILD)
