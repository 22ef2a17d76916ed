"""Read a GPU window's ``$OUT`` into committed lines and the README's "What has and has not run".

``python benchmarks/gpu_results.py DIR`` takes the folder a ``benchmarks/gpu_window.sh`` call filled (``env.json``,
``stages.jsonl``, ``correctness.xml`` and the results files) and appends to ``benchmarks/results/gpu_window.jsonl``:
one ``window`` line (GPU, its kind, driver, torch, Triton, CUDA, commit, date, each stage's exit status and
seconds, the correctness tests' counts) and one line per results line (``window_stage``: the stage that wrote
it), each stamped with the same identity. A
window already in the file (same commit and date) is not added twice; a results line whose commit is not the
window's is refused (one line naming the file and line). Then it rewrites the README's block between
``<!-- gpu-window:start -->`` and ``<!-- gpu-window:end -->`` from every window in the file: per window, what
ran and which targets held on that GPU, with the memory-bound limit beside each. Windows rehearsed on a CPU
(``--tiny``/``--dry``) are refused unless ``--allow-cpu`` (the tests use it, with their own files).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: results file of each stage in $OUT
RESULT_FILES = {"kernels": "kernels.jsonl", "rollout": "rollout.jsonl", "speculative": "speculative.jsonl",
                "train": "train_step.jsonl"}  # fmt: skip
IDENTITY = ("commit", "date", "mode", "gpu", "gpu_kind", "driver", "torch", "triton", "cuda", "python")
START, END = "<!-- gpu-window:start -->", "<!-- gpu-window:end -->"


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file (absent: none); a bad line raises naming the file and line."""
    if not path.exists():
        return []
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not a JSON line ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests / failures / errors / skipped of a pytest JUnit XML file (None when absent)."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def read_window(folder: Path, allow_cpu: bool = False) -> list[dict]:
    """The window line and its results lines (identity-stamped) from one ``$OUT`` folder."""
    env_path = folder / "env.json"
    if not env_path.exists():
        raise ValueError(
            f"{env_path}: missing (the window's env stage writes it; is {folder} a window's $OUT?)"
        )
    env = json.loads(env_path.read_text())
    missing = [k for k in ("commit", "date", "mode", "gpu", "torch", "triton") if not env.get(k)]
    if missing:
        raise ValueError(f"{env_path}: expected {', '.join(missing)}")
    if env["mode"] != "gpu" and not allow_cpu:
        raise ValueError(
            f"{env_path}: a {env['mode']} rehearsal on {env['gpu']}, not a GPU window (--allow-cpu)"
        )
    identity = {k: env.get(k) for k in IDENTITY}
    stages = read_jsonl(folder / "stages.jsonl")
    window = {"record": "window", **identity, "gpu_memory_gib": env.get("gpu_memory_gib"),
              "stages": {s["stage"]: {"rc": s["rc"], "seconds": s["seconds"], "limit_s": s["limit_s"]} for s in stages},
              "correctness": junit_counts(folder / "correctness.xml")}  # fmt: skip
    out = [window]
    for stage, name in RESULT_FILES.items():
        for i, row in enumerate(read_jsonl(folder / name), 1):
            if row.get("commit") not in (None, env["commit"]):
                raise ValueError(
                    f"{folder / name}:{i}: commit {row['commit']} is not the window's {env['commit']}"
                )
            out.append({"record": "result", "window_stage": stage, **row, **identity})
    return out


def add_window(folder: Path, results: Path, allow_cpu: bool = False) -> list[dict]:
    """Append one window's lines to ``results`` (once); returns every line the file then holds."""
    lines = read_window(folder, allow_cpu)
    kept = read_jsonl(results)
    key = (lines[0]["commit"], lines[0]["date"])
    if any(r.get("record") == "window" and (r.get("commit"), r.get("date")) == key for r in kept):
        print(f"{folder}: window {key[0][:12]} {key[1]} is already in {results}")
        return kept
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(f"added {len(lines)} lines of window {key[0][:12]} {key[1]} ({lines[0]['gpu']}) to {results}")
    return kept + lines


