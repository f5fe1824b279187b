"""The time and memory model's terms for CPU ranks on one machine (a calibrated `--cluster
local`), each against its arithmetic: a micro-batch's fixed cost, more ranks than cores, the
host being the ranks' own memory, gloo's staging copies, tensor parallel's unsplit work, the
parameter server's and DP's ranks."""
import pytest

from meshtrain.core.plan import Plan
from meshtrain.models.gpt import GPTConfig
from meshtrain.planner import activations as am
from meshtrain.planner import memory as mm
from meshtrain.planner import states as sm
from meshtrain.planner.flops import elementwise_bytes_per_token
from meshtrain.planner.profile import (NARROW_GPT, REFERENCE_BATCH, REFERENCE_GPT, SMALL_BATCH,
                                       cluster_from_profile, elementwise_split)
from meshtrain.planner.hardware import Cluster, Curve
from meshtrain.planner.model_spec import from_gpt_config
from meshtrain.planner.profile import step_costs
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.flops import step_flops
from meshtrain.planner.time_model import family_exchange, step_time, tp_overhead

SPEC = from_gpt_config(GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256))
FP32 = Setup(global_batch=8, precision="fp32")
FLAT = Curve((256.0, 2.0**24), (1e9, 1e9))
LOCAL = Cluster(gpus_per_node=4, peak_flops=1e11, efficiency=0.5, host_is_device=True,
                curves={k: FLAT for k in ("all_reduce", "all_gather", "reduce_scatter", "p2p")})


def test_step_costs_separate_a_micro_batchs_fixed_cost_from_its_flops():
    ref = from_gpt_config(GPTConfig(**REFERENCE_GPT))
    rate, overhead = 8e10, 6e-3            # 6 ms a micro-batch over 2 blocks + 1
    t = {b: overhead + step_flops(ref, b) / rate for b in (SMALL_BATCH, REFERENCE_BATCH)}
    entry = {"model_flops": step_flops(ref, REFERENCE_BATCH) / t[REFERENCE_BATCH],
             "model_flops_small": step_flops(ref, SMALL_BATCH) / t[SMALL_BATCH]}
    got_rate, per_block = step_costs(entry)
    assert got_rate == pytest.approx(rate)
    assert per_block == pytest.approx(overhead / (REFERENCE_GPT["n_layer"] + 1))
    # an old profile (one batch size) keeps its one rate and no fixed cost
    assert step_costs({"model_flops": 5e10}) == (5e10, 0.0)


def _timed_at_two_widths(rate, moved_rate, overhead):
    """A profile entry whose reference steps took `overhead` plus their FLOPs at `rate` and
    their elementwise bytes at `moved_rate`, at both batch sizes and the narrow width."""
    entry = {}
    for key, shape, batch in (("model_flops", REFERENCE_GPT, REFERENCE_BATCH),
                              ("model_flops_small", REFERENCE_GPT, SMALL_BATCH),
                              ("model_flops_narrow", NARROW_GPT, REFERENCE_BATCH)):
        spec = from_gpt_config(GPTConfig(**shape))
        moved = batch * spec.seq * elementwise_bytes_per_token(spec, spec.layers)
        seconds = overhead + step_flops(spec, batch) / rate + moved / moved_rate
        entry[key] = step_flops(spec, batch) / seconds
    return entry


def test_two_widths_separate_the_matmuls_rate_from_the_elementwise_works():
    rate, moved_rate, overhead = 1e11, 5e9, 6e-3
    entry = _timed_at_two_widths(rate, moved_rate, overhead)
    got_rate, got_moved = elementwise_split(entry)
    assert got_rate == pytest.approx(rate) and got_moved == pytest.approx(moved_rate)
    assert step_costs(entry)[1] == pytest.approx(overhead / (REFERENCE_GPT["n_layer"] + 1))
    # without the narrow step (GPU ranks, older profiles) there is nothing to split
    assert elementwise_split({k: v for k, v in entry.items() if k != "model_flops_narrow"}) is None
    # noise that leaves the elementwise work no time: the one rate stands
    assert elementwise_split({**entry, "model_flops_narrow": entry["model_flops"] * 0.3}) is None


