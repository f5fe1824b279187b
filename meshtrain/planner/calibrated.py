"""A named GPU's cluster with what a calibrated profile of that kind measured on one.

`meshtrain plan --gpu H100-80GB` starts from the published table (hardware.GPUS). Where a
profile of that kind exists (`meshtrain plan --calibrate` run on such a GPU saves it as
profiles/H100-80GB.json), its figures replace the table's:
- efficiency, the fraction of the peak the model's matrices reach (measured against the
  table's peak, rescaled to a --peak-flops the user gives): the time model
  spends F_gemm / (peak e_gemm) + F_attn / (peak e_attn) on a step, so its one efficiency is
      e = (F_gemm + F_attn) / (F_gemm / e_gemm + F_attn / e_attn),
  with F the model's FLOPs per token in GEMMs (every weight, the logits) and in attention
  (flops.forward_flops_per_token), e_gemm the GEMM efficiency measured at the size of the
  model's largest GEMM (one sequence through the MLP's first matrix: seq x hidden x ffn),
  e_attn attention's at one sequence's attention (all heads), each interpolated log-linearly
  in FLOPs between the measured shapes and held at the ends. One sequence is the smallest
  micro-batch; larger ones run larger GEMMs at the same or higher efficiency. Measured in
  the profile's dtype (bf16 on CUDA), so a plan in another precision keeps the table's.
  Being the GEMMs' and attention's alone, it leaves the elementwise work to the memory
  (`elementwise_apart`: flops.ELEMENTWISE_BYTES at mem_bw);
- mem_bw: the measured device copy bandwidth (the optimizer step and the elementwise work
  are bound by it);
- the host's work, which the device's hides (a micro-batch costs the slower of the two, as
  on a local GPU profile): the Trainer's step on a GPT too narrow to keep the device busy,
  per block and micro-batch (block_overhead), per layer held, per step, and under full
  recomputation (fit.fit_host); in an older profile, seconds per op launch x the ops one
  block of the reference GPT dispatches;
- the collective curves, measured over the GPUs of one node at the largest calibrated world
  (> 1), for groups inside a node.
What a profile cannot measure stays the table's: the peak (the efficiency is against it),
device memory, the node count, the inter-node link. Figures the user gives keep theirs.
"""
from __future__ import annotations

from meshtrain.planner.flops import forward_flops_per_token
from meshtrain.planner.hardware import Cluster, Curve, HardwareError
from meshtrain.planner.model_spec import ModelSpec
from meshtrain.planner.profile import host_settings, step_costs

TABLE = ("peak_flops", "gpu_mem", "inter_bw", "host_bw")   # never measured by a profile


def gemm_flops(m: int, k: int, n: int) -> float:
    """An (m, k) x (k, n) product: one multiply-add per output and k."""
    return 2.0 * m * k * n


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward and backward of attention as flops.py counts it: Q K^T and (attn) V, 4 s^2
    FLOPs per channel forward (causal masking not subtracted), backward twice forward."""
    return 3 * 4.0 * batch * seq**2 * heads * head_dim


def efficiency_at(curve: dict, flops: float) -> float:
    """The measured efficiency at a product of `flops` FLOPs: log-linear between the
    measured shapes' sizes, held at the ends (Curve's interpolation)."""
    points = sorted(zip(curve["flops_per_call"], curve["efficiency"]))
    return Curve(tuple(f for f, _ in points), tuple(e for _, e in points)).at(flops)


def model_efficiency(entry: dict, spec: ModelSpec, sequences: float = 1) -> float | None:
    """The model's efficiency from a profile entry's GEMM and attention curves (module
    docstring), at most 1; None where the entry measured no GEMMs. `sequences`: the
    micro-batch whose GEMMs and attention are priced (one sequence: the smallest)."""
    if not entry.get("gemm"):
        return None
    layer, scores, logits = forward_flops_per_token(spec, spec.seq)
    f_attn = spec.layers * scores
    f_gemm = spec.layers * (layer - scores) + logits
    e_gemm = efficiency_at(entry["gemm"], sequences * gemm_flops(spec.seq, spec.hidden,
                                                                 spec.ffn_hidden))
    attention = entry.get("attention")
    if not attention:
        return min(1.0, e_gemm)
    e_attn = efficiency_at(attention, sequences * attention_flops(1, spec.heads, spec.seq,
                                                                  spec.hidden // spec.heads))
    return min(1.0, (f_gemm + f_attn) / (f_gemm / e_gemm + f_attn / e_attn))


def calibrated_cluster(cluster: Cluster, profile: dict, spec: ModelSpec, precision: str,
                       source: str, given: tuple[str, ...] = ()) -> Cluster:
    """`cluster` (a GPUS preset) with the figures `profile` measured on a GPU of its kind
    (module docstring); `given`: the Cluster fields the user set, kept. `source` names
    the profile's file in the output."""
    device = profile.get("device", {})
    if device.get("kind") != cluster.name:
        measured = (f"was measured on {device['kind']!r}" if device.get("kind") else
                    "names no device kind (calibrated before kinds were kept)")
        raise HardwareError(f"the profile {source} {measured}, not {cluster.name!r}: run "
                            f"`meshtrain plan --calibrate` on a {cluster.name} or pass its profile")
    worlds = {int(w): e for w, e in profile["worlds"].items()}
    entry = worlds[max(worlds)]
    changes = {"mem_bw": entry["mem_bw"]}
    efficiency = model_efficiency(entry, spec) if precision == device.get("dtype") else None
    if efficiency and "efficiency" not in given:   # against the cluster's peak (--peak-flops)
        peak = entry.get("peak_flops", cluster.peak_flops)
        changes["efficiency"] = min(1.0, efficiency * peak / cluster.peak_flops)
        changes["elementwise_apart"] = True   # measured on GEMMs and attention alone
    host = host_settings(entry)
    if host:   # the host's work, which a GPU runs beside its own: the slower of the two counts
        changes.update(host, async_dispatch=True)
    else:   # a profile from before launches were timed: the reference step's fixed cost
        changes["block_overhead"] = step_costs(entry)[1]
    multi = [w for w, e in worlds.items() if w > 1 and e.get("collectives")]
    if multi and "intra_bw" not in given:
        changes["curves"] = {kind: Curve(tuple(c["sizes"]), tuple(c["busbw"]))
                             for kind, c in worlds[max(multi)]["collectives"].items()}
        changes["curves_intra_only"] = True
    measured = [k for k in ("efficiency", "mem_bw", "block_overhead") if k in changes]
    if "curves" in changes:
        measured.append(f"collectives at {max(multi)} ranks")
    table = [k for k in TABLE + ("efficiency", "intra_bw") if k not in changes
             and k not in given and not (k == "intra_bw" and "curves" in changes)]
    calibration = {"kind": cluster.name, "created": profile.get("created"), "profile": source,
                   "dtype": device.get("dtype"), "calibrated": measured, "table": table,
                   "given": list(given)}
    return cluster.with_(**changes, calibration=calibration)
