"""Chaos: a seeded schedule of faults, each at a random moment, over a disaggregated run on this CPU.

    python benchmarks/chaos.py --backend hf|vllm|store [--minutes 30] [--seed 0] [--steps N] [--no-readme]

The run: ``python -m specforge.ray_train`` on a tiny random Qwen3 target (heads 32 wide, which vLLM's CPU
attention needs) and its 12 chats, disaggregated: 2 rollout workers (``rollout.backend`` hf or vllm), 2
train workers, a checkpoint every 20 steps, a held-out eval every 40, ``rollout.max_restarts`` and
``train.max_restarts`` high enough for the schedule. ``--backend store``: the same 2 train workers read a
feature store (``placement.mode=offline``) that ``python -m specforge.capture`` wrote first, in small
shards. First the same command runs uninterrupted (the reference); then the faulted run, the same command
again whenever a driver ends, until it completes.

Every ``--gap`` seconds or so (uniform over [0.5, 1.5] x gap, seeded) after the run made progress again,
one fault of the schedule (a seeded shuffle, every kind at least once) is injected into the running
driver's session:

    rollout   SIGKILL a RolloutWorker actor process           -> replaced in the run
    train     SIGKILL a TrainWorker actor process             -> restarted in the run
    engine    SIGKILL a vLLM server (vllm only)               -> its rollout worker replaced in the run
    driver    SIGKILL the driver                              -> the same command again resumes
    head      SIGKILL the driver's own GCS (the Ray head)     -> one error line; the command again
    disk      the next checkpoint write fails with ENOSPC     -> one error line (the rescue folder);
              (failpoint checkpoint.write:enospc@armed)          the command again resumes
    shard     one byte of a store shard flipped in place      -> one error line naming the shard (store
                                                                 only); the fix it names (the shard
                                                                 deleted, the capture rerun), then the
                                                                 command again resumes

Recorded per fault: how the run came through (recovered in the run / ended with one ``error:`` line /
resumed by the same command), and seconds from the fault to the next train step logged. At the end:
the train steps logged (each step exactly once in the final history: a step logged again after a
rollback must log the same loss), the final checkpoint's weights against the reference's (bit for bit:
the placement is deterministic on gloo), and what is left: processes of any driver's session, files in
/dev/shm, TCP ports listening that were not before. One heavy job: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, markdown_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KINDS = {"hf": ["rollout", "train", "driver", "head", "disk"],
         "vllm": ["rollout", "train", "engine", "driver", "head", "disk"],
         "store": ["train", "driver", "head", "disk", "shard"]}
EVERY, EVAL_EVERY = 20, 40
TITLE = "Chaos: faults at random moments over a disaggregated run"


def make_target(root: Path) -> None:
    from specforge.targets import tiny
    from tests.helpers.targets import target_folder

    make = tiny.qwen3

    def wide():
        config = make()
        config.head_dim = 32  # vLLM's CPU attention has no kernel for 16
        return config

    tiny.qwen3 = wide
    try:
        target_folder("qwen3", root)
    finally:
        tiny.qwen3 = make


def command(root: Path, out: Path, backend: str, steps: int, ray_tmp: str) -> list[str]:
    from tests.helpers.targets import overrides

    args = overrides(root) + [
        "train.num_workers=2", f"train.max_steps={steps}", "train.batch_size=1", f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=3", "checkpoint.resume=true", f"train.eval_every={EVAL_EVERY}", "train.log_every=1",
        f"train.output_dir={out}", "tracking.wandb=false", "parallel.timeout_s=120", "train.max_restarts=50",
        f"ray.temp_dir={ray_tmp}", "ray.num_cpus=6"]
    if backend == "store":
        # (no periodic eval: a store of the 12 chats is too small to hold samples out of)
        return [sys.executable, "-m", "specforge.ray_train", *args, "placement.mode=offline", "train.eval_every=0"]
    args += ["placement.mode=disaggregated", "rollout.num_workers=2", "rollout.max_restarts=50"]
    if backend == "vllm":
        args += ["rollout.backend=vllm", "rollout.vllm_args=[--enforce-eager]", "rollout.vllm_startup_timeout_s=400"]
    return [sys.executable, "-m", "specforge.ray_train", *args]


def store_dir(root: Path) -> Path:
    return root / "features"  # the store.dir of tests.helpers.targets.overrides


def capture_command(root: Path) -> list[str]:
    """The capture that writes the store the ``store`` backend trains from (small shards: many to corrupt);
    the same command again recaptures a shard deleted after it was found corrupt."""
    from tests.helpers.targets import overrides

    return [sys.executable, "-m", "specforge.capture", *overrides(root), "store.shard_mb=0.05", "--no-progress"]


def corrupt_a_shard(root: Path, rng: random.Random) -> Path:
    """One byte flipped in place (same size, same inode) in a random shard of the store, in its tensor
    bytes: what another job's stray write does; only the shard's sha256 can tell."""
    shards = json.loads((store_dir(root) / "index.json").read_text())["shards"]
    path = store_dir(root) / rng.choice(shards)["file"]
    size = path.stat().st_size
    at = rng.randrange(size // 2, size)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


# ---------------------------------------------------------------- what runs, what is left


def session(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getsid(int(d)) == sid:
                    with open(f"/proc/{d}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(d))
            except OSError:
                pass
    return out


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def victims(kind: str, driver: int) -> list[int]:
    """The processes of ``driver``'s session a fault of ``kind`` may hit."""
    pids = session(driver)
    if kind == "rollout":
        return [p for p in pids if cmdline(p)[0].startswith("ray::RolloutWorker")]
    if kind == "train":
        return [p for p in pids if cmdline(p)[0].startswith("ray::TrainWorker")]
    if kind == "engine":  # its guard runs it in a session of its own: found by its command line
        return engines()
    if kind == "head":
        return [p for p in pids if "gcs_server" in " ".join(cmdline(p))]
    return [driver]


