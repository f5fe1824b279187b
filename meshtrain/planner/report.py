"""The advisor's result for people (a table and the guide in words) and for programs (JSON)."""
from __future__ import annotations

import json

from meshtrain.planner import data_parallel_family
from meshtrain.planner.advisor import Advice
from meshtrain.planner.guide import verdict
from meshtrain.planner.memory import role_memories
from meshtrain.planner.slowlink import slow_link_note
from meshtrain.core.units import fmt_rate


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def table(advice: Advice, top: int = 10) -> str:
    head = ("#", "plan", "params", "grads", "optim", "acts", "other", "total GB", "host GB",
            "step s", "tokens/s", "MFU")
    rows = [head]
    for i, ev in enumerate(advice.ranked[:top], 1):
        m = ev.mem
        rows.append((str(i), ev.cand.label(), _gb(m.params), _gb(m.grads), _gb(m.optim),
                     _gb(m.activations), _gb(m.buffers), _gb(m.total), _gb(m.host),
                     f"{ev.time.total:.4g}", f"{ev.tokens_per_s:,.0f}", f"{ev.mfu:.1%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _peaks(cl, precision: str) -> str:
    """The peak the MFU column is against, and under fp8 the float8 one the linears run at."""
    if precision != "fp8":
        return f"{fmt_rate(cl.peak_flops, 'FLOP/s')} peak"
    linears = (f"block linears at the float8 {fmt_rate(cl.fp8_flops, 'FLOP/s')}"
               if cl.fp8_flops else "no float8 peak known: the linears priced at bf16's")
    return f"{fmt_rate(cl.peak_flops, 'FLOP/s')} bf16 peak (MFU's basis), {linears}"


def _slower_variants(advice: Advice) -> str:
    """The plans that fit but are not ranked: a slower offload or recomputation variant of
    a plan whose faster variant is (advisor.advise keeps one per group)."""
    slower = advice.considered - len(advice.ranked) - len(advice.rejected)
    return (f", {slower} fit as a slower offload or recomputation variant of a ranked plan"
            if slower else "")


def words(advice: Advice) -> str:
    spec, setup, cl = advice.spec, advice.setup, advice.cluster
    v = verdict(advice)
    out = [f"Model: {spec.describe()}.",
           f"Cluster: {cl.nodes} x {cl.gpus_per_node} {cl.name} ({cl.gpu_mem / 1e9:.3g} GB, "
           f"{cl.usable_mem / 1e9:.3g} GB usable; {_peaks(cl, setup.precision)}, "
           f"{cl.efficiency:.0%} achievable; intra {fmt_rate(cl.intra_bw, 'B/s')}, inter "
           f"{fmt_rate(cl.inter_bw, 'B/s')}).",
           *_calibration_line(cl),
           f"Training: global batch {setup.global_batch} x {spec.seq} tokens, {setup.precision},"
           f" {setup.optimizer} (K = {setup.optim_bytes} bytes/parameter).",
           f"Considered {advice.considered} plans: {len(advice.ranked)} fit and are ranked, "
           f"{len(advice.rejected)} predicted not to fit{_slower_variants(advice)}.", "",
           "The guide's questions:"]
    for q in v.questions:
        out.append(f"  - {q.question} {'yes' if q.answer else 'no'}: {q.numbers}.")
    out += ["", f"The guide recommends {v.family}. "
            + ("It agrees with the numbers: " if v.agrees else "The numbers differ: ")
            + v.explanation + "."]
    if advice.ranked:
        t = advice.ranked[0].time
        out.append(f"Fastest plan's step: compute {t.compute:.3g} s, bubble {t.bubble:.3g} s, "
                   f"tensor-parallel {t.tp_comm:.3g} s, pipeline p2p {t.pp_comm:.3g} s, data-"
                   f"parallel {t.dp_comm:.3g} s of which {t.dp_exposed:.3g} s exposed, offload "
                   f"{t.offload:.3g} s"
                   + (f", context-parallel exchange {t.cp_comm:.3g} s exposed" if t.cp_comm else "")
                   + (f", expert all-to-alls {t.ep_comm:.3g} s" if t.ep_comm else "") + ".")
        note = slow_link_note(advice)
        if note:
            out.append(f"Slow link: {note}.")
        roles = _roles(advice, advice.ranked[0])
        if len(roles) > 1:   # ranks that differ: each one's own memory, never one number
            out.append("Its memory per rank: " + ", ".join(
                f"{role} {_gb(m.total)} GB" for role, m in roles.items()) + ".")
    if cl.world > 1:
        out += ["", data_parallel_family.words(spec, setup, cl)]
    return "\n".join(out)


def _calibration_line(cl) -> list[str]:
    """Which of the cluster's figures a calibrated profile gave, and which the table."""
    c = cl.calibration
    if not c:
        return []
    given = f"; given: {', '.join(c['given'])}" if c["given"] else ""
    return [f"Calibrated on {c['kind']} ({c['profile']}, {c['created']}, {c['dtype']}): "
            f"{', '.join(c['calibrated'])}; from the table: {', '.join(c['table'])}{given}."]


def _roles(advice: Advice, ev) -> dict:
    return role_memories(advice.spec, ev.cand, advice.setup,
                         **advice.cluster.memory_terms(ev.cand.plan))


def to_json(advice: Advice, top: int = 10) -> str:
    v = verdict(advice)
    data = {
        "model": {"name": advice.spec.name, "params": advice.spec.num_params,
                  "largest_layer_params": advice.spec.largest_layer_params,
                  "layers": advice.spec.layers, "hidden": advice.spec.hidden,
                  "heads": advice.spec.heads, "vocab": advice.spec.vocab, "seq": advice.spec.seq},
        "cluster": {k: getattr(advice.cluster, k) for k in (
            "name", "nodes", "gpus_per_node", "gpu_mem", "intra_bw", "inter_bw", "peak_flops",
            "fp8_flops", "efficiency", "reserve", "mem_bw", "block_overhead", "calibration")},
        "mfu_peak": "bf16" if advice.setup.precision == "fp8" else advice.setup.precision,
        "setup": {k: getattr(advice.setup, k) for k in (
            "global_batch", "micro_batch", "precision", "optimizer", "recompute",
            "sequence_parallel", "expert_imbalance")},
        "considered": advice.considered, "fitting": len(advice.ranked),
        "rejected": len(advice.rejected),
        "guide": v.to_dict(),
        "slow_link": slow_link_note(advice),
        "plans": [{**ev.to_dict(), "memory_per_role": {
            role: m.to_dict() for role, m in _roles(advice, ev).items()}}
            for ev in advice.ranked[:top]],
        "data_parallel_family": [r.to_dict() for r in data_parallel_family.family(
            advice.spec, advice.setup, advice.cluster)] if advice.cluster.world > 1 else [],
    }
    return json.dumps(data, indent=2)
