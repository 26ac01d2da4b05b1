"""Each test's time in one run of the suite, kept where the suite reads it.

    bash scripts/test.sh --junitxml=/tmp/suite.xml
    python benchmarks/suite_durations.py /tmp/suite.xml --how "fresh clone, -n 2" [--yardstick] [--no-write]

Reads pytest's JUnit XML (each test's setup, call and teardown summed: what the test costs the worker that
runs it, its module fixtures' builds included for the first test that needs them) and writes
``benchmarks/test_durations.json``: the machine, commit and how the suite ran, every module's total and
every test that took at least a second. ``tests/test_suite_bounds.py`` reads it: every test that took
over 30 s says why in its docstring. Prints the slowest 20 as a table (benchmarks/README.md, "Test suite
durations", keeps one). ``--yardstick`` measures the machine's speed (benchmarks/machine_speed.py, ~20 s)
right after the run and records it beside the times: the same tree's suite time moves with it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO, machine_info, markdown_table  # noqa: E402

OUT = REPO / "benchmarks" / "test_durations.json"


def read_junit(path: Path) -> dict[str, float]:
    """``tests/test_x.py::name[param]`` -> seconds (setup + call + teardown), from pytest's JUnit XML."""
    times: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        if len(module) < 2:
            continue
        # classname "tests.test_x" (or "tests.test_x.TestClass"): the file is the first two parts
        node = f"{module[0]}/{module[1]}.py::" + "::".join([*module[2:], case.get("name", "")])
        times[node] = times.get(node, 0.0) + float(case.get("time") or 0.0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--how", default="", help="how the suite ran (fresh clone or not, workers, vector path)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/test_durations.json")
    ap.add_argument("--yardstick", action="store_true", help="record the machine's speed now (machine_speed.py)")
    args = ap.parse_args()
    times = read_junit(args.junit)
    modules: dict[str, float] = collections.Counter()
    for node, s in times.items():
        modules[node.split("::")[0]] += s
    info = {**machine_info(), "how": args.how, "tests": str(len(times)), "seconds": f"{sum(times.values()):.0f}"}
    if args.yardstick:
        from benchmarks.machine_speed import measure

        info["machine_speed"] = measure()
        print("machine speed now:", info["machine_speed"])
    slowest = sorted(times.items(), key=lambda kv: -kv[1])
    doc = {"info": info,
           "modules": {m: round(s, 1) for m, s in sorted(modules.items(), key=lambda kv: -kv[1])},
           "tests": {n: round(s, 1) for n, s in slowest if s >= 1.0}}
    rows = [[f"{s:.1f}", f"`{n}`"] for n, s in slowest[:20]]
    print(markdown_table(["seconds", "test (setup + call + teardown)"], rows))
    print(f"{len(times)} tests, {sum(times.values()):.0f} s of worker time; modules, longest first: "
          + ", ".join(f"{Path(m).name} {s:.0f}" for m, s in list(doc["modules"].items())[:12]))
    if not args.no_write:
        OUT.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