def test_a_narrower_model_pays_its_elementwise_work_per_flop():
    """Calibrated at two widths, a model half the reference's width is priced at its
    measured step (its elementwise work shrinks with the width, its FLOPs with the square),
    where the one blended rate prices its every FLOP as the reference's: too fast."""
    entry = {**_timed_at_two_widths(1e11, 5e9, 6e-3), "matmul_flops": 1.2e11, "mem_bw": 1e10}
    split = cluster_from_profile({"host_mem": 8e9, "worlds": {"1": entry}})
    blended = cluster_from_profile({"host_mem": 8e9, "worlds": {"1": {
        k: v for k, v in entry.items() if k != "model_flops_narrow"}}})
    assert split.elementwise_apart and split.elementwise_bw == pytest.approx(5e9)
    cand = Candidate(Plan(dp=1), REFERENCE_BATCH, "none")
    for shape, key in ((REFERENCE_GPT, "model_flops"), (NARROW_GPT, "model_flops_narrow")):
        spec = from_gpt_config(GPTConfig(**shape))
        measured = step_flops(spec, REFERENCE_BATCH) / entry[key]
        assert step_time(spec, cand, FP32, split).compute == pytest.approx(measured)
        blended_error = step_time(spec, cand, FP32, blended).compute / measured - 1
        if shape is REFERENCE_GPT:
            assert blended_error == pytest.approx(0.0, abs=1e-9)
        else:
            assert blended_error < -0.05


def test_every_micro_batch_pays_the_fixed_cost_once_per_block():
    cand = Candidate(Plan(dp=1, microbatches=4), 2, "none")
    plain = step_time(SPEC, cand, FP32, LOCAL).total
    slow = step_time(SPEC, cand, FP32, LOCAL.with_(block_overhead=1e-3)).total
    assert slow - plain == pytest.approx(4 * (SPEC.layers + 1) * 1e-3)


def test_more_ranks_than_cores_turn_the_pipeline_bubble_into_work():
    cand = Candidate(Plan(dp=2, pp=2, microbatches=4), 2, "none")
    alone = step_time(SPEC, cand, FP32, LOCAL)
    shared = step_time(SPEC, cand, FP32, LOCAL.with_(idle_speedup=2.0))
    slot = alone.bubble / (2 - 1)                 # GPipe/1F1B: p - 1 slots of bubble
    # 5 slots on the critical path at twice the speed take less than the 4 slots of work
    assert shared.bubble == pytest.approx(0.0, abs=1e-12)
    assert alone.total - shared.total == pytest.approx(slot)
    # one micro-batch over 4 stages: 4 slots, 3 of them bubble; at speedup 2 the critical
    # path takes 2 slots, still more than the 1 slot of work: 1 slot of bubble is left
    deep = Candidate(Plan(pp=4, microbatches=1), 2, "none")
    d1, d2 = (step_time(SPEC, deep, FP32, LOCAL.with_(idle_speedup=s)) for s in (1.0, 2.0))
    assert d2.bubble == pytest.approx(d1.bubble / 3)


def test_tensor_parallel_pays_for_the_work_it_does_not_split():
    cand = Candidate(Plan(tp=2, microbatches=2), 4, "none")
    base = step_time(SPEC, cand, FP32, LOCAL).total
    more = step_time(SPEC, cand, FP32, LOCAL.with_(tp_overhead={2: 1e-8, 4: 3e-8})).total
    assert more - base == pytest.approx(2 * 4 * SPEC.seq * (SPEC.layers + 1) * 1e-8)
    # a width not calibrated takes the nearest one's
    assert tp_overhead(LOCAL.with_(tp_overhead={2: 1e-8, 4: 3e-8}), 8, SPEC.hidden) == 3e-8
    assert tp_overhead(LOCAL, 2, SPEC.hidden) == 0.0
    # the norms, residuals and copies it stands for touch every channel: a model half as
    # wide as the one it was calibrated on pays half per token
    fitted = LOCAL.with_(tp_overhead={2: 1e-8}, tp_overhead_hidden=2 * SPEC.hidden)
    assert tp_overhead(fitted, 2, SPEC.hidden) == pytest.approx(0.5e-8)


