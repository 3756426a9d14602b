"""Render the Markdown report and its TSV tables from run records and pair comparisons."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import math

import numpy as np
import pandas as pd
from tabulate import tabulate

from qdiff import forcing, plots
from qdiff import localise as localise_lib
from qdiff.compare import label
from qdiff.diagnosis import diagnose
from qdiff.io import load_array, write_text

METRICS_NOTE = """\
Every pair compares two combinations of the same model on the same prompts. Logit metrics are
over the full vocabulary at the first generated position (the prompt's last token), with the
left combination as reference: **max |Δ|** (largest over prompts), **mean |Δ|**, **RMS**,
**NMSE** = Σ(b−a)²/Σa² as in llama.cpp's test-backend-ops (mean over prompts),
**KL** = KL(softmax a ‖ softmax b) as in llama-perplexity (mean and max over prompts),
**top-1** = prompts whose first greedy token agrees, **forked** = prompts whose greedy texts
differ, **first fork** = earliest generated step (0-based) where two texts differ."""


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if value == 0:
        return "0"
    if 100 <= abs(value) < 1e6:
        return f"{value:.0f}"
    return f"{value:.{digits}g}" if 1e-3 <= abs(value) < 100 else f"{value:.2e}"


def _cell(text: str) -> str:
    """Text safe inside a GitHub table cell, with newlines kept visible."""
    return text.replace("|", "\\|").replace("\r", "").replace("\n", "⏎")


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_none_"
    return tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True)


def _weights_in(record: dict[str, Any]) -> str:
    buffers = record.get("provenance", {}).get("placement", {}).get("model_buffers", {})
    return ", ".join(f"{k} {_num(v)} MiB" for k, v in buffers.items()) or "–"


def _reason(record: dict[str, Any]) -> str:
    error = record.get("error", {})
    return _cell(error.get("message", ""))


def _repeats(record: dict[str, Any]) -> str:
    det = record.get("determinism")
    if det is None:
        return "–"
    if det["bit_identical_logits"] and det["identical_tokens"]:
        return f"{det['repeats']}× bit-identical"
    return (
        f"{det['repeats']}× NOT identical: max |Δ| {_num(det['max_abs_between_repeats'])}"
        + ("" if det["identical_tokens"] else ", text differs")
    )


def _runs_table(records: list[dict[str, Any]]) -> str:
    rows = []
    repeated = any("determinism" in r for r in records)
    for r in records:
        timings = r.get("timings", {})
        context = r.get("provenance", {}).get("llama_context", {})
        rows.append(
            {
                "combination": f"`{label(r)}`",
                "status": r["status"],
                "backend": r["settings"]["backend"],
                "weights in": _weights_in(r),
                "flash attn (llama.cpp)": context.get("flash_attn", "–"),
                "n_ubatch": context.get("n_ubatch", "–"),
                "load s": _num(timings.get("load_s")),
                "prompt ms": _num(timings.get("prompt_ms_mean")),
                "decode ms/token": _num(timings.get("decode_ms_per_token")),
                **({"repeated runs": _repeats(r)} if repeated else {}),
            }
        )
    return _table(rows)


def _pair_sort_key(pair: dict[str, Any]) -> tuple[int, float]:
    if pair["status"] != "ok":
        return (1, 0.0)
    return (0, -pair["summary"]["max_abs"])


def _pairs_table(pairs: list[dict[str, Any]]) -> str:
    rows = []
    for p in sorted(pairs, key=_pair_sort_key):
        s = p.get("summary")
        if s is None:
            rows.append({"a": f"`{p['a']}`", "b": f"`{p['b']}`", "what differs": "; ".join(p["differs"]),
                         "max \\|Δ\\|": f"n/a: {p['reason']}"})
            continue
        n = s["n_prompts"]
        rows.append(
            {
                "a": f"`{p['a']}`",
                "b": f"`{p['b']}`",
                "what differs": "; ".join(p["differs"]) or "nothing",
                "max \\|Δ\\|": _num(s["max_abs"]),
                "mean \\|Δ\\|": _num(s["mean_abs"]),
                "RMS": _num(s["rms"]),
                "NMSE": _num(s["nmse"]),
                "KL mean": _num(s["kl_mean"]),
                "KL max": _num(s["kl_max"]),
                "top-1": f"{s['top1_agree']}/{n}",
                "bit-identical": f"{s['bit_identical']}/{n}",
                "forked": f"{s['forked']}/{n}",
                "first fork": "none" if s["first_fork_step"] is None else str(s["first_fork_step"]),
            }
        )
    return _table(rows)


def _texts(records: list[dict[str, Any]], prompts: dict[str, str]) -> str:
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return "_no combination of this model ran_"
    reference = ok[0]
    parts = []
    for pid, text in prompts.items():
        rows = []
        ref = next((p for p in reference["prompts"] if p["id"] == pid), None)
        for r in ok:
            run = next((p for p in r["prompts"] if p["id"] == pid), None)
            if run is None:
                continue
            same = ref is not None and run["tokens"] == ref["tokens"]
            rows.append(
                {
                    "combination": f"`{label(r)}`",
                    f"vs `{label(reference)}`": "same" if same else "differs",
                    "generated text": _cell(run["text"]),
                }
            )
        parts.append(f"**`{pid}`**: {_cell(text)}\n\n{_table(rows)}")
    return "\n\n".join(parts)


def _provenance(records: list[dict[str, Any]]) -> str:
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return "_no combination ran_"
    first = ok[0]["provenance"]
    common = {
        "qdiff": first["qdiff"],
        "llama-cpp-python": first["llama_cpp_python"],
        "Python": first["python"],
        "NumPy": first["numpy"],
        "OS": first["os"],
        "CPU": first["cpu_model"],
        "llama.cpp system info": f"`{first['system_info']}`",
    }
    lines = [f"- **{k}**: {v}" for k, v in common.items()]
    rows = []
    for r in ok:
        prov = r["provenance"]
        used = ", ".join(f"{d['name']} ({d['description']})" for d in prov["used_devices"])
        gpu = prov.get("nvidia_smi") or {}
        rows.append(
            {
                "model": f"`{r['model']}`",
                "combination": f"`{label(r)}`",
                "device used": used + (f", driver {gpu['driver']}, CUDA {gpu['cuda']}" if gpu else ""),
                "model file sha256": prov["model_file"]["sha256"][:16] + "…",
                "weight types": ", ".join(f"{k}×{v}" for k, v in prov["model_file"]["weight_types"].items()),
                "settings": ", ".join(
                    f"{k}={v}" for k, v in r["settings"].items() if k not in ("backend", "env") and v != {}
                ),
                "env": ", ".join(f"{k}={v}" for k, v in r["settings"].get("env", {}).items()) or "–",
            }
        )
    return "\n".join(lines) + "\n\n" + _table(rows)


def _diagnosis(records: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> str:
    findings = diagnose(records, pairs)
    if not findings:
        return "_Nothing to diagnose: fewer than two devices ran this model._"
    legend = (
        "Each line applies one rule of `src/qdiff/diagnosis.py` to the measured pairs and "
        "shows the numbers it rests on.\n\n"
    )
    return legend + "\n".join(f"- **{f.rule}**: {f.text}" for f in findings)


def _round_up(x: float) -> float:
    """x rounded up to two significant digits."""
    if x <= 0:
        return 0.0
    step = 10 ** (math.floor(math.log10(x)) - 1)
    return round(math.ceil(x / step) * step, 12)


def _tolerances(model: str, records: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> str:
    """Largest cross-device difference per dequant mode, and a test tolerance."""
    device = {label(r): r["device"] for r in records}
    rows, snippet = [], ""
    for dq in dict.fromkeys(r["dequant"] for r in records):
        cross = [
            p for p in pairs
            if p["status"] == "ok" and p["a"].endswith(f".{dq}") and p["b"].endswith(f".{dq}")
            and device.get(p["a"]) != device.get(p["b"])
        ]
        if not cross:
            continue
        worst = max(cross, key=lambda p: p["summary"]["max_abs"])
        largest = worst["summary"]["max_abs"]
        top1 = all(p["summary"]["top1_agree"] == p["summary"]["n_prompts"] for p in cross)
        forked = sum(p["summary"]["forked"] for p in cross)
        total = sum(p["summary"]["n_prompts"] for p in cross)
        atol = _round_up(1.5 * largest)
        rows.append({
            "file": dq,
            "largest max \\|Δ\\| between devices": f"{_num(largest)} (`{worst['a']}` vs `{worst['b']}`)",
            "largest NMSE": _num(max(p["summary"]["nmse"] for p in cross)),
            "top-1 always agrees": "yes" if top1 else "no",
            "texts forked": f"{forked}/{total}",
            "recommended atol": _num(atol),
        })
        if dq == "none":
            snippet = (
                f"```python\n# {model}: first-step logits on two devices. Largest difference seen here:\n"
                f"# {_num(largest)} ({worst['a']} vs {worst['b']}); 1.5x that, rounded up:\n"
                f"np.testing.assert_allclose(logits_device, logits_reference, rtol=0, atol={atol:g})\n"
                + ("assert logits_device.argmax() == logits_reference.argmax()  "
                   f"# held in all {total} comparisons\n" if top1 else "")
                + f"# greedy text forked in {forked} of {total} comparisons: compare logits, not text\n```"
            )
    if not rows:
        return "_Only one device ran this model: no cross-device tolerance to recommend._"
    return _table(rows) + ("\n\n" + snippet if snippet else "")


def _oriented(pair: dict[str, Any], reference: str) -> list[tuple[float, float, bool]]:
    """(KL(ref‖x), Δp of ref's top token, same top token) per prompt, reference first."""
    if pair["a"] == reference:
        return [(q["kl"], q["dp_top"], q["top1_agree"]) for q in pair["prompts"]]
    return [(q["kl_ba"], q["dp_top_ba"], q["top1_agree"]) for q in pair["prompts"]]


def _reference_distance(pairs: list[dict[str, Any]], reference: str | None) -> str:
    if reference is None:
        return "_No reference configured (`reference:` in the config)._"
    rows = []
    for p in pairs:
        if p["status"] != "ok" or reference not in (p["a"], p["b"]):
            continue
        other = p["b"] if p["a"] == reference else p["a"]
        values = _oriented(p, reference)
        kl = np.array([v[0] for v in values])
        rows.append({
            "combination": f"`{other}`",
            "KL mean": _num(float(kl.mean())),
            "KL median": _num(float(np.median(kl))),
            "KL p99": _num(float(np.percentile(kl, 99))),
            "KL max": _num(float(kl.max())),
            "same top token": f"{sum(v[2] for v in values)}/{len(values)}",
            "RMS Δp": _num(float(np.sqrt(np.mean([v[1] ** 2 for v in values])))),
            "max \\|Δ\\|": _num(p["summary"]["max_abs"]),
        })
    if not rows:
        return f"_The reference `{reference}` did not run for this model._"
    rows.sort(key=lambda r: -float(r["KL mean"]) if r["KL mean"] not in ("0", "–") else 0)
    return (
        f"KL(`{reference}` ‖ combination) over prompts, as llama-perplexity reports it; Δp is "
        "for the reference's top token.\n\n" + _table(rows)
    )


def _plots(model: str, records: list[dict[str, Any]], pairs: list[dict[str, Any]],
           logits: dict[str, Path], plot_dir: Path) -> str:
    ok = [label(r) for r in records if r["status"] == "ok"]
    good = [p for p in pairs if p["status"] == "ok"]
    if len(ok) < 2 or not good:
        return "_Not enough runs to plot._"
    index = {lab: i for i, lab in enumerate(ok)}
    values = np.zeros((len(ok), len(ok)))
    for p in good:
        i, j = index[p["a"]], index[p["b"]]
        values[i, j] = values[j, i] = p["summary"]["max_abs"]
    heat = plot_dir / f"{model}.heatmap.png"
    plots.heatmap(ok, values, heat, f"{model}: pairwise max |Δ|")
    worst = max(good, key=lambda p: p["summary"]["max_abs"])
    k = max(range(len(worst["prompts"])), key=lambda i: worst["prompts"][i]["max_abs"])
    hist = plot_dir / f"{model}.largest-pair.png"
    a = load_array(logits[f"{model}/{worst['a']}"])[k]
    b = load_array(logits[f"{model}/{worst['b']}"])[k]
    plots.delta_histogram(a, b, hist, f"{worst['a']} vs {worst['b']}, prompt {worst['prompts'][k]['prompt']}")
    rel = plot_dir.name
    return (
        f"![pairwise max |Δ|]({rel}/{heat.name})\n\n"
        f"Per-token |Δ| over the vocabulary for the largest pair, `{worst['a']}` vs "
        f"`{worst['b']}`, on prompt `{worst['prompts'][k]['prompt']}`:\n\n![per-token |Δ|]({rel}/{hist.name})"
    )


def _piece(pieces: dict[str, str], token: int) -> str:
    return f"`{_cell(repr(pieces.get(str(token), '?')))}`"


def _forced(model: str, forced: list[dict[str, Any]], pairs: list[dict[str, Any]],
            plot_dir: Path | None) -> str:
    """The teacher-forced comparison of one model (qdiff.forcing)."""
    ok = [r for r in forced if r["status"] == "ok"]
    good = [p for p in pairs if p.get("forced", {}).get("status") == "ok"]
    if not ok or not good:
        reasons = sorted({r.get("error", {}).get("message", "") for r in forced if r["status"] != "ok"})
        return "_No teacher-forced comparison" + (f": {'; '.join(reasons)}" if reasons else "") + "._"
    teacher = ok[0]["teacher"]
    own = next((r for r in ok if label(r) == teacher), None)
    k = ok[0]["top_k"]
    checks = [
        f"{label(r)} {r['first_step_identical_to_free_run']}/{len(r['prompt_ids'])}"
        for r in ok if r["first_step_identical_to_free_run"] != len(r["prompt_ids"])
    ]
    lines = [
        f"Every combination was fed the greedy output of `{teacher}` token by token "
        f"({ok[0]['n_positions']} positions over {len(ok[0]['prompt_ids'])} prompts), so the "
        "logits compare at every generated position, not only the first. Per position qdiff "
        f"keeps the logits of the teacher's {k} most likely tokens (**max \\|Δ\\|** is over "
        "those), each side's exact top-2, and the full log-sum-exp (**KL** is KL(a‖b) over those "
        "tokens plus one bucket for the rest, a lower bound of the full KL). A **fork** is a "
        "position whose top-1 tokens differ; its **margin** is the larger of the two sides' "
        "lead of their own token over the other's. A fork is a **near tie** when the margin is "
        f"at most {forcing.TIE_FACTOR:g}× the pair's median max \\|Δ\\| at the positions where "
        "the two are not bit-identical (a difference the pair typically shows can flip it), "
        "else a **red flag**.",
        "",
        "Self-checks: " + (
            f"the teacher forced along its own output chose that output at "
            f"{own['agrees_with_teacher_tokens']}/{own['n_positions']} positions; "
            if own else "") + (
            "every forced first position was bit-identical to the combination's free run."
            if not checks else "forced first positions that differ from the free run: "
            + ", ".join(checks) + " (the forced pass did not reproduce the free run)."),
        "",
    ]
    rows = []
    for p in sorted(good, key=lambda p: -p["forced"]["max_abs"]):
        f = p["forced"]
        n = f["n_positions"]
        rows.append({
            "a": f"`{p['a']}`",
            "b": f"`{p['b']}`",
            "bit-identical": f"{f['bit_identical']}/{n}",
            "top-1 agree": f"{f['top1_agree']}/{n} ({f['top1_agree'] / n:.1%})" if n else "–",
            "max \\|Δ\\| median": _num(f["max_abs_median"]),
            "p90": _num(f["max_abs_p90"]),
            "max": _num(f["max_abs"]),
            "KL mean": _num(f["kl_mean"]),
            "KL p99": _num(f["kl_p99"]),
            "forks": str(len(f["forks"])),
            "near ties": str(f["near_ties"]),
            "red flags": str(f["red_flags"]),
        })
    lines.append(_table(rows))
    pieces = {label(r): r.get("pieces", {}) for r in ok}
    flagged = sorted(
        ((p, fork) for p in good for fork in p["forced"]["forks"] if fork["kind"] == "red flag"),
        key=lambda x: -x[1]["margin"],
    )
    if flagged:
        lines += ["", f"Red-flag forks, largest margin first ({len(flagged)} in all, 10 shown):", ""]
        lines.append(_table([{
            "a": f"`{p['a']}`", "b": f"`{p['b']}`", "prompt": f"`{fork['prompt']}`",
            "position": str(fork["position"]),
            "a chose": _piece(pieces[p["a"]], fork["token_a"]),
            "b chose": _piece(pieces[p["b"]], fork["token_b"]),
            "margin": ("" if fork["margin_exact"] else "≥ ") + _num(fork["margin"]),
            "near-tie threshold": _num(p["forced"]["tie_threshold"]),
        } for p, fork in flagged[:10]]))
    if plot_dir is not None:
        top = sorted(good, key=lambda p: -p["forced"]["max_abs_median"])[:6]
        curves = {
            f"{p['a']} vs {p['b']}": (
                [q["position"] for q in p["forced"]["per_position"]],
                [q["max_abs_median"] for q in p["forced"]["per_position"]],
            )
            for p in top
        }
        path = plot_dir / f"{model}.forced-positions.png"
        plots.forced_curves(curves, path, f"{model}: difference along the teacher's text")
        lines += ["", f"Median max \\|Δ\\| by position for the {len(top)} most different pairs:",
                  "", f"![max |Δ| by position]({plot_dir.name}/{path.name})"]
    return "\n".join(lines)


def _tensor_where(r: dict[str, Any] | None) -> str:
    if r is None:
        return "none"
    where = f"layer {r['layer']}" if r["layer"] is not None else "outside the layers"
    text = f"`{r['name']}` (tensor #{r['index']}, {r['op']}: {r['family']}, {where})"
    if r["only_a_before"] or r["only_b_before"]:
        text += (
            ", right after ops the two graphs compute differently (a only: "
            + (", ".join(r["only_a_before"]) or "none") + "; b only: "
            + (", ".join(r["only_b_before"]) or "none") + ")"
        )
    return text


def _localised(model: str, localised: dict[str, Any] | None, plot_dir: Path | None) -> str:
    """Where the model's largest pair (and configured pairs) part, op by op (qdiff.localise)."""
    if localised is None:
        return "_Tensor capture is off (`capture.enabled`)._"
    out = [
        "Each combination's forward pass over the prompt was captured op by op through "
        "llama.cpp's eval callback (last token position of every named tensor). **First "
        "difference**: the first tensor that is not bit-identical. **First divergence**: the "
        f"first whose NMSE exceeds {localised['floor_factor']:g}× the NMSE of the floor pair at "
        "the same tensor; the floor pair is the same two devices on the f32 copy, which "
        "differ only in float rounding. Without a floor pair the first difference is shown."
    ]
    for entry in localised["pairs"]:
        head = f"**`{entry['a']}` vs `{entry['b']}`** ({entry['why']})"
        if entry["status"] != "ok":
            out += ["", f"{head}: not localised: {_cell(entry['reason'])}."]
            continue
        floor = entry["floor"]
        for q in entry["prompts"]:
            d, first = q["first_divergence"], q["first_difference"]
            lines = [f"{head}, prompt `{q['prompt']}`, {q['n_tensors']} tensors compared, floor: "
                     + (f"`{floor[0]}` vs `{floor[1]}`." if floor else "none (first difference shown).")]
            if first is None:
                lines.append("Every captured tensor is bit-identical: the pair does not part here.")
            elif d is None:
                lines.append(f"First difference at {_tensor_where(first)}, but no tensor rises "
                             f"above {localised['floor_factor']:g}× the floor: float rounding alone.")
            else:
                ratio = (f", {d['nmse'] / d['floor_nmse']:.3g}× the floor's {_num(d['floor_nmse'])}"
                         if d.get("floor_nmse") else
                         ", where the floor pair is bit-identical" if floor else "")
                lines.append(
                    f"First divergence at {_tensor_where(d)}: NMSE {_num(d['nmse'])}{ratio}, "
                    f"max \\|Δ\\| {_num(d['max_abs'])}, relative error {_num(d['rel_err'])}."
                    + ("" if first["index"] == d["index"] else
                       f" First difference at all: {_tensor_where(first)}.")
                )
            changed = q["capture_changed_logits"]
            lines.append(
                "Capturing left both combinations' logits bit-identical." if not changed else
                f"**Capturing changed the logits of {', '.join(changed)}**: observing the "
                "graph split it differently on that backend, so this localisation describes the "
                "observed computation, not exactly the uncaptured one."
            )
            out += ["", " ".join(lines)]
            mark = d or first
            if mark is not None:
                out += ["", _table([{
                    "#": str(r["index"]), "tensor": f"`{r['name']}`", "op": r["family"],
                    "max \\|Δ\\|": _num(r["max_abs"]), "NMSE": _num(r["nmse"]),
                    "floor NMSE": _num(r.get("floor_nmse")),
                } for r in localise_lib.around(q["rows"], mark["index"])])]
            if plot_dir is not None and q["rows"]:
                name = f"{model}.depth.{entry['a']}__{entry['b']}.{q['prompt']}.png"
                plots.depth_profile(q["rows"], f"{floor[0]} vs {floor[1]}" if floor else None,
                                    d["index"] if d else None, plot_dir / name,
                                    f"{entry['a']} vs {entry['b']}, prompt {q['prompt']}")
                out += ["", f"![difference by depth]({plot_dir.name}/{name})"]
    return "\n".join(out)


def _left_out(records: list[dict[str, Any]]) -> str:
    rows = [
        {
            "model": f"`{r['model']}`",
            "combination": f"`{label(r)}`",
            "status": r["status"],
            "reason": _reason(r),
        }
        for r in records
        if r["status"] != "ok"
    ]
    if not rows:
        return "Every combination ran."
    return (
        "`unavailable`: this llama-cpp-python build or machine lacks the device's backend, "
        "so the device was left out (never run on another backend). `failed`: the run "
        "crashed or errored; its log is under `results/logs/run/`, and the next `snakemake` "
        "retries it.\n\n" + _table(rows)
    )


def render(
    records: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    reference: str | None = None,
    logits: dict[str, Path] | None = None,
    plot_dir: Path | None = None,
    forced: list[dict[str, Any]] | None = None,
    localised: list[dict[str, Any]] | None = None,
) -> str:
    forced = forced or []
    localised_by_model = {x["model"]: x for x in localised} if localised is not None else None
    models = list(dict.fromkeys(r["model"] for r in records))
    devices = list(dict.fromkeys(r["device"] for r in records))
    dequants = list(dict.fromkeys(r["dequant"] for r in records))
    status = Counter(r["status"] for r in records)
    ok_records = [r for r in records if r["status"] == "ok"]
    n_prompts = len(ok_records[0]["prompts"]) if ok_records else 0
    out = [
        "# qdiff report: why the same GGUF gives different text on different devices",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by the qdiff workflow. "
        f"{len(models)} model(s) × {len(devices)} device(s) × {len(dequants)} dequant mode(s), "
        f"{n_prompts} prompt(s) each: {status['ok']} combination(s) ran, "
        f"{status['failed']} failed, {status['unavailable']} left out.",
        "",
        METRICS_NOTE,
        "",
        "## Left out and failed",
        "",
        _left_out(records),
    ]
    for model in models:
        model_records = [r for r in records if r["model"] == model]
        model_pairs = [p for p in pairs if p["model"] == model]
        ok = [r for r in model_records if r["status"] == "ok"]
        file_info = (ok or model_records)[0]["provenance"]["model_file"]
        file_type = ok[0]["provenance"]["model_file"].get("file_type") if ok else None
        model_prompts = {p["id"]: p.get("prompt_text", p["id"]) for p in (ok[0]["prompts"] if ok else [])}
        out += [
            "",
            f"## Model `{model}`",
            "",
            f"File `{file_info['file']}` ({file_type or 'type unknown'}), from {file_info['origin']}, "
            f"sha256 `{file_info['sha256']}`.",
            "",
            "### Runs",
            "",
            _runs_table(model_records),
            "",
            "### Diagnosis",
            "",
            _diagnosis(model_records, model_pairs),
            "",
            "### Pairwise differences, largest first",
            "",
            _pairs_table(model_pairs),
            "",
            "### Teacher-forced comparison",
            "",
            _forced(model, [r for r in forced if r["model"] == model], model_pairs, plot_dir),
            "",
            "### Where the largest pair parts: op by op",
            "",
            _localised(
                model,
                localised_by_model.get(model) if localised_by_model is not None else None,
                plot_dir,
            ),
            "",
            "### Distance from the reference",
            "",
            _reference_distance(model_pairs, reference),
            "",
            "### Tolerances for cross-device tests",
            "",
            _tolerances(model, model_records, model_pairs),
            "",
            "### Plots",
            "",
            _plots(model, model_records, model_pairs, logits, plot_dir)
            if logits is not None and plot_dir is not None else "_not rendered_",
            "",
            "### Generated text",
            "",
            _texts(model_records, model_prompts),
        ]
    out += ["", "## Provenance", "", _provenance(records), ""]
    return "\n".join(out)


def pairs_frame(pairs: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for p in pairs:
        base = {"model": p["model"], "a": p["a"], "b": p["b"], "differs": "; ".join(p["differs"]),
                "status": p["status"]}
        if p["status"] != "ok":
            rows.append({**base, "reason": p["reason"]})
        for q in p["prompts"]:
            rows.append({**base, **q})
    return pd.DataFrame(rows)


def runs_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in records:
        base = {"model": r["model"], "device": r["device"], "dequant": r["dequant"],
                "status": r["status"], "backend": r["settings"]["backend"],
                "load_s": r.get("timings", {}).get("load_s")}
        if r["status"] != "ok":
            rows.append({**base, "error": r.get("error", {}).get("message")})
        for p in r["prompts"]:
            rows.append({**base, "prompt": p["id"], "n_prompt_tokens": p["n_prompt_tokens"],
                         "prompt_ms": p["prompt_ms"], "decode_ms_per_token": p["decode_ms_per_token"],
                         "tokens": " ".join(map(str, p["tokens"])), "text": p["text"]})
    return pd.DataFrame(rows)


def write_report(
    records: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    summary_path: Path,
    pairs_tsv: Path,
    runs_tsv: Path,
    reference: str | None = None,
    logits: dict[str, Path] | None = None,
    forced: list[dict[str, Any]] | None = None,
    localised: list[dict[str, Any]] | None = None,
) -> None:
    write_text(pairs_tsv, pairs_frame(pairs).to_csv(sep="\t", index=False))
    write_text(runs_tsv, runs_frame(records).to_csv(sep="\t", index=False))
    plot_dir = summary_path.parent / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)  # a declared output, even with nothing to plot
    write_text(summary_path, render(records, pairs, reference, logits, plot_dir, forced, localised))
