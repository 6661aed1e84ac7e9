"""What ``meshgate bench`` prints and draws: the table, the JSON document and the PNG (``gateway.cli.bench`` measures).

matplotlib is optional (the ``bench`` extra: ``pip install 'meshgate[bench]'``) and imported only to draw, with
the Agg backend, so ``--plot`` works without a display.
"""

from __future__ import annotations

import importlib.util
import json
import math
from typing import Any

__all__ = ["NO_MATPLOTLIB", "can_plot", "placement_line", "plot", "table", "to_json"]

NO_MATPLOTLIB = "--plot needs matplotlib: pip install 'meshgate[bench]' (or pip install matplotlib)"


def can_plot() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def to_json(document: dict[str, Any]) -> str:
    """The document as JSON, nan (a figure with nothing to measure) as null."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(document), indent=2)


def placement_line(where: dict[str, Any] | None) -> str:
    """``llama_cpp single on vm[0:18]; runner memory vm=550 MiB`` (or why it is not known)."""
    if where is None:
        return "placement: not shown (no instance found, or the key is not an admin key)"
    nodes = ", ".join(
        f"{n['node_id']}[{n['layer_start']}:{n['layer_end']}]"
        + (f" rank {n['tensor_rank']}/{n['tensor_size']}" if n["tensor_size"] > 1 else "")
        for n in where["nodes"]
    )
    memory = ", ".join(f"{k}={v / 2**20:.0f} MiB" for k, v in where["memory_per_node"].items())
    return (
        f"placement: {where['backend']} {where['strategy']} on {nodes} (instance {where['instance']}, "
        f"{where['state']}, context {where['context']}); runner memory {memory}"
    )


def _pm(figure: dict[str, float], scale: float = 1.0, digits: int = 1) -> str:
    mean, stdev = figure["mean"] * scale, figure["stdev"] * scale
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f} ± {stdev:.{digits}f}"


def table(document: dict[str, Any]) -> str:
    """The results as a table (columns as wide as their widest cell), under a line saying what ran where."""
    head = ["c", "prompt", "gen", "prompt tok/s", "gen tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    rows, short = [head], []
    for r in document["results"]:
        rows.append(
            [
                str(r["concurrency"]),
                str(r["prompt_tokens"]),
                str(r["gen_tokens"]),
                _pm(r["prompt_tps"]),
                _pm(r["gen_tps"]),
                _pm(r["ttft_p50"], 1000),
                _pm(r["ttft_p99"], 1000),
                _pm(r["itl_p50"], 1000, 2),
                _pm(r["itl_p99"], 1000, 2),
            ]
        )
        if r["measured_gen_tokens"] < r["gen_tokens"]:
            short.append(f"c={r['concurrency']} prompt={r['prompt_tokens']}: {r['measured_gen_tokens']:.1f}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    text = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines = [f"model: {document['model']} at {document['url']} ({document['endpoint']}, greedy)"]
    lines += [placement_line(document["placement"]), "", text[0], "-" * len(text[0]), *text[1:]]
    reps = {r["repetitions"] for r in document["results"]}
    lines.append(f"mean ± stdev over {', '.join(map(str, sorted(reps)))} repetition(s)")
    if short:
        lines.append("the model stopped early (end of sequence); mean tokens generated: " + "; ".join(short))
    return "\n".join(lines)


def plot(document: dict[str, Any], path: str) -> None:
    """A PNG: generation tok/s, prompt tok/s and TTFT p50 against concurrency, one line per prompt/gen size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gen, prompt, ttft) = plt.subplots(1, 3, figsize=(14, 4.2))
    sizes = sorted({(r["prompt_tokens"], r["gen_tokens"]) for r in document["results"]})
    for p, g in sizes:
        rows = sorted(
            (r for r in document["results"] if (r["prompt_tokens"], r["gen_tokens"]) == (p, g)),
            key=lambda r: r["concurrency"],
        )
        c = [r["concurrency"] for r in rows]
        for ax, metric, scale in ((gen, "gen_tps", 1.0), (prompt, "prompt_tps", 1.0), (ttft, "ttft_p50", 1000.0)):
            mean = [r[metric]["mean"] * scale for r in rows]
            err = [r[metric]["stdev"] * scale for r in rows]
            ax.errorbar(c, mean, yerr=err, marker="o", capsize=3, label=f"prompt {p}, gen {g}")
    gen.set(xlabel="concurrent streams", ylabel="tokens / s", title="generation (all streams together)")
    prompt.set(xlabel="concurrent streams", ylabel="tokens / s", title="prompt (per stream)")
    ttft.set(xlabel="concurrent streams", ylabel="ms", title="time to first token (p50)")
    for ax in (gen, prompt, ttft):
        ax.set_xticks(sorted({r["concurrency"] for r in document["results"]}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"meshgate bench: {document['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
