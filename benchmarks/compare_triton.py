"""One record of mok under two Triton releases, from the alternating runs that
`benchmarks/triton_versions.sh bench` leaves (OUT/base-<round>/*.json, OUT/other-<round>/*.json):
per (preset, pass, precision) each release's median over rounds, and the speed of the second
relative to the first (its ms over the other's: above 1 is faster).

    python benchmarks/compare_triton.py OUT [--command "..."]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from collections import defaultdict


def _runs(out: str, run: str) -> list[dict]:
    return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(out, f"{run}-*", "*.json")))]


def compare(out: str, command: str) -> dict:
    """The combined record; raises if a run is missing or failed its correctness check."""
    records = {run: _runs(out, run) for run in ("base", "other")}
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
    triton = {run: records[run][0]["triton"] for run in records}
    results = []
    for key in sorted({key for _, key in ms}):
        base, other = statistics.median(ms["base", key]), statistics.median(ms["other", key])
        preset, pass_, precision = key
        for run, value in (("base", base), ("other", other)):
            results.append({"preset": preset, "pass": pass_, "impl": "mok", "precision": precision, "ep": 1,
                            "triton": triton[run], "ms": value, "ms_rounds": ms[run, key],
                            "max_rel_err": errors[run, key]})
        results[-1]["speed_vs_base"] = base / other
    return {"gpu": first["gpu"], "num_gpus": 1, "torch": first["torch"], "triton": f"{triton['base']} and "
            f"{triton['other']}", "date": first["date"], "command": command, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--command", default="benchmarks/triton_versions.sh bench")
    args = parser.parse_args()
    record = compare(args.out, args.command)
    gpu = record["gpu"].split()[1].lower() if len(record["gpu"].split()) > 1 else "gpu"
    path = os.path.join(args.out, f"{gpu}-{record['date'].replace('-', '')}-triton-versions.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{'preset':18} {'pass':8} {'precision':10} " + " ".join(f"{'triton ' + v:>14}" for v in
                                                                  record["triton"].split(" and ")) + "  speed")
    for base, other in zip(record["results"][::2], record["results"][1::2]):
        print(f"{base['preset']:18} {base['pass']:8} {base['precision']:10} {base['ms']:11.3f} ms "
              f"{other['ms']:11.3f} ms  {other['speed_vs_base']:.3f}×")
    print("record:", path)


if __name__ == "__main__":
    main()
