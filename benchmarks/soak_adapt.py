"""A soak of ``python -m specforge.adapt``: a steady load through its proxy while rounds run, one live
llama-server killed mid-load, adapt itself killed and started again; every request counted.

    python benchmarks/soak_adapt.py --draft runs/smollm2-135m-cpu/checkpoints/latest [--minutes 30] [--clients 4]

``--clients`` clients send the traffic share of HumanEval's prompts (as ``bench_adapt.py``) through the
proxy for ``--minutes``. At a quarter of the time the live llama-server (adapt's child) is SIGKILLed:
adapt must start it again with the live draft (a round in progress ends, the live draft stays). At half
the time adapt is SIGKILLed (its children go with it) and the same command is started again: it must
resume (a round in progress where it was) and serve on the same port. adapt runs rounds until it is
interrupted: the soak ends, with a Ctrl-C to adapt (it answers the requests in flight, then exits 130),
once the time is up and ``--rounds`` rounds are recorded, or at ``--max-minutes`` (1.5x the time).

Counted: requests answered (HTTP 200), refused or failed while adapt was up (errors), and while it
was down between its kill and its restart answering (expected: nobody listens); requests that got
no answer at all while adapt was up (lost). Checked: every round's draft named in metrics.jsonl and
the live draft exist (no draft lost), state.json is consistent, adapt exits 0 at the end. A table goes
to ``benchmarks/README.md`` ("Soak of specforge.adapt").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_adapt import Load, add_run_args, humaneval, measured_task, wait_healthy  # noqa: E402
from benchmarks.common import REPO, append_section, header_markdown, machine_info, markdown_table  # noqa: E402

TITLE = "Soak of specforge.adapt (load, a killed server, a killed adapt)"


def children(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the processes whose parent is ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, IndexError, ValueError):
            continue
    return out


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, "soak-adapt")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds to see recorded before the end (adapt runs on until then)")
    ap.add_argument("--min-rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64, help="per served request")
    ap.add_argument("--threads", type=int, default=1, help="adapt's and llama-server's threads (1 + 1 on 2 cores)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop then even if rounds are missing (default 1.5x)")
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("overrides", nargs="*", help="more adapt keys, e.g. adapt.general_prompts=8")
    args = ap.parse_args()

    from specforge.jsonhttp import free_port

    out = Path(args.out)
    root = out / "adapt"
    if root.exists():
        raise SystemExit(f"{root} exists: move it away (a soak starts from the start draft)")
    out.mkdir(parents=True, exist_ok=True)
    traffic = [t for t in humaneval() if not measured_task(t["task_id"])]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specforge.adapt", "--config", args.config, f"adapt.dir={root}",
           f"adapt.draft={Path(args.draft).resolve()}", f"adapt.min_rows={args.min_rows}",
           f"adapt.steps={args.steps}", f"adapt.port={port}", f"adapt.threads={args.threads}",
           f"train.num_threads={args.threads}", "tracking.wandb=false", "adapt.poll_s=2"]
    if args.reference_store:
        cmd.append(f"adapt.reference_store={Path(args.reference_store).resolve()}")
    cmd += args.overrides
    log = open(out / "adapt.log", "ab")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start() -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    events: dict[str, float] = {}
    t0 = time.time()
    proc = start()
    events["first serving"] = wait_healthy(url, proc, 900)
    metrics = root / "metrics.jsonl"
    end, hard_end = t0 + 60 * args.minutes, t0 + 60 * (args.max_minutes or 1.5 * args.minutes)
    server_killed = adapt_killed = False
    with Load(url, traffic, args.clients, args.max_tokens, max_requests=10**6) as load:
        while time.time() < hard_end:
            now = time.time()
            if proc.poll() is not None:
                break  # it failed (it serves until interrupted): its exit code says so
            if not server_killed and now - t0 > 0.25 * 60 * args.minutes:
                servers = [pid for pid, line in children(proc.pid) if "llama-server" in line]
                if servers:
                    os.kill(servers[0], signal.SIGKILL)
                    events["llama-server killed"] = now
                    server_killed = True
            if server_killed and not adapt_killed and now - t0 > 0.5 * 60 * args.minutes:
                os.killpg(proc.pid, signal.SIGKILL)  # adapt and everything it started, no cleanup
                proc.wait(timeout=60)
                events["adapt killed"] = time.time()
                adapt_killed = True
                proc = start()
                events["adapt serving again"] = wait_healthy(url, proc, 900)
            if now > end and len(rows_of(metrics)) >= args.rounds:
                break
            time.sleep(1)
        served_until = time.time()
    stopped_by_us = proc.poll() is None
    if stopped_by_us:  # the end: stop it as a user would (Ctrl-C: the requests in flight are answered first)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    minutes = (time.time() - t0) / 60

    down = (events.get("adapt killed", 0), events.get("adapt serving again", 0))
    up = [r for r in load.log if r[0] <= served_until and not (down[0] <= r[0] <= down[1])]
    during_down = [r for r in load.log if down[0] <= r[0] <= down[1]]
    answered = sum(1 for r in up if r[2] == 200)
    lost = sum(1 for r in up if r[2] == 0)
    errors = len(up) - answered
    # where the errors fell: in flight when adapt was SIGKILLed, or after the llama-server kill until its next answer
    kill = events.get("llama-server killed", 0)
    back = min((a for a, _, st in load.log if st == 200 and a > kill), default=kill) if kill else 0
    at_kill = sum(1 for a, b, st in up if st != 200 and a < down[0] <= b + 1)
    server_gap = sum(1 for a, _, st in up if st != 200 and kill <= a <= back)
    rounds = rows_of(metrics)
    state = json.loads((root / "state.json").read_text())
    named = [r.get("live") for r in rounds] + [r.get("candidate") for r in rounds] + [state["live"]]
    missing = sorted({p for p in named if p and not (Path(p) / "model.safetensors").is_file()})
    table = [[r["round"], r.get("status"), r.get("train_rows"), r.get("steps"), r.get("why", "")[:80] or "-",
              f"{r['minutes']:.1f}"] for r in rounds]
    text = markdown_table(["round", "status", "training rows", "steps", "why (when not swapped)", "minutes"], table)
    when = ", ".join(f"{k} at {(v - t0) / 60:.1f} min" for k, v in events.items())
    summary = (f"{len(load.log)} requests from {args.clients} clients in {minutes:.1f} min ({when}). "
               f"While adapt was up: {answered} answered, {errors} errors ({at_kill} in flight at adapt's SIGKILL, "
               f"{server_gap} between the llama-server kill and its next answer), of which {lost} got no answer "
               "at all; while it was down (its kill "
               f"to its restart answering, {(down[1] - down[0]):.1f} s): {len(during_down)} requests, "
               f"{sum(1 for r in during_down if r[2] == 200)} answered. Rounds recorded: {len(rounds)}; drafts named "
               f"in metrics.jsonl and state.json missing: {len(missing)}; adapt's exit code {proc.returncode} "
               f"({'130: it ended on the Ctrl-C that closes the soak' if stopped_by_us else 'it ended by itself'}); "
               f"live draft at the end: {state['live']}.")
    print(text + "\n\n" + summary)
    with open(out / "requests.jsonl", "w") as f:  # every request: when it started and ended, its status
        f.writelines(json.dumps({"start": a - t0, "end": b - t0, "status": st}) + "\n" for a, b, st in load.log)
    (out / "result.json").write_text(json.dumps({"events": {k: v - t0 for k, v in events.items()}, "rounds": rounds,
                                                 "answered": answered, "errors": errors, "lost": lost,
                                                 "down_requests": len(during_down), "missing": missing,
                                                 "exit": proc.returncode}, indent=2))
    if not args.no_readme:
        body = (f"{header_markdown(machine_info())}\n\n"
                f"`python benchmarks/soak_adapt.py --minutes {args.minutes:g} --clients "
                f"{args.clients} --rounds {args.rounds} --min-rows {args.min_rows} --steps {args.steps} --threads "
                f"{args.threads} {' '.join(args.overrides)}` (start draft: `{args.draft}`)\n\n{text}\n\n{summary}\n")
        append_section(TITLE, body)
    return 0 if not missing and stopped_by_us and proc.returncode == 130 else 1


if __name__ == "__main__":
    sys.exit(main())