def engines() -> list[int]:
    """Every vLLM server process on the machine (the harness runs alone: they are its rollout workers')."""
    return [int(d) for d in os.listdir("/proc") if d.isdigit()
            and cmdline(int(d))[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]]


def listening() -> set[str]:
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                out |= {line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"}
        except OSError:
            pass
    return out


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def train_rows(out: Path) -> list[dict]:
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    rows = []
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("kind") == "train":
            rows.append(r)
    return rows


# ---------------------------------------------------------------- the runs


class Driver:
    """One ``python -m specforge.ray_train`` (its own session), its output in a log file."""

    def __init__(self, cmd: list[str], log: Path, env: dict):
        self.log = log
        self.f = open(log, "w")
        self.p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.f, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def text(self) -> str:
        self.f.flush()
        return self.log.read_text(errors="replace")

    def done(self) -> Optional[int]:
        return self.p.poll()


def run_reference(cmd, out: Path, env: dict) -> float:
    t0 = time.monotonic()
    d = Driver(cmd, out.with_suffix(".log"), env)
    if d.p.wait() != 0:
        raise SystemExit(f"{d.text()[-3000:]}\nthe uninterrupted run failed (its output's end above)")
    return time.monotonic() - t0


def wait_progress(out: Path, after: int, driver: Driver, timeout: float) -> Optional[float]:
    """Seconds until a train row beyond the first ``after`` rows is logged (None: the driver ended first)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if len(train_rows(out)) > after:
            return time.monotonic() - t0
        if driver.done() is not None:
            return None
        time.sleep(0.2)
    return None


def left_by(driver: Driver, timeout: float = 30) -> list[str]:
    """What an ended driver left (its session's processes, vLLM servers: no other driver runs meanwhile) once
    ``timeout`` seconds have passed without it all going: pid, parent and command, for the record."""
    deadline = time.monotonic() + timeout
    while (pids := session(driver.p.pid) + engines()) and time.monotonic() < deadline:
        time.sleep(0.5)
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        out.append(f"{pid} (parent {ppid}): {' '.join(cmdline(pid)[:3])[:80]}")
    return out


def wait_for(driver: Driver, since: int, text: str, timeout: float) -> bool:
    """Whether ``text`` shows in the driver's output after offset ``since`` while it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and driver.done() is None:
        if text in driver.text()[since:]:
            return True
        time.sleep(0.2)
    return False


ENDS_THE_DRIVER = ("driver", "head", "disk", "shard")


def chaos(args, cmd, root: Path, out: Path, env: dict, marks: Path) -> tuple[list[dict], list[Driver]]:
    rng = random.Random(args.seed)
    kinds = KINDS[args.backend]
    schedule = list(kinds)
    while len(schedule) < args.faults:
        schedule.append(rng.choice(kinds))
    rng.shuffle(schedule)
    start = time.monotonic()
    drivers = [Driver(cmd, out.parent / "chaos-0.log", env)]
    faults, deadline = [], start + 60 * args.minutes
    for kind in schedule:
        d = drivers[-1]
        if wait_progress(out, len(train_rows(out)), d, 600) is None:
            break  # the run ended (completed, or on its own: the loop below reruns it)
        time.sleep(rng.uniform(0.5, 1.5) * args.gap)
        if d.done() is not None or time.monotonic() > deadline:
            break
        since = len(d.text())
        shard = None
        if kind == "shard":
            shard = corrupt_a_shard(root, rng)
        elif kind == "disk":  # the next checkpoint write fails
            armed = marks / "checkpoint.write.armed"
            marks.mkdir(exist_ok=True)
            armed.touch()
            while armed.exists() and d.done() is None:
                time.sleep(0.1)
        else:
            pids = victims(kind, d.p.pid)
            if not pids:
                print(f"chaos: no {kind} process to kill now, skipped", flush=True)
                continue
            os.kill(rng.choice(pids), signal.SIGKILL)
        t0 = time.monotonic()
        record = {"kind": kind, "at_s": round(t0 - start), "rows_before": len(train_rows(out))}
        if kind not in ENDS_THE_DRIVER and wait_for(d, since, "resumed at step", 900):
            again = wait_progress(out, len(train_rows(out)), d, 900)
            record.update(outcome="recovered in the run", seconds=round(time.monotonic() - t0, 1)
                          if again is not None else None)
        else:
            try:
                d.p.wait(600)
            except subprocess.TimeoutExpired:
                d.p.kill()
                d.p.wait()
                record["hung"] = True
            errors = [ln for ln in d.text()[since:].splitlines() if ln.startswith("error:")]
            record.update(exit=d.p.returncode, errors=len(errors), error=errors[0][:300] if errors else "")
            if d.p.returncode == 0:  # the run completed before the fault was met (a shard it did not read again)
                record.update(outcome="met by no step (the run completed)", seconds=None)
                print(f"chaos: {record}", flush=True)
                faults.append(record)
                break
            rows = len(train_rows(out))
            if left := left_by(d):  # before the rerun starts: what is left is this driver's
                record["left"] = left
            if shard is not None and str(shard) in (errors[0] if errors else ""):  # the fix the line names
                shard.unlink()
                fixed = subprocess.run(capture_command(root), cwd=REPO, env=env, capture_output=True, text=True)
                record["recaptured"] = fixed.returncode == 0
            drivers.append(Driver(cmd, out.parent / f"chaos-{len(drivers)}.log", env))
            again = wait_progress(out, rows, drivers[-1], 900)
            resumed = "resuming at step" in drivers[-1].text()
            record.update(outcome=("ended with a line, " if len(errors) == 1 else "")
                          + ("resumed by rerun" if resumed else "restarted by rerun"),
                          seconds=round(time.monotonic() - t0, 1) if again is not None else None)
        print(f"chaos: {record}", flush=True)
        faults.append(record)
    while drivers[-1].p.wait() != 0:  # to the end: the same command until it completes
        if len(drivers) > len(faults) + 3:  # a failure the same command cannot get past: the harness stops
            print(f"{drivers[-1].text()[-3000:]}\nchaos: {len(drivers)} drivers and no end: stopped (the last "
                  "one's output above)", flush=True)
            break
        drivers.append(Driver(cmd, out.parent / f"chaos-{len(drivers)}.log", env))
    return faults, drivers


def differs(row: dict, ref: Optional[dict]) -> bool:
    """A logged step against the uninterrupted run's: its loss, and its tokens (the samples) where both
    rows say (a row a resumed run restores from its checkpoint keeps fewer metrics)."""
    if ref is None or row["loss"] != ref["loss"]:
        return True
    return None not in (row.get("tokens"), ref.get("tokens")) and row["tokens"] != ref["tokens"]


def weights_equal(a: Path, b: Path) -> str:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    if wa.keys() != wb.keys():
        return "different tensors"
    diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa if wa[k].is_floating_point())
    return "equal (bit for bit)" if all(wa[k].equal(wb[k]) for k in wa) else f"max |diff| {diff:.3g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=sorted(KINDS), default="hf")
    ap.add_argument("--minutes", type=float, default=30, help="the faulted run's fault window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="train steps (default: hf 1600, vllm 600, store 1600)")
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--gap", type=float, default=60, help="mean seconds of progress between faults")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args(argv)
    steps = args.steps or {"hf": 1600, "vllm": 600, "store": 1600}[args.backend]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        root, ray_tmp = Path(tmp), tempfile.mkdtemp(prefix="/tmp/sfc")
        make_target(root)
        if args.backend == "store":
            subprocess.run(capture_command(root), cwd=REPO, env=env, check=True, capture_output=True)
        marks = root / "marks"
        shm0, ports0 = shm(), listening()
        straight = root / "straight"
        ref_s = run_reference(command(root, straight, args.backend, steps, ray_tmp), straight, env)
        print(f"chaos: the uninterrupted run took {ref_s:.0f} s", flush=True)
        out = root / "chaos"
        out.mkdir()
        fenv = {**env, "SPECFORGE_FAILPOINTS": "checkpoint.write:enospc@armed", "SPECFORGE_FAILPOINT_DIR": str(marks)}
        t0 = time.monotonic()
        faults, drivers = chaos(args, command(root, out, args.backend, steps, ray_tmp), root, out, fenv, marks)
        total_s = time.monotonic() - t0
        time.sleep(35)  # a stopped driver's reaper has 2 x 5 s; an engine's guard 10 s
        left_procs = [p for d in drivers for p in session(d.p.pid)] + engines()
        left_shm, left_ports = sorted(shm() - shm0), listening() - ports0
        rows, want = train_rows(out), {r["step"]: r for r in train_rows(straight)}
        steps_logged = {r["step"] for r in rows}
        mismatched = sorted({r["step"] for r in rows if differs(r, want.get(r["step"]))})
        final = weights_equal(out / "checkpoints" / "latest", straight / "checkpoints" / "latest")
    report = summarize(args, steps, ref_s, total_s, faults, drivers, rows, steps_logged, mismatched, final,
                       left_procs, left_shm, left_ports)
    print(report)
    if not args.no_readme:
        append_section(f"{TITLE} (rollout.backend={args.backend})", f"{header_markdown()}\n\n{report}")
    ok = drivers[-1].p.returncode == 0 and final.startswith("equal")
    return 0 if ok and not (mismatched or left_procs or left_shm or left_ports) else 1


def ended_with(kind: str, faults: list[dict]) -> str:
    if line := next((f["error"] for f in faults if f.get("error")), None):
        return f"`{line}`"
    if kind == "driver":
        return "none (SIGKILLed: it cannot print one; the rerun says where it resumes)"
    if all(f["outcome"] == "recovered in the run" for f in faults):
        return "none (recovered in the run; the driver said which worker it replaced)"
    return "none: " + "; ".join(sorted({f["outcome"] for f in faults}))


def summarize(args, steps, ref_s, total_s, faults, drivers, rows, steps_logged, mismatched, final,
              left_procs, left_shm, left_ports) -> str:
    by_kind: dict[str, list[dict]] = {}
    for f in faults:
        by_kind.setdefault(f["kind"], []).append(f)
    table = []
    for kind, fs in sorted(by_kind.items()):
        secs = [f["seconds"] for f in fs if f.get("seconds") is not None]
        table.append([kind, len(fs), sum(f["outcome"] == "recovered in the run" for f in fs),
                      sum("resumed by rerun" in f["outcome"] for f in fs),
                      sum(f["outcome"].startswith("ended with a line") for f in fs),
                      f"{min(secs):.0f} / {sorted(secs)[len(secs) // 2]:.0f} / {max(secs):.0f}" if secs else "-"])
    cmd = (f"`python benchmarks/chaos.py --backend {args.backend} --steps {steps} --minutes {args.minutes:g} "
           f"--seed {args.seed} --faults {args.faults} --gap {args.gap:g}`")
    facts = [
        ["train steps", steps],
        ["uninterrupted run", f"{ref_s:.0f} s"],
        ["faulted run (all drivers)", f"{total_s:.0f} s, {len(drivers)} driver starts, "
         + ("completed" if drivers[-1].p.returncode == 0 else f"NOT completed (exit {drivers[-1].p.returncode})")],
        ["faults injected", len(faults)],
        ["train rows logged / distinct steps", f"{len(rows)} / {len(steps_logged)} (of {steps})"],
        ["steps logged with a loss or tokens other than the uninterrupted run's (samples not trained exactly "
         "once as planned)", len(mismatched)],
        ["final weights vs the uninterrupted run's", final],
        ["processes left (any driver's session, any vLLM server)", len(left_procs)],
        ["files left in /dev/shm", len(left_shm)],
        ["TCP ports left listening", len(left_ports)],
    ]
    workers = ("2 train workers reading a captured store" if args.backend == "store"
               else f"2 rollout ({args.backend}) + 2 train workers")
    return (f"{cmd}: a tiny Qwen3 target (heads 32), {workers}, a checkpoint every {EVERY} steps. Seconds to "
            f"recover: from the fault to the next train step logged (min / median / max; a rerun's include the new "
            f"driver's start).\n\n"
            + markdown_table(["fault", "injected", "recovered in the run", "resumed by rerun", "ended with a line",
                              "seconds to recover"], table)
            + "\n\n" + markdown_table(["", ""], facts)
            + "\n\nThe line each kind of fault ended a driver with (first seen):\n\n"
            + "\n".join(f"* {kind}: {ended_with(kind, fs)}" for kind, fs in sorted(by_kind.items()))
            + ("\n\nLeft in /dev/shm: " + ", ".join(left_shm[:10]) if left_shm else "")
            + "".join(f"\n\nLeft 30 s after the driver the {f['kind']} fault ended (at {f['at_s']} s): "
                      + "; ".join(f["left"]) for f in faults if f.get("left")))


if __name__ == "__main__":
    sys.exit(main())