def test_on_cpu_ranks_cpu_offload_moves_nothing_and_disk_keeps_the_gradient_shard():
    psi = 1e6
    plain = sm.model_states(psi, FP32, zero=2, dp=2)
    assert sm.model_states(psi, FP32, 2, 2, "cpu", host_is_device=True) == plain
    disk = sm.model_states(psi, FP32, 2, 2, "disk", host_is_device=True)
    assert (disk.params, disk.grads, disk.optim) == (4 * psi, 4 * psi / 2, 0.0)
    assert disk.host == 8 * psi / 2
    z3 = sm.model_states(psi, FP32, 3, 2, "disk", host_is_device=True)
    assert (z3.params, z3.grads, z3.host) == (0.0, 4 * psi / 2, (8 + 4) * psi / 2)
    # on a GPU the gradient shard leaves the device too (ZeRO-Offload)
    assert sm.model_states(psi, FP32, 2, 2, "disk").grads == 0.0


def test_zero_staging_grows_with_its_largest_collective_buffer():
    setup = FP32
    for zero, buffer in ((1, SPEC.num_params * 4), (3, SPEC.largest_layer_params * 4)):
        cand = Candidate(Plan(dp=2, zero=zero), 8, "none")
        assert sm.collective_buffer_bytes(SPEC, cand, setup) == pytest.approx(buffer)
        bare = mm.memory(SPEC, cand, setup, runtime=(1e6, 0.5))
        staged = mm.memory(SPEC, cand, setup, runtime=(1e6, 0.5), staging=3.0)
        heap = bare.runtime - 1e6                    # the activations' heap
        if zero == 3:   # gathers while the activations live: beside their heap
            assert staged.runtime - bare.runtime == pytest.approx(3.0 * buffer)
        else:           # after backward, in the heap the activations left
            assert staged.runtime == pytest.approx(1e6 + max(heap, 3.0 * buffer))
        assert staged.allocated == bare.allocated    # staging is the runtime's, not a tensor
    # a bucket caps ZeRO-1/2's buffer; DDP and one rank stage nothing
    small = Candidate(Plan(dp=2, zero=1, bucket_mb=1.0), 8, "none")
    assert sm.collective_buffer_bytes(SPEC, small, setup) == 2**20
    assert sm.collective_buffer_bytes(SPEC, Candidate(Plan(dp=2), 8, "none"), setup) == 0


def test_full_recomputation_keeps_layer_inputs_but_the_heap_sees_every_activation():
    keep = Candidate(Plan(dp=2, zero=3), 8, "none")
    redo = Candidate(Plan(dp=2, zero=3, recompute="full"), 8, "full")
    k, r = (mm.memory(SPEC, c, FP32, runtime=(0.0, 0.5)) for c in (keep, redo))
    layer = am.layer_activation_bytes(SPEC, SPEC.seq, 8, elem_bytes=4)
    assert k.activations - r.activations == pytest.approx(
        SPEC.layers * (layer - am.layer_activation_bytes(SPEC, SPEC.seq, 8, recompute="full",
                                                         elem_bytes=4)))
    # two moments: the loss's backward (the lean loss's working tensors recomputation plans
    # use, no fp32 logits), then the layer re-run in backward with its backward's ffn-wide
    # gradients, once the output layer's tensors are freed; the larger is the peak
    block = 1.5 * SPEC.ffn_hidden * SPEC.seq * 8 * 4
    loss = am.transient_bytes(SPEC, redo, FP32)
    in_flight = 2 * 4 * SPEC.largest_layer_params   # ZeRO-3: two units' reduce-scatters
    rerun = layer + block + in_flight - am.output_bytes(SPEC, redo, FP32)
    assert rerun > loss and r.transient == pytest.approx(max(loss, rerun))
    assert r.runtime == pytest.approx(k.runtime)               # the same forward allocations


@pytest.mark.parametrize("plan, roles", [
    (Plan(dp=2, pp=2), ["stage 0", "stage 0", "stage 1", "stage 1"]),
    (Plan(dp=4, dp_mode="ps-sync", ps_shards=2), ["server", "server", "worker", "worker"]),
    (Plan(dp=4, dp_mode="ps-sync", ps_shards=4), ["every rank"] * 4),
    (Plan(dp=2, tp=2), ["every rank"] * 4),
    (Plan(dp=3, dp_mode="dp"), ["master"]),
])
def test_each_rank_has_its_role(plan, roles):
    assert [mm.rank_role(plan, r) for r in range(plan.world_size)] == roles


