"""The dated GPU report (docs/benchmarks/gpu_<date>.{md,csv,png}) from the output folder of
tools/gpu_checks.sh: the GPU and its software, the GPU tier's outcome per test (one column per
``tier*.log``, in name order: a first run and reruns after fixes), and the
throughput of ResNet-50 and the transformer encoder under no strategy, MirroredStrategy and
tfdp (each with its defaults), with the ratios issue 45 sets as targets.

    python tools/gpu_report.py --results docs/benchmarks/gpu_2026-11-26 --date 2026-11-26
"""

from __future__ import annotations

import csv
import glob
import os
import re

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("results", None, "The OUT_DIR of tools/gpu_checks.sh.")
flags.DEFINE_string("date", None, "The date of the run (YYYY-MM-DD), in the report's name.")
flags.DEFINE_string("out_dir", "docs/benchmarks", "Where the report goes.")
flags.DEFINE_string("notes", "", "A markdown file appended to the report (findings, targets); "
                    "default: RESULTS/notes.md where it exists.")
flags.mark_flags_as_required(["results", "date"])

UNITS = {"resnet50": "images/s", "transformer": "tokens/s"}
TIER_LINE = re.compile(r"^(?:(PASSED|FAILED|SKIPPED|ERROR) )?(tests/test_gpu\.py::\S+)"
                       r"(?: (PASSED|FAILED|SKIPPED|ERROR))?")


def environment(steps_log):
    """The header tools/gpu_checks.sh writes: date, nvidia-smi's GPU line, CUDA, Python."""
    lines = open(steps_log).read().splitlines()
    env = {"gpu": "?", "driver": "?", "memory": "?", "cuda": "?", "python": "?"}
    for line in lines:
        if line.startswith("CUDA Version:"):
            env["cuda"] = line.split(":", 1)[1].strip()
        elif line.startswith("Python "):
            env["python"] = line.split()[1]
        elif line.count(",") == 2 and "MiB" in line:
            env["gpu"], env["driver"], env["memory"] = (p.strip() for p in line.split(","))
    env["steps"] = [line for line in lines if line.startswith("step ")]
    return env


def tier_outcomes(tier_log):
    """{test name: outcome} from pytest -v / -rA output (the last outcome said wins)."""
    outcomes = {}
    if not os.path.exists(tier_log):
        return outcomes
    for line in open(tier_log).read().splitlines():
        m = TIER_LINE.match(line.strip())
        if m and (m.group(1) or m.group(3)):
            outcomes[m.group(2).split("::", 1)[1]] = m.group(1) or m.group(3)
    return outcomes


def bench_rows(results):
    rows = []
    for path in sorted(glob.glob(os.path.join(results, "*.csv"))):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("error"):
                    row["ms_per_step"] = row["per_second"] = ""
                rows.append(row)
    return rows


