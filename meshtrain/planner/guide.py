"""The scalability guide's questions, answered with the planner's numbers.

The guide (the classic "efficient training on many GPUs" decision list, e.g. Hugging Face
Transformers' performance docs) says: fits on one device -> DDP (or ZeRO); does not fit ->
pipeline, ZeRO or tensor parallel; largest layer does not fit -> tensor parallel, ZeRO-3 or
offload;
one device that cannot hold it -> ZeRO with offload; many nodes with fast links -> ZeRO or
DP+PP+TP; many nodes with slow links -> DP+PP+TP with ZeRO-1; a sequence whose activations
do not fit a device even split over a node's tensor parallel -> context parallel (torchtitan,
Megatron-Core); a mixture of experts too big for one device -> expert parallel (its experts
over the data-parallel ranks, Megatron-Core's and torchtitan's MoE). Here each question gets the
number that decides it, the guide's family is matched against the top-ranked plan, and any
disagreement is explained by the time component that differs most.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from meshtrain.core.plan import Plan
from meshtrain.planner.advisor import Advice, Evaluated
from meshtrain.planner.memory import memory
from meshtrain.planner.states import largest_layer_bytes
from meshtrain.planner.setup import Candidate
from meshtrain.planner.flops import step_flops


@dataclass(frozen=True)
class Question:
    question: str
    answer: bool
    numbers: str


@dataclass(frozen=True)
class Verdict:
    questions: list
    family: str             # the guide's recommendation in words
    agrees: bool            # the top-ranked plan belongs to the guide's family
    explanation: str

    def to_dict(self) -> dict:
        return {"questions": [asdict(q) for q in self.questions], "guide_recommends": self.family,
                "agrees": self.agrees, "explanation": self.explanation}


def _gb(x: float) -> str:
    return f"{x / 1e9:,.0f} GB" if x >= 1e11 else f"{x / 1e9:.3g} GB"


FAMILIES = {  # name -> (words, predicate over a candidate's Plan)
    "ddp": ("DDP or ZeRO (data parallel only)",
            lambda p: p.pp == 1 and p.tp == 1 and p.offload == "none"),
    "split": ("pipeline, ZeRO or tensor parallel",
              lambda p: p.pp > 1 or p.tp > 1 or p.zero >= 1),
    # a layer too big for one device: split it (tp), shard it (ZeRO-3), or move its
    # gradient and optimizer state off the device (offload)
    "big-layer": ("tensor parallel, ZeRO-3 or ZeRO with offload",
                  lambda p: p.tp > 1 or p.zero == 3 or p.offload != "none"),
    "offload": ("ZeRO with offload", lambda p: p.offload != "none"),
    "fast": ("ZeRO, or DP+PP+TP", lambda p: (p.pp == 1 and p.tp == 1 and p.zero >= 1)
             or (p.pp > 1 and p.tp > 1)),
    "slow": ("DP+PP+TP with ZeRO-1", lambda p: p.pp > 1 and p.tp > 1 and p.zero <= 1),
    "cp": ("context parallel (with tensor parallel and ZeRO)", lambda p: p.cp > 1),
    "ep": ("expert parallel (with ZeRO)", lambda p: p.ep > 1),
}


def questions(advice: Advice) -> tuple[list[Question], str]:
    spec, setup, cluster = advice.spec, advice.setup, advice.cluster
    usable = cluster.usable_mem
    b = setup.micro_batch or 1
    one = memory(spec, Candidate(Plan(precision=setup.precision), b, "none"), setup,
                 runtime=cluster.runtime)
    fits = one.total <= usable
    qs = [Question("Does the model fit on one device?", fits,
                   f"one device (micro-batch {b}, no recomputation) needs {_gb(one.total)}: "
                   f"{_gb(one.model_states)} model states + {_gb(one.activations)} activations,"
                   f" against {_gb(usable)} usable")]
    layer = largest_layer_bytes(spec, setup)
    layer_fits = layer <= usable
    qs.append(Question("Does its largest layer fit on one device?", layer_fits,
                       f"largest layer {spec.largest_layer_params / 1e6:.4g}M parameters with "
                       f"gradient and optimizer state: {_gb(layer)} against {_gb(usable)}"))
    many = cluster.nodes > 1
    qs.append(Question("Does it span many nodes?", many,
                       f"{cluster.nodes} node(s) x {cluster.gpus_per_node} devices"))
    family = "ddp" if fits else "split" if layer_fits else "big-layer"
    if cluster.world == 1 and not fits:
        family = "offload"
    if many:
        # Fast or slow: can the inter-node link all-reduce the gradients within the backward
        # pass of pure data parallelism (2/3 of the step's compute, Megatron 2021 §5.1)?
        grads = spec.num_params * setup.grad_bytes
        t_ar = cluster.collective_time("all_reduce", grads, cluster.world, cluster.world)
        t_bwd = step_flops(spec, setup.global_batch) * 2 / 3 / cluster.world / cluster.achievable_flops
        fast = t_ar <= t_bwd
        qs.append(Question("Are the inter-node links fast?", fast,
                           f"all-reducing {_gb(grads)} of gradients across {cluster.world} "
                           f"devices at {cluster.inter_bw / 1e9:.3g} GB/s takes {t_ar:.3g} s; "
                           f"data-parallel backward computes for {t_bwd:.3g} s"))
        if not fits:
            family = "fast" if fast else "slow"
    if spec.experts:
        q = _experts_question(advice)
        qs.append(q)
        if not fits and cluster.world > 1:
            family = "ep"
    seq_fits, q = _sequence_question(advice)
    qs.append(q)
    if not seq_fits and cluster.world > 1 and family != "big-layer":   # a layer first
        family = "cp"
    return qs, family


def _widest_tp(spec, cluster) -> int:
    return max(t for t in range(1, cluster.gpus_per_node + 1)
               if cluster.gpus_per_node % t == 0 and spec.heads % t == 0)


def _sequence_question(advice: Advice) -> tuple[bool, Question]:
    """Does one sequence's activation fit? One sequence (micro-batch 1) under the widest
    tensor parallel of a node with sequence parallel, attention recomputed (no s x s
    scores kept), beside the model states that ZeRO-3 spreads over every device (all the
    device where they must be offloaded anyway): if not,
    only splitting the sequence (context parallel) or recomputing every layer lets it
    train."""
    spec, setup, cluster = advice.spec, advice.setup, advice.cluster
    tp = _widest_tp(spec, cluster)
    cand = Candidate(Plan(tp=tp, precision=setup.precision), 1, "attention")
    acts = memory(spec, cand, setup).activations
    states = spec.num_params * (setup.param_bytes + setup.grad_bytes + setup.optim_bytes)
    shard = states / cluster.world
    room = cluster.usable_mem - (shard if shard < cluster.usable_mem else 0)
    where = (f"left beside its model states under ZeRO-3 over {cluster.world} devices"
             if shard < cluster.usable_mem else "usable, its model states offloaded")
    return acts <= room, Question(
        "Does one sequence's activation fit?", acts <= room,
        f"one sequence of {spec.seq:,} tokens keeps {_gb(acts)} of activations on tp {tp} "
        f"with sequence parallel (attention recomputed), against {_gb(room)} {where}")


def _experts_question(advice: Advice) -> Question:
    """A mixture of experts: how much of the model its experts are, and what expert
    parallel's all-to-alls carry per layer."""
    spec, setup = advice.spec, advice.setup
    share = spec.layers * spec.layer_expert_params / spec.num_params
    per_token = 2 * spec.top_k * spec.hidden * setup.act_bytes
    return Question(
        "Is it a mixture of experts?", True,
        f"{spec.experts} experts per layer, top {spec.top_k}: the experts hold {share:.0%} of "
        f"its {spec.num_params / 1e9:.3g}B parameters, which expert parallel splits over ep "
        f"data-parallel ranks; each token crosses the ep axis as {per_token:,} bytes each "
        f"way per layer, forward and backward (priced dropless: every top-k choice sent; "
        f"a capacity factor C, train --capacity-factor, sends at most C x the even share)")