def test_a_parameter_server_root_holds_three_times_a_workers_states():
    cand = Candidate(Plan(dp=4, dp_mode="ps-sync"), 4, "none")
    roles = mm.role_memories(SPEC, cand, FP32)
    psi = SPEC.num_params
    assert roles["worker"].model_states == pytest.approx(8 * psi)          # params + bucket
    assert roles["server"].model_states == pytest.approx(8 * psi + 16 * psi)  # + master, sum, Adam
    assert mm.memory(SPEC, cand, FP32).model_states == roles["server"].model_states
    sharded = mm.role_memories(SPEC, Candidate(Plan(dp=4, dp_mode="ps-sync", ps_shards=4), 4,
                                               "none"), FP32)
    assert sharded["every rank"].model_states == pytest.approx(8 * psi + 16 * psi / 4, rel=1e-6)
    master = mm.memory(SPEC, Candidate(Plan(dp=3, dp_mode="dp"), 6, "none"), FP32)
    assert master.model_states == pytest.approx(3 * 8 * psi + 8 * psi)


def test_a_server_receives_and_sends_n_minus_1_shards_one_after_another():
    psi = 1e6
    one = family_exchange(psi, FP32, Plan(dp=4, dp_mode="ps-sync"), LOCAL)
    four = family_exchange(psi, FP32, Plan(dp=4, dp_mode="ps-sync", ps_shards=4), LOCAL)
    assert one == pytest.approx(3 * 2 * 4 * psi / 1e9)
    assert four == pytest.approx(one / 4)
    dp = family_exchange(psi, FP32, Plan(dp=4, dp_mode="dp"), LOCAL)
    assert dp == pytest.approx(3 * psi * (4 + 2 * 4) / LOCAL.mem_bw)


def test_the_pipeline_runtime_pays_its_work_per_micro_batch_and_chunk():
    one = Candidate(Plan(pp=2, microbatches=4), 2, "none")
    two = Candidate(Plan(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2), 2,
                    "none")
    for cand, chunks in ((one, 1), (two, 2)):
        base = step_time(SPEC, cand, FP32, LOCAL)
        more = step_time(SPEC, cand, FP32, LOCAL.with_(pp_overhead=1e-3))
        slots = 4 + (2 - 1) / chunks          # m + (p - 1) / v
        assert more.total - base.total == pytest.approx(slots * chunks * 1e-3)


def test_disk_offload_costs_its_calibrated_time_per_offloaded_byte():
    cand = Candidate(Plan(dp=2, zero=2, offload="disk"), 8, "none")
    base = step_time(SPEC, cand, FP32, LOCAL)
    more = step_time(SPEC, cand, FP32, LOCAL.with_(disk_overhead=1e-9))
    on_disk = 8 * SPEC.num_params / 2              # AdamW's two fp32 moments, this rank's half
    assert more.offload - base.offload == pytest.approx(on_disk * 1e-9, rel=1e-6)
    assert base.optimizer > 0                      # the CPU still steps the optimizer itself


def test_a_cluster_hands_its_calibrated_memory_terms_to_the_memory_model():
    cl = LOCAL.with_(runtime_fixed=5e6, runtime_per_act=0.4, staging={1: 4.0},
                     tp_memory={2: 3e6, 4: 7e6}, pp_memory=2e6)
    terms = cl.memory_terms(Plan(dp=2, pp=2, tp=2, zero=1))
    # tensor and pipeline parallel's buffers share the heap: the larger counts
    assert terms == dict(runtime=(5e6, 0.4, 0.4, 0.0), host_is_device=True, staging=4.0,
                         extra=(3e6, 3e6), sp_heap=0.0, optimizer_step=0.0)
    assert cl.memory_terms(Plan(tp=8))["extra"] == 7e6       # the nearest width calibrated
    assert cl.memory_terms(Plan(dp=2))["extra"] == 0.0
    # tensor-parallel ranks' heap grows with all their forward traffic at one rate
    split = cl.with_(runtime_first_layer=0.9, runtime_line=(4e6, 0.45))
    assert split.memory_terms(Plan(dp=2))["runtime"] == (5e6, 0.4, 0.9, 0.0)
    assert split.memory_terms(Plan(dp=2, tp=2))["runtime"] == (4e6, 0.45, 0.45, 0.0)