def ratios(rows):
    """Per (model, precision, batch): tfdp's throughput over Mirrored's and over no strategy's."""
    by = {}
    for r in rows:
        if r["ms_per_step"]:
            per_replica = int(r["batch"]) // int(r["replicas"])
            by.setdefault((r["model"], r["precision"], per_replica), {})[r["config"]] = r
    out = []
    for key, configs in sorted(by.items()):
        if "tfdp" not in configs:
            continue
        tfdp_rate = float(configs["tfdp"]["per_second"])
        entry = {"model": key[0], "precision": key[1], "batch": key[2], "tfdp": tfdp_rate}
        for other in ("mirrored", "none"):
            if other in configs:
                entry[f"over_{other}"] = tfdp_rate / float(configs[other]["per_second"])
        out.append(entry)
    return out


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["precision"], r["batch"]) for r in rows if r["ms_per_step"]})
    configs = ["none", "mirrored", "tfdp"]
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(4 * max(1, len(groups)), 3.6),
                             squeeze=False)
    for ax, (model, precision, batch) in zip(axes[0], groups):
        values = []
        for c in configs:
            match = [r for r in rows if (r["model"], r["precision"], r["batch"], r["config"])
                     == (model, precision, batch, c) and r["ms_per_step"]]
            values.append(float(match[0]["per_second"]) if match else None)
        ax.bar(configs, [v or 0.0 for v in values], color=["#999999", "#4c72b0", "#dd8452"])
        ax.set_title(f"{model} {precision}, batch {batch}", fontsize=10)
        ax.set_ylabel(UNITS.get(model, "per s"))
        for i, v in enumerate(values):
            ax.text(i, v or 0.0, "not measured" if v is None else f"{v:,.0f}", ha="center",
                    va="bottom", fontsize=8)
    fig.suptitle("Training throughput on one GPU, each strategy with its defaults", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    env = environment(os.path.join(FLAGS.results, "steps.log"))
    tier_logs = sorted(glob.glob(os.path.join(FLAGS.results, "tier*.log")))
    runs = [(os.path.basename(path), tier_outcomes(path)) for path in tier_logs]
    rows = bench_rows(FLAGS.results)
    device_name = next((r["device"] for r in rows if r.get("device")), "")
    prefix = os.path.join(FLAGS.out_dir, f"gpu_{FLAGS.date}")
    columns = ["model", "config", "precision", "replicas", "batch", "jit_compile", "ms_per_step",
               "per_second", "device", "error"]
    with open(prefix + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# GPU report, {FLAGS.date}", "",
             f"- GPU: {env['gpu']} ({env['memory']}), driver {env['driver']}, CUDA {env['cuda']}",
             f"- TensorFlow 2.21.0 GPU wheel (CUDA 12 names pointed at the host's CUDA 13 "
             f"libraries, ../shared/gpu/), Python {env['python']}"
             + (f", TensorFlow's device name: {device_name}" if device_name else ""),
             "- Produced by `bash tools/gpu_checks.sh OUT` on a lent GPU machine, then "
             f"`python tools/gpu_report.py --results OUT --date {FLAGS.date}`.", "",
             "## The GPU tier (`pytest -m gpu tests/test_gpu.py`)", ""]
    if runs:
        names = list(dict.fromkeys(n for _, outcomes in runs for n in outcomes))
        lines += ["| test | " + " | ".join(f"`{log}`" for log, _ in runs) + " |",
                  "|---|" + "---|" * len(runs)]
        lines += [f"| {name} | " + " | ".join(outcomes.get(name, "not run")
                                             for _, outcomes in runs) + " |" for name in names]
    else:
        lines.append("Not run (no output).")
    lines += ["", "## Throughput (median epoch of 30 steps after a warm-up epoch)", "",
              "| model | strategy | precision | replicas | batch | XLA | ms/step | throughput |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ms_per_step"]:
            lines.append(f"| {r['model']} | {r['config']} | {r['precision']} | {r['replicas']} | "
                         f"{r['batch']} | {r['jit_compile']} | {float(r['ms_per_step']):.1f} | "
                         f"{float(r['per_second']):,.0f} {UNITS.get(r['model'], '')} |")
        else:
            lines.append(f"| {r['model']} | {r['config']} | {r['precision']} | | | | failed: "
                         f"{r['error'][:160]} | |")
    lines += ["", "## tfdp against the others (throughput ratios)", "",
              "| model | precision | batch | tfdp | tfdp / Mirrored | tfdp / no strategy |",
              "|---|---|---|---|---|---|"]
    for e in ratios(rows):
        lines.append(f"| {e['model']} | {e['precision']} | {e['batch']} | {e['tfdp']:,.0f} | "
                     f"{e.get('over_mirrored', float('nan')):.2f} | "
                     f"{e.get('over_none', float('nan')):.2f} |")
    lines += ["", "## Steps (seconds, exit codes)", "", "```", *env["steps"], "```", "",
              f"![throughput](gpu_{FLAGS.date}.png)", ""]
    notes = FLAGS.notes or os.path.join(FLAGS.results, "notes.md")
    if os.path.exists(notes):
        lines += ["", open(notes).read()]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines))
    if any(r["ms_per_step"] for r in rows):
        plot(rows, prefix + ".png")
    print(f"wrote {prefix}.md, .csv" + (", .png" if any(r["ms_per_step"] for r in rows) else ""))


if __name__ == "__main__":
    app.run(main)
