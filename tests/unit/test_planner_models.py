"""The planner's memory and FLOP formulas against the papers' published figures."""
from dataclasses import replace

import pytest

from meshtrain.planner import activations as am
from meshtrain.planner import memory as mm
from meshtrain.planner import states as sm
from meshtrain.planner.model_spec import PRESETS, from_description, preset
from meshtrain.planner.setup import Candidate, Setup
from meshtrain.planner.flops import step_flops
from meshtrain.core.units import UnitError, parse_bandwidth, parse_bytes, parse_flops
from meshtrain.core.plan import Plan

MIXED_ADAM = Setup(precision="bf16", optimizer="adam")


# --- ZeRO (Rajbhandari et al. 2020), Table 1: Psi = 7.5B, K = 12, N_d = 64 -----------------
@pytest.mark.parametrize("zero, published_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_table1_model_states(zero, published_gb):
    states = sm.model_states(7.5e9, MIXED_ADAM, zero=zero, dp=64)
    gb = states.device / 1e9
    digits = len(str(published_gb).split(".")[1]) if "." in str(published_gb) else 0
    assert round(gb, digits) == published_gb


def test_zero_table1_other_columns():
    # the same table's N_d = 1024 column for 7.5B: 120, 30.1, 15.1, 0.12 (GB)
    got = [sm.model_states(7.5e9, MIXED_ADAM, z, 1024).device / 1e9 for z in range(4)]
    assert [round(g, 1) for g in got[:3]] == [120.0, 30.1, 15.1]
    assert round(got[3], 2) == 0.12
    assert MIXED_ADAM.optim_bytes == 12


def test_zero_communication_volumes():
    # ZeRO §7.2: DDP 2Psi, P_os+g 2Psi (reduce-scatter + all-gather), P_os+g+p 3Psi
    assert [sm.zero_comm_volume(z, 1.0) for z in (0, 1, 2, 3)] == [2, 2, 2, 3]


def test_offload_moves_states_to_host():
    on_device = sm.model_states(1e9, MIXED_ADAM, zero=2, dp=4, offload="none")
    off = sm.model_states(1e9, MIXED_ADAM, zero=2, dp=4, offload="cpu")
    assert off.optim == 0 and off.grads == 0 and off.params == on_device.params
    assert off.host == on_device.optim + on_device.grads


# --- Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
# Models", arXiv:2205.05198): Table 2, activation bytes per transformer layer (16-bit, with
# dropout), for the four models of its Table 3 (heads, hidden, layers; s = 2048, t = 8),
# each cell at micro-batch 1 ----------------------------------------------------------------
S, T = 2048, 8
TABLE3 = {"22B": (64, 6144, 48), "175B": (96, 12288, 96), "530B": (128, 20480, 105),
          "1T": (160, 25600, 128)}
TABLE2 = {   # (tp, sp, recompute) -> bytes per s b h, from a, s, h, t
    (1, False, "none"): lambda a, h: 34 + 5 * a * S / h,
    (T, False, "none"): lambda a, h: 10 + 24 / T + 5 * a * S / (h * T),
    (T, True, "none"): lambda a, h: 34 / T + 5 * a * S / (h * T),
    (T, False, "attention"): lambda a, h: 10 + 24 / T,   # Korthikanti's "selective"
    (T, True, "attention"): lambda a, h: 34 / T,
    (1, False, "full"): lambda a, h: 2,
}
GPT3 = PRESETS["gpt3-175b"]


def table3_spec(name: str):
    heads, hidden, layers = TABLE3[name]
    return from_description(layers, hidden, heads, vocab=51200, seq=S)


@pytest.mark.parametrize("model", TABLE3)
@pytest.mark.parametrize("tp, sp, recompute", TABLE2)
def test_korthikanti_table2(model, tp, sp, recompute):
    spec = table3_spec(model)
    expected = S * spec.hidden * TABLE2[tp, sp, recompute](spec.heads, spec.hidden)
    got = am.layer_activation_bytes(spec, S, 1, tp=tp, sp=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)


def test_sequence_parallel_per_layer_for_the_22b_model():
    """The 22B model at t = 8 and micro-batch 4 (Table 3's global batch on its 8 GPUs): 885 MB
    per layer with sequence parallel, 214 MB with attention recomputation too (issue 29's
    figures from Table 2); saving the gathered attention and MLP inputs whole, as meshtrain
    did before, would add 2 x 2sbh (1 - 1/t): 1.06 GB and 390 MB."""
    spec, b = table3_spec("22B"), 4
    sp = am.layer_activation_bytes(spec, S, b, tp=T, sp=True)
    selective = am.layer_activation_bytes(spec, S, b, tp=T, sp=True, recompute="attention")
    assert (round(sp / 1e6), round(selective / 1e6)) == (885, 214)
    gathered = 4 * S * b * spec.hidden * (1 - 1 / T)
    assert (round((sp + gathered) / 1e7), round((selective + gathered) / 1e6)) == (106, 390)


def test_the_memory_model_keeps_34_over_t_per_layer_under_sequence_parallel():
    """The whole plan's activations: every layer at Table 2's 34/t (+ scores) and the output
    layer's two inputs as slices beside its fp32 logits."""
    b = 1
    cand = Candidate(Plan(tp=T), b, "none", True)
    sbh = S * b * GPT3.hidden
    per_layer = sbh * (34 / T + 5 * GPT3.heads * S / (GPT3.hidden * T))
    output = 2 * 2 * sbh / T + am.logits_bytes(GPT3, S, b, T)
    assert mm.memory(GPT3, cand, MIXED_ADAM).activations == \
        pytest.approx(GPT3.layers * per_layer + output, rel=1e-12)


def test_korthikanti_none_is_34_plus_5as_over_h():
    # the headline number: 114 s b h bytes per layer for GPT-3 without parallelism
    assert am.layer_activation_bytes(GPT3, S, 1) == S * GPT3.hidden * 114


# --- Megatron 2021 Table 1: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)), V=51200, s=2048 -----
MEGATRON_TABLE1 = [  # (billions as printed, heads, hidden, layers)
    (1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96), (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


@pytest.mark.parametrize("billions, heads, hidden, layers", MEGATRON_TABLE1)
def test_megatron_table1_parameter_counts(billions, heads, hidden, layers):
    spec = from_description(layers, hidden, heads, vocab=51200, seq=2048)
    formula = 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (51200 + 2048) / (12 * layers * hidden))
    # the paper's formula leaves out the final LayerNorm (2h parameters)
    assert spec.num_params - 2 * hidden == pytest.approx(formula, rel=1e-12)
    assert round(spec.num_params / 1e9, 1) == billions


def test_megatron_flops_with_recomputation():
    # Megatron 2021 §5.1: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation
    spec = from_description(80, 12288, 96, vocab=51200, seq=2048)
    Bg, s, l, h, V = 1536, 2048, 80, 12288, 51200
    expected = 96 * Bg * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert step_flops(spec, Bg, "full") == pytest.approx(expected, rel=1e-12)
    # without recomputation: 72 B s l h^2 (1 + s/6h) for the layers, 6 B s h V for the logits
    expected_none = 72 * Bg * s * l * h**2 * (1 + s / (6 * h)) + 6 * Bg * s * h * V
    assert step_flops(spec, Bg, "none") == pytest.approx(expected_none, rel=1e-12)


# --- presets and other inputs ------------------------------------------------------------
@pytest.mark.parametrize("name, billions", [("gpt2-124m", 0.124), ("gpt2-350m", 0.355),
                                            ("llama-7b", 6.74), ("llama-70b", 68.98),
                                            ("gpt3-175b", 174.6)])
def test_preset_parameter_counts(name, billions):
    digits = len(str(billions).split(".")[1])
    assert round(preset(name).num_params / 1e9, digits) == billions


def test_gpt2_124m_exact_and_llama7b_exact():
    assert preset("gpt2-124m").num_params == 124_439_808
    assert preset("llama-7b").num_params == 6_738_415_616
    assert preset("llama-70b").num_params == 68_976_648_192


def test_from_module_reads_parameters_and_largest_layer():
    torch = pytest.importorskip("torch")
    from meshtrain.planner.model_spec import from_module
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    spec = from_module(net, seq=4)
    assert spec.num_params == 8 * 32 + 32 + 32 * 8 + 8
    assert spec.largest_layer_params == 8 * 32 + 32


def test_from_gpt_config_counts_the_modules_parameters():
    from meshtrain.models import gpt
    from meshtrain.planner.model_spec import from_gpt_config
    config = gpt.PRESETS["tiny"]
    spec = from_gpt_config(config)
    module = gpt.GPT(config)   # counted on the built module (parameters() lists each once)
    assert spec.num_params == sum(p.numel() for p in module.parameters())
    # the shape formula alone counts a key bias per layer, which the GPT leaves out
    # (softmax is invariant to it): exactly n_layer x d_model more
    formula = replace(spec, measured_params=0).num_params
    assert formula - spec.num_params == config.n_layer * config.d_model


def test_a_gpt_preset_with_another_sequence_counts_its_position_table():
    from meshtrain.models import gpt
    for seq in (32, 128, 512):   # the learned position table is seq x d_model
        spec = preset("tiny", seq)
        assert spec.seq == seq
        assert spec.num_params == gpt.gpt_config("tiny", seq_len=seq).num_params()


def test_unknown_preset_is_clear():
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*choose one of"):
        preset("gpt5")


# --- units -------------------------------------------------------------------------------
def test_units_parse():
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("40 GiB") == 40 * 2**30
    assert parse_bandwidth("600GB/s") == 600e9
    assert parse_bandwidth("200Gb/s") == parse_bandwidth("200Gbps") == 25e9
    assert parse_flops("312TFLOPS") == parse_flops("312 TFLOP/s") == 312e12


@pytest.mark.parametrize("fn, text, words", [
    (parse_bytes, "80", "no unit"), (parse_bytes, "-80GB", "negative"),
    (parse_bandwidth, "600", "no unit"), (parse_bandwidth, "600GB", "not a rate"),
    (parse_bandwidth, "-1GB/s", "negative"), (parse_flops, "312", "no unit"),
    (parse_bytes, "lots", "does not start with a number"), (parse_bytes, "0GB", "zero")])
def test_units_refuse_bad_text(fn, text, words):
    with pytest.raises(UnitError, match=words):
        fn(text)


# --- pipeline in-flight activations ------------------------------------------------------
def test_inflight_microbatches_per_schedule():
    assert am.inflight_microbatches("gpipe", 4, 16) == 16
    assert am.inflight_microbatches("1f1b", 4, 16) == 4
    assert am.inflight_microbatches("1f1b", 4, 2) == 2
    assert am.inflight_microbatches("interleaved", 4, 16, 2) == 4 * (1 + 3 / 8)
    assert am.inflight_microbatches("1f1b", 1, 16) == 1


def test_memory_of_a_plan_adds_up():
    spec = preset("gpt2-1.3b")
    cand = Candidate(Plan(dp=8, zero=1, microbatches=4), micro_batch=2)
    mem = mm.memory(spec, cand, MIXED_ADAM)
    psi = spec.num_params
    assert mem.params == psi * 2 and mem.grads == psi * 2
    assert mem.optim == pytest.approx(psi * 12 / 8)
    assert mem.runtime == 0  # no calibrated runtime memory on a GPU preset
    assert mem.total == (mem.params + mem.grads + mem.optim + mem.activations + mem.buffers
                         + mem.transient)
    # backward's working tensors: the logits' two fp32 gradients and the largest gradient
    logits = 4 * spec.seq * 2 * spec.vocab
    assert mem.transient == 2 * logits + 2 * spec.vocab * spec.hidden


def test_runtime_memory_is_fixed_plus_per_activation_byte():
    spec = preset("small")
    cand = Candidate(Plan(dp=1), micro_batch=8)
    bare = mm.memory(spec, cand, Setup(precision="fp32"))
    mem = mm.memory(spec, cand, Setup(precision="fp32"), runtime=(30e6, 0.4))
    assert mem.runtime == pytest.approx(30e6 + 0.4 * mem.activations)
    assert mem.allocated == bare.total and mem.total == bare.total + mem.runtime