def test_pipeline_buffers_are_calibrated_per_stage_kind():
    """The first stage keeps the most micro-batches' messages, the last sends no
    activations: each its own calibrated term; a pipeline with tensor parallel its own pair
    where calibrated (the larger of the two terms otherwise), and ZeRO-3 with recomputation
    its own staging."""
    cl = LOCAL.with_(runtime_fixed=5e6, pp_memory=(9e6, 2e6), tp_memory={2: 4e6},
                     staging={3: 10.0, "3+recompute": 14.0})
    plan = Plan(pp=2, microbatches=4)
    assert cl.memory_terms(plan)["extra"] == (9e6, 2e6)
    for other in (Plan(pp=2, microbatches=4, schedule="gpipe"),
                  Plan(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)):
        assert cl.memory_terms(other)["extra"] == (9e6, 9e6)   # the last rank as the first
    cand = Candidate(plan, 2, "none")
    first, last = mm.stage_memories(SPEC, cand, FP32, **cl.memory_terms(plan))
    bare = mm.stage_memories(SPEC, cand, FP32, **LOCAL.with_(runtime_fixed=5e6).memory_terms(plan))
    assert (first.runtime - bare[0].runtime, last.runtime - bare[1].runtime) == \
        pytest.approx((9e6, 2e6))
    assert cl.memory_terms(Plan(pp=2, tp=2, microbatches=4))["extra"] == (9e6, 4e6)
    both = cl.with_(pp_tp_memory=(1e6, 3e6))
    assert both.memory_terms(Plan(pp=2, tp=2, microbatches=4))["extra"] == (1e6, 3e6)
    assert both.memory_terms(Plan(pp=2, microbatches=4))["extra"] == (9e6, 2e6)
    assert cl.memory_terms(Plan(dp=2, zero=3))["staging"] == 10.0
    assert cl.memory_terms(Plan(dp=2, zero=3, recompute="full"))["staging"] == 14.0


def test_tensor_parallel_in_a_pipeline_scales_its_collectives_by_the_calibrated_factor():
    cand = Candidate(Plan(pp=2, tp=2, microbatches=4), 2, "none")
    base = step_time(SPEC, cand, FP32, LOCAL)
    scaled = step_time(SPEC, cand, FP32, LOCAL.with_(pp_tp_scale=0.5))
    assert base.tp_comm > 0 and scaled.tp_comm == pytest.approx(base.tp_comm * 0.5)
    alone = Candidate(Plan(tp=2), 2, "none")   # outside a pipeline: untouched
    assert step_time(SPEC, alone, FP32, LOCAL.with_(pp_tp_scale=0.5)).tp_comm == \
        step_time(SPEC, alone, FP32, LOCAL).tp_comm


def test_a_stage_without_the_loss_peaks_in_its_last_blocks_backward():
    cand = Candidate(Plan(pp=2, microbatches=1), 8, "none")
    first, last = mm.stage_memories(SPEC, cand, FP32)
    absorb = 4 * SPEC.largest_tensor_params
    assert first.transient == pytest.approx(absorb + 1.5 * SPEC.ffn_hidden * SPEC.seq * 8 * 4)
    # the last stage holds the loss: the cross-entropy's two fp32 logits-shaped gradients
    # (2 x 4 s b V) beside one freshly produced weight gradient (the h x 4h matrix's)
    logits_grads = 2 * 4 * SPEC.seq * 8 * SPEC.vocab
    assert last.transient == logits_grads + 4 * SPEC.hidden * SPEC.ffn_hidden


@pytest.mark.parametrize("plan, expected", [
    # DDP: the ring's 2(N-1)/N of the gradients
    (Plan(dp=4), {"dp": 2 * 3 / 4}),
    # ZeRO-3: gathered twice (the output layer, the last unit, once) and scattered once,
    # every micro-batch (strategies/zero/zero3.py; test_zero3 counts it on the runtime)
    (Plan(dp=2, zero=3, microbatches=2),
     {"dp": 2 * (3 - SPEC.head_params / SPEC.num_params) / 2}),
    # one server: pulls to the other 3 workers; a worker pushes everything
    (Plan(dp=4, dp_mode="ps-sync"), {"dp": 3.0}),
])
def test_bytes_sent_on_the_data_parallel_axis(plan, expected):
    from meshtrain.planner.traffic import axis_bytes
    cand = Candidate(plan, 2, "none")
    got = axis_bytes(SPEC, cand, FP32)
    assert got["dp"] == pytest.approx(expected["dp"] * 4 * SPEC.num_params)
    if plan.dp_mode == "ps-sync":
        worker = axis_bytes(SPEC, cand, FP32, server=False)
        assert worker["dp"] == pytest.approx(4 * SPEC.num_params)