def target_text(row: dict) -> str:
    """``PASS``/``FAIL`` of a results line's target(s), with the memory-bound limits beside (or "-")."""
    parts = []
    targets = row.get("targets") or {}
    if isinstance(row.get("target"), dict):
        targets = {"target": row["target"], **targets}
    for name, t in targets.items():
        value = t["value"] if isinstance(t["value"], bool) else f"{t['value']:.2f}"
        parts.append(f"{'PASS' if t['pass'] else 'FAIL'} {name} {value} {t['op']} {t['limit']}")
    limits = row.get("limits") or {}
    bound = [
        f"{k.upper()} {v['memory_bound_limit']:.2f}x@{v['batch']}" for k, v in limits.items() if k != "ran"
    ]
    if bound:
        parts.append("memory-bound " + ", ".join(bound))
    return "; ".join(parts) or "-"


def row_label(row: dict) -> str:
    """What one results line measured, in a few words."""
    if row["window_stage"] == "kernels":
        return f"{row.get('model')} b{row.get('batch')} {row.get('cached_len')} {row.get('kept_fraction')}"
    if row["window_stage"] == "rollout":
        return f"{row.get('model')} {row.get('rows_at_once')} rows, {row.get('speedup', 0):.2f}x"
    if row["window_stage"] == "speculative":
        return f"{row.get('shape')} {row.get('arm')}, {row.get('speedup_vs_dense', 0):.2f}x"
    if row.get("benchmark") == "train_step":
        peak = row.get("measured_peak_bytes")
        shown = "-" if peak is None else f"{peak / 2**30:.1f}"
        return f"{row.get('model')} {row.get('seq_len')} tokens, peak {shown} / plan {row['plan']['total'] / 2**30:.1f} GiB"
    return f"refit {row.get('tensors')} tensors, sleep/wake"


def readme_block(lines: list[dict]) -> str:
    """The README's generated block: every window, newest first, its stages and targets."""
    windows = [r for r in lines if r.get("record") == "window"]
    if not windows:
        return ("No GPU window has run yet (`benchmarks/results/gpu_window.jsonl` is empty): every GPU number in "
                "this README is a cost-model prediction or a CPU rehearsal.")  # fmt: skip
    out = []
    for w in sorted(windows, key=lambda r: r["date"], reverse=True):
        stages = ", ".join(f"{k} {'ok' if v['rc'] == 0 else 'rc ' + str(v['rc'])} ({v['seconds']} s)"
                           for k, v in w["stages"].items())  # fmt: skip
        c = w.get("correctness") or {}
        tests = f"{c.get('tests', 0)} tests, {c.get('failures', 0)} failed, {c.get('errors', 0)} errors"
        out.append(f"- **{w['gpu']}** ({w['mode']}), driver {w['driver']}, torch {w['torch']}, Triton {w['triton']}, "
                   f"commit `{w['commit'][:12]}`, {w['date']}: {stages}; correctness: {tests}.")  # fmt: skip
        for r in lines:
            if r.get("record") == "result" and (r["commit"], r["date"]) == (w["commit"], w["date"]):
                if r["window_stage"] == "kernels" and "targets" not in r:
                    continue  # the kernel benchmark's summary line
                out.append(f"  - {r['window_stage']}: {row_label(r)}: {target_text(r)}")
    return "\n".join(out)


def update_readme(readme: Path, lines: list[dict]) -> None:
    """Replace the text between the README's markers with :func:`readme_block`."""
    text = readme.read_text()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{readme}: expected one '{START}' line before one '{END}' line")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{START}\n{readme_block(lines)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path, help="a window's $OUT (as the device tool brought it back)")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_window.jsonl")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--allow-cpu", action="store_true", help="accept a --tiny/--dry rehearsal (tests)")
    args = p.parse_args(argv)
    try:
        lines = add_window(args.folder, args.results, args.allow_cpu)
        update_readme(args.readme, lines)
    except (ValueError, OSError) as exc:
        print(f"gpu_results: {exc}", file=sys.stderr)
        return 1
    print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
