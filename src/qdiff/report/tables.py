"""The machine-readable tables: one row per pair x prompt, and per run x prompt."""

from __future__ import annotations

from typing import Any

import pandas as pd

from qdiff.core.records import JOB_USAGE


def pairs_frame(pairs: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for p in pairs:
        base = {
            "model": p["model"],
            "a": p["a"],
            "b": p["b"],
            "differs": "; ".join(p["differs"]),
            "relation": p.get("relation"),
            "status": p["status"],
        }
        if p["status"] != "ok":
            rows.append({**base, "reason": p["reason"]})
        for q in p["prompts"]:
            rows.append({**base, **q})
    return pd.DataFrame(rows)


def runs_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in records:
        timings = r.get("timings", {})
        base = {
            "model": r["model"],
            "device": r["device"],
            "dequant": r["dequant"],
            "status": r["status"],
            "backend": r["settings"]["backend"],
            "load_s": timings.get("load_s"),
            # the job's own measure of itself (qdiff.engine.stage.job_usage); empty in older records
            **{k: timings.get(k) for k in JOB_USAGE},
        }
        if r["status"] != "ok":
            rows.append({**base, "error": r.get("error", {}).get("message")})
        for p in r["prompts"]:
            rows.append(
                {
                    **base,
                    "prompt": p["id"],
                    "n_prompt_tokens": p["n_prompt_tokens"],
                    "prompt_ms": p["prompt_ms"],
                    "decode_ms_per_token": p["decode_ms_per_token"],
                    "tokens": " ".join(map(str, p["tokens"])),
                    "text": p["text"],
                }
            )
    return pd.DataFrame(rows)
