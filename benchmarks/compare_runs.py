"""One record of mok run two ways on one GPU, from alternating runs that leave
OUT/base-<round>/*.json and OUT/other-<round>/*.json (`benchmarks/triton_versions.sh bench`: two
Triton releases; `benchmarks/ab_commits.sh`: two commits): per (preset, pass, precision) each run's
median over rounds, and the speed of the second relative to the first (its ms over the other's:
above 1 is faster).

    python benchmarks/compare_runs.py OUT --labels "triton 3.6.0" "triton 3.9.0" --what triton-versions
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from collections import defaultdict

RUNS = ("base", "other")


def _runs(out: str, run: str) -> list[dict]:
    return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(out, f"{run}-*", "*.json")))]


def compare(out: str, labels: tuple[str, str], command: str) -> dict:
    """The combined record; raises if a run is missing or failed its correctness check."""
    records = {run: _runs(out, run) for run in RUNS}
    if not records["base"] or not records["other"]:
        raise SystemExit(f"no records of both runs under {out}: {[run for run in records if not records[run]]}")
    ms = defaultdict(list)
    errors = {}
    for run, runs in records.items():
        for record in runs:
            for result in record["results"]:
                key = (result["preset"], result["pass"], result["precision"])
                if result.get("status", "ok") != "ok":
                    raise SystemExit(f"{run} {key}: {result.get('status')} {result.get('message', '')}")
                ms[run, key].append(result["ms"])
                errors[run, key] = result.get("max_rel_err")
    first = records["base"][0]
    triton = {run: records[run][0]["triton"] for run in RUNS}
    results = []
    for key in sorted({key for _, key in ms}):
        base, other = statistics.median(ms["base", key]), statistics.median(ms["other", key])
        preset, pass_, precision = key
        for run, label, value in zip(RUNS, labels, (base, other)):
            results.append({"preset": preset, "pass": pass_, "impl": "mok", "precision": precision, "ep": 1,
                            "run": label, "triton": triton[run], "ms": value, "ms_rounds": ms[run, key],
                            "max_rel_err": errors[run, key]})
        results[-1]["speed_vs_base"] = base / other
    return {"gpu": first["gpu"], "num_gpus": 1, "torch": first["torch"],
            "triton": " and ".join(dict.fromkeys(triton.values())), "date": first["date"], "command": command,
            "runs": list(labels), "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--labels", nargs=2, metavar=("BASE", "OTHER"), required=True,
                        help="what the two runs are, e.g. two Triton releases or two commits")
    parser.add_argument("--what", required=True, help="the <what> of the record's name <gpu>-<yyyymmdd>-<what>.json")
    parser.add_argument("--command", required=True, help="the command that made the runs, for the record")
    args = parser.parse_args()
    record = compare(args.out, tuple(args.labels), args.command)
    gpu = record["gpu"].split()[1].lower() if len(record["gpu"].split()) > 1 else "gpu"
    path = os.path.join(args.out, f"{gpu}-{record['date'].replace('-', '')}-{args.what}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{'preset':18} {'pass':8} {'precision':10} " + " ".join(f"{label:>14}" for label in args.labels)
          + "  speed")
    worst = 1.0
    for base, other in zip(record["results"][::2], record["results"][1::2]):
        print(f"{base['preset']:18} {base['pass']:8} {base['precision']:10} {base['ms']:11.3f} ms "
              f"{other['ms']:11.3f} ms  {other['speed_vs_base']:.3f}×")
        worst = max(worst, abs(other["speed_vs_base"] - 1.0) + 1.0)
    print(f"largest departure from 1: {worst - 1.0:.3f}")
    print("record:", path)


if __name__ == "__main__":
    main()