def test_bytes_sent_by_pipeline_stages_and_tensor_parallel_ranks():
    from meshtrain.planner.traffic import axis_bytes
    act = 2 * SPEC.seq * SPEC.hidden * 4
    cand = Candidate(Plan(pp=4, microbatches=3), 2, "none")
    # the first stage only sends activations, a middle one both ways, the last only gradients
    assert [axis_bytes(SPEC, cand, FP32, st)["pp"] / act for st in range(4)] == [3, 6, 6, 3]
    tp = Candidate(Plan(tp=2, pp=2, microbatches=1), 2, "none", sequence_parallel=False)
    blocks = SPEC.layers // 2
    first, last = (axis_bytes(SPEC, tp, FP32, st)["tp"] for st in (0, 1))
    assert first == pytest.approx((4 * blocks + 1) * act)          # ring share 2(t-1)/t = 1
    assert last == pytest.approx((4 * blocks + 1) * act + 3 * 2 * SPEC.seq * 4)
    # sequence parallel: the same bytes per block (reduce-scatter + all-gather for each
    # all-reduce), the embedding split's all-gather in backward, the all-gathers that
    # rebuild the column layers' inputs in backward (2 per block, the head's on the last
    # stage; (t-1)/t = 1/2 each), and the gradients of what saw a slice of the sequence
    # (norms, row-parallel biases) all-reduced once a step
    sp = Candidate(Plan(tp=2, pp=2, microbatches=1), 2, "none", sequence_parallel=True)
    partial = blocks * SPEC.layer_replicated_params * 4
    sp_first, sp_last = (axis_bytes(SPEC, sp, FP32, st)["tp"] for st in (0, 1))
    assert sp_first == pytest.approx(first + act / 2 + 2 * blocks * act / 2 + partial)
    assert sp_last == pytest.approx(last + (2 * blocks + 1) * act / 2 + partial
                                    + SPEC.norm_params * 4)


def test_the_activations_heap_is_one_micro_batchs_whatever_is_in_flight():
    runtime = dict(runtime=(0.0, 0.5))
    gpipe, one_f = (mm.stage_memories(SPEC, Candidate(Plan(pp=2, microbatches=4, schedule=s),
                                                      2, "none"), FP32, **runtime)[0]
                    for s in ("gpipe", "1f1b"))
    assert gpipe.activations == pytest.approx(2 * one_f.activations)   # 4 in flight, not 2
    assert gpipe.runtime == pytest.approx(one_f.runtime)
    layer = am.layer_activation_bytes(SPEC, SPEC.seq, 2, elem_bytes=4)
    assert one_f.runtime == pytest.approx(0.5 * layer * SPEC.layers / 2)
    # DP's replica threads keep no heap behind (their arenas give it back)
    master = mm.memory(SPEC, Candidate(Plan(dp=2, dp_mode="dp"), 8, "none"), FP32, **runtime)
    assert master.runtime == 0.0


def test_dp_replicas_take_one_processs_trainer_terms():
    """DP's replicas are threads of one process: the Trainer's factor and fixed cost
    calibrated on one process apply, not those of DDP's ranks (hooks, backend threads)."""
    cand = Candidate(Plan(dp=2, dp_mode="dp"), 8, "none")
    ranks = LOCAL.with_(compute_scale=1.2, step_overhead=0.01)
    both = ranks.with_(process_trainer=(1.0, 0.002))
    plain = step_time(SPEC, cand, FP32, LOCAL.with_(step_overhead=0.002))
    assert step_time(SPEC, cand, FP32, both).total == pytest.approx(plain.total)
    assert step_time(SPEC, cand, FP32, ranks).total > plain.total
    ddp = Candidate(Plan(dp=2), 8, "none")   # DDP keeps its ranks' terms
    assert step_time(SPEC, ddp, FP32, both).total == step_time(SPEC, ddp, FP32, ranks).total