def _best_in(advice: Advice, family: str) -> Evaluated | None:
    pred = FAMILIES[family][1]
    return next((ev for ev in advice.ranked if pred(ev.cand.plan)), None)


def _why(a: Evaluated, top: Evaluated) -> str:
    parts = {"pipeline bubble": "bubble", "tensor-parallel communication": "tp_comm",
             "context-parallel communication": "cp_comm", "expert all-to-alls": "ep_comm",
             "pipeline communication": "pp_comm", "exposed data-parallel communication":
             "dp_exposed", "offload traffic": "offload", "compute": "compute"}
    diffs = {name: getattr(a.time, key) - getattr(top.time, key) for name, key in parts.items()}
    name = max(diffs, key=diffs.get)
    key = parts[name]
    return (f"its {name} is {getattr(a.time, key):.3g} s against {getattr(top.time, key):.3g} s"
            + (f" (recomputation: {a.cand.recompute})" if name == "compute" and a.cand.recompute != "none" else ""))


def verdict(advice: Advice) -> Verdict:
    qs, family = questions(advice)
    words, pred = FAMILIES[family]
    if not advice.ranked:
        return Verdict(qs, words, False, "no plan fits, so no ranking to compare")
    top = advice.ranked[0]
    if pred(top.cand.plan):
        return Verdict(qs, words, True, f"the fastest plan, {top.cand.label()}, is what the "
                       f"guide recommends ({words})")
    best = _best_in(advice, family)
    if best is None:
        smallest = [ev for ev in advice.rejected if pred(ev.cand.plan)]
        detail = (f"; the smallest such plan, {min(smallest, key=lambda e: e.mem.total).cand.label()}"
                  f", needs {_gb(min(e.mem.total for e in smallest))}") if smallest else ""
        return Verdict(qs, words, False, f"the guide recommends {words}, but no such plan fits "
                       f"or is valid here{detail}; the fastest plan is {top.cand.label()}")
    ratio = best.time.total / top.time.total
    return Verdict(qs, words, False,
                   f"the guide recommends {words}; its best, {best.cand.label()}, is predicted "
                   f"{best.time.total:.3g} s per step, {ratio:.2f}x the fastest plan "
                   f"{top.cand.label()} ({top.time.total:.3g} s): {_why(best, top)}")
