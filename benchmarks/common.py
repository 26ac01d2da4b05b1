"""Shared benchmark helpers: what machine and commit a number came from, and writing the
results into ``benchmarks/README.md`` (one ``## <title>`` section per benchmark; a rerun
replaces its own section and leaves the others alone)."""

from __future__ import annotations

import fcntl
import os
import platform
import re
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
README = REPO / "benchmarks" / "README.md"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(repo: Path = REPO) -> str:
    """The checked-out commit, read from .git without running git ("unknown" if absent)."""
    git = repo / ".git"
    try:
        if git.is_file():  # a worktree: ".git" names its own git dir (a detached HEAD is written there)
            git = Path(git.read_text().split("gitdir:", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:12]
        ref = head[5:]
        if (git / "commondir").is_file():  # a worktree's branch refs live in the main git dir
            git = (git / (git / "commondir").read_text().strip()).resolve()
        if (git / ref).is_file():
            return (git / ref).read_text().strip()[:12]
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:12]
    except OSError:
        pass
    return "unknown"


def machine_info() -> dict[str, str]:
    import torch

    info = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "commit": git_commit(),
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        pass
    return info


def default_cpu_run(threads: int):
    """(config, target, tokenized data) of the embedded default run (configs/smollm2-135m-cpu.yaml),
    the target on the CPU, ``threads`` torch threads: what the target-forward benchmarks time."""
    # lazy: heavy (torch, transformers, datasets); every benchmark imports this module, most for its tables
    import torch

    from specforge.config import load_config
    from specforge.data.prepare import prepare_dataset
    from specforge.device import set_threads
    from specforge.models.target import load_target

    set_threads(threads)
    cfg = load_config(REPO / "configs" / "smollm2-135m-cpu.yaml")
    target = load_target(cfg.model, torch.device("cpu"))
    return cfg, target, prepare_dataset(cfg.data, target.tokenizer, cache_dir=cfg.model.cache_dir, progress=False)


def header_markdown(info: Optional[dict[str, str]] = None) -> str:
    info = info or machine_info()
    return " | ".join(f"**{k}** {v}" for k, v in info.items())


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def append_section(title: str, body: str, path: Path = README) -> None:
    """Write ``## title`` + body into ``path``: replace that section if present, else append.
    Holds a file lock so two benchmarks finishing together do not lose each other's text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    section = f"## {title}\n\n{body.strip()}\n"
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read() or "# Benchmarks\n\nEach section is written by the script it names; rerun it to refresh.\n"
        pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
        if pattern.search(text):
            text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
        else:
            text = text.rstrip() + "\n\n" + section
        f.seek(0)
        f.truncate()
        f.write(text)


def publish(title: str, command: str, doc: str, table: str, info: Optional[dict[str, str]] = None,
            tail: str = "", write: bool = True) -> str:
    """A benchmark's README section: its command, the machine header, the script docstring's body (after
    its usage block), the table and ``tail``; printed, and written as ``## title`` unless ``write`` is off."""
    text = doc.split("\n\n", 2)[2].strip()
    body = f"`{command}` -- {header_markdown(info)}\n\n{text}\n\n{table}\n{tail}"
    print(body)
    if write:
        append_section(title, body)
    return body


def run(cmd: list[str]) -> float:
    """Run a command from the repo root, echoing it; its wall-clock seconds (fails on error)."""
    import subprocess

    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    return time.time() - t0