def test_accumulating_over_micro_batches_keeps_its_calibrated_heap():
    """Outside a pipeline, two or more micro-batches a step add the calibrated heap (the next
    forward beside the gradients the first made); one micro-batch and pipelines (whose
    buffers term has it) do not; ZeRO-1/2's staging reuses it as it reuses the rest."""
    cl = LOCAL.with_(runtime_fixed=5e6, runtime_per_act=0.3, accumulation_memory=8e6)
    base = LOCAL.with_(runtime_fixed=5e6, runtime_per_act=0.3)
    def runtime(cluster, plan, b=8):
        return mm.memory(SPEC, Candidate(plan, b, "none"), FP32, **cluster.memory_terms(plan)).runtime
    two = Plan(dp=2, microbatches=2)
    assert runtime(cl, two) - runtime(base, two) == pytest.approx(8e6)
    assert runtime(cl, Plan(dp=2)) == runtime(base, Plan(dp=2))
    piped = Plan(pp=2, microbatches=4)
    assert runtime(cl, piped, 2) == runtime(base, piped, 2)
    staged = Plan(dp=2, zero=2, microbatches=2)   # staging larger than the heap: unchanged
    big = cl.with_(staging={2: 50.0})
    assert runtime(big, staged) == runtime(big.with_(accumulation_memory=0.0), staged)


def test_sequence_parallel_adds_its_calibrated_heap_per_byte_of_forward_traffic():
    """Its gathers and scatters along the sequence, a few per layer, are staged by a CPU
    backend: calibrated (fixed, per byte of forward traffic) in place of tp's own term."""
    cl = LOCAL.with_(tp_memory={2: 2e6}, sp_memory={2: (1e6, 0.5)})
    plan = Plan(tp=2, sequence_parallel=True)
    terms = cl.memory_terms(plan)
    assert terms["sp_heap"] == 0.5 and terms["extra"] == 1e6   # in place of tp's term
    assert cl.memory_terms(Plan(tp=2))["sp_heap"] == 0.0     # without sequence parallel
    assert cl.memory_terms(Plan(tp=2))["extra"] == 2e6
    cand = Candidate(plan, 8, "none", True)
    first, rest = am.forward_traffic(SPEC, cand, FP32, 0)
    bare = mm.memory(SPEC, cand, FP32, **LOCAL.memory_terms(plan))
    assert mm.memory(SPEC, cand, FP32, **terms).runtime - bare.runtime == \
        pytest.approx(1e6 + 0.5 * (first + rest))


def test_an_interleaved_stage_heaps_each_chunks_first_layer():
    """Its chunks' forwards run apart, each from its own first layer: with 2 chunks of one
    block each, both blocks count at the first layer's rate."""
    plain = Candidate(Plan(pp=2, microbatches=4), 2, "none")
    chunked = Candidate(Plan(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2),
                        2, "none")
    first, rest = am.forward_traffic(SPEC, plain, FP32, 0)
    blocks = SPEC.layers // 2
    assert am.forward_traffic(SPEC, chunked, FP32, 0) == pytest.approx((2 * first, (blocks - 2) * first))
    assert rest == pytest.approx((blocks - 1) * first)


def test_sequence_parallels_backward_holds_three_whole_activations_more():
    plan = Plan(tp=2, sequence_parallel=True)
    act = 4 * SPEC.seq * 8 * SPEC.hidden
    sp = mm.memory(SPEC, Candidate(plan, 8, "none", True), FP32)
    tp = mm.memory(SPEC, Candidate(plan, 8, "none", False), FP32)
    assert sp.transient - tp.transient == pytest.approx(3 * act)


def test_building_holds_the_ranks_part_and_one_whole_tensor():
    """Built on the meta device, a rank holds what it keeps (its parameters and gradient
    buffers) and the one whole tensor being made: under tp over 8 ranks with a wide
    vocabulary, training holds an eighth of the embedding, building all of it for a
    moment, and the rank's total is the building peak's."""
    wide = from_gpt_config(GPTConfig(vocab_size=65536, seq_len=16, n_layer=2, n_head=8,
                                     d_model=256))
    cand = Candidate(Plan(tp=8), micro_batch=1, recompute="none")
    mem = mm.stage_memories(wide, cand, FP32)[0]
    states = sm.model_states(sm.stage_params(wide, Plan(tp=8), 0), FP32, 0, 1)
    largest = 65536 * 256
    assert wide.largest_tensor_params == largest
    assert mem.build == states.params + states.grads + 4 * largest
    assert mem.build > mem.allocated
    assert mem.total == mem.build + mem.runtime
