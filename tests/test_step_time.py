"""The step-time model (ushard/step_time.py) against the measured GPU rows and against the compiler.

The rows are tests/data/step_time/rows.json, taken from docs/benchmarks.md by the rule stated in that
file: sections dated 2026-11-26/27, dense models (bench_1b, llama3_8b) trained with tools/bench.py on
GPUs, ushard's own rows at default flags, the latest measurement of each distinct setting, rows whose
code path the file records as changed since left out. Issue 27 asks that at least 80% of them be
predicted within 15%, and that the order of the layouts it names be the measured one.
"""

import dataclasses
import json
import os

import jax
import pytest

import ushard
from conftest import small_config
from ushard import step_time
from ushard.aot import collectives_per_step, compile_train_step
from ushard.config import apply_overrides, load_config

ROWS = os.path.join(os.path.dirname(__file__), "data", "step_time", "rows.json")
TOLERANCE = 0.15


def load_rows() -> list[dict]:
    with open(ROWS) as f:
        return json.load(f)["rows"]


def row_config(row: dict):
    config = load_config(row["config"])
    apply_overrides(config, [f"{k}={v}" for k, v in row["overrides"].items()])
    return config


# Rows measured on ushard's Triton flash kernels (before the Mosaic GPU ones, 2026-11-28): forward +
# backward at 0.71 of cuDNN's rate in one call (docs/benchmarks.md, fifth session).
TRITON_FLASH = (0.355, 1500)


def predicted(row: dict) -> step_time.StepTime:
    # The benchmark machines were hosts of four GPUs (docs/benchmarks.md).
    hw = step_time.hardware(row["device"], devices_per_host=4)
    efficiency = None
    if row.get("flash") == "triton":
        default = step_time.Efficiency()
        efficiency = dataclasses.replace(default, attention={**default.attention, "flash": TRITON_FLASH})
    return step_time.predict(row_config(row), hw, mesh_shape=row["mesh"], efficiency=efficiency)


def measured_step_s(row: dict, pred: step_time.StepTime) -> float:
    """The row's step time, from whichever figure the table gives (FLOPs counted as bench.py counts them)."""
    if "step_s" in row:
        return row["step_s"]
    if "tokens_per_s" in row:
        return pred.tokens_per_step / row["tokens_per_s"]
    return pred.flops_per_step / (row["gpus"] * row["tflops_per_gpu"] * 1e12)


@pytest.fixture(scope="module")
def results() -> dict:
    out = {}
    for row in load_rows():
        pred = predicted(row)
        out[row["id"]] = (measured_step_s(row, pred), pred)
    return out


def test_step_times_match_the_benchmarks(results):
    """At least 80% of the rows within 15% of the measured step; the misses are printed."""
    lines, misses = [], []
    for name, (measured, pred) in results.items():
        error = pred.step_s / measured - 1
        lines.append(f"{name:<38} measured {measured:8.3f} s  predicted {pred.step_s:8.3f} s  {error:+6.1%}")
        if abs(error) > TOLERANCE:
            misses.append(lines[-1])
    print("\n".join(lines))
    print(f"misses ({len(misses)} of {len(results)}):", *misses, sep="\n  ")
    assert len(misses) <= 0.2 * len(results), misses


def test_the_planners_llama3_picks_are_predicted_within_15_percent(results):
    """Issue 27's last point: the three layouts `ushard plan --recommend` picked for llama3_8b on four
    H200s (tools/plan_check.py), each measured as picked (a rolled layer loop) and unrolled, every one
    within 15% of its measurement, and tensor=4 the slowest as measured."""
    picks = {name: result for name, result in results.items() if name.startswith("l8_pick_")}
    assert len(picks) == 6
    for name, (measured, pred) in picks.items():
        assert pred.step_s == pytest.approx(measured, rel=TOLERANCE), name
    for loop in ("rolled", "unrolled"):
        steps = {name: pred.step_s for name, (_, pred) in picks.items() if name.endswith(f"_{loop}_h200")}
        assert max(steps, key=steps.get).startswith("l8_pick_tp4"), steps


def _faster(results, names: list[str]) -> list[float]:
    return [results[n][1].step_s for n in names]


@pytest.mark.parametrize("names", [
    # llama3_8b on four GPUs: fsdp=4 > tensor=2 x fsdp=2 + SP > tensor=4 + SP (issue 27).
    ["l8_fsdp4_h200", "l8_tp2_fsdp2_sp_h200", "l8_tp4_sp_h200"],
    # bench_1b on four GPUs: fsdp=4 > tensor=2 x fsdp=2 > the same + SP > tensor=4 + SP.
    ["b1_fsdp4_b16_h200", "b1_tp2_fsdp2_h200", "b1_tp2_fsdp2_sp_h200", "b1_tp4_sp_h200"],
    # The same on two H100s, per remat policy.
    ["b1_fsdp2_none_h100", "b1_tp2_none_h100", "b1_tp2_sp_none_h100"],
    ["b1_fsdp2_dots_attention_h100", "b1_tp2_dots_attention_h100", "b1_tp2_sp_dots_attention_h100"],
    # 1F1B on two H200s: the head split over the stages > whole on each (one stage computes it).
    ["s7_b1_pp2_1f1b_m32_split_h200", "s7_b1_pp2_1f1b_m32_whole_h200"],
])
def test_the_order_of_layouts_is_the_measured_one(results, names):
    steps = _faster(results, names)
    assert steps == sorted(steps), dict(zip(names, steps))


# Each pipelined or context-parallel row against the fsdp (or one-GPU) row it was measured beside.
BESIDE = {
    "b1_fsdp4_xla_b64_h200": [n for n in (r["id"] for r in load_rows()) if n.startswith(("b1_pp4_", "b1_pp2_fsdp2_"))],
    "b1_fsdp4_16k_full_h200": ["b1_pp2_sp2_ag_gpipe_16k_h200", "b1_pp2_sp2_ag_1f1b_16k_h200",
                               "b1_pp2_sp2_ring_1f1b_16k_h200"],
    "b1_fsdp4_32k_full_h200": ["b1_pp2_sp2_ring_1f1b_32k_h200"],
    "b1_1gpu_8k_h200": ["b1_ring4_8k_h200", "b1_ring4_32k_h200", "b1_allgather4_32k_h200"],
    "b1_fsdp4_128k_full_h200": ["b1_ring4_128k_h200"],
}


@pytest.mark.parametrize("baseline", sorted(BESIDE))
def test_pipeline_and_ring_rows_sit_where_measured_against_fsdp(results, baseline):
    """TFLOP/s per GPU: each row is below (or, the ring at 128k, above) its baseline as measured."""
    rows = {r["id"]: r for r in load_rows()}

    def tflops(name, which):
        measured, pred = results[name]
        return pred.tflops_per_device * (pred.step_s / measured if which == "measured" else 1)

    for name in BESIDE[baseline]:
        measured_below = tflops(name, "measured") < tflops(baseline, "measured")
        predicted_below = tflops(name, "predicted") < tflops(baseline, "predicted")
        assert measured_below == predicted_below, (name, rows[name]["section"])


def test_a_setup_predicts_what_its_config_does():
    """The planner passes a Setup (ushard.build on four devices); the config path gives the same step."""
    config = load_config("bench_1b")
    apply_overrides(config, ["mesh.tensor=2", "mesh.fsdp=2", "parallel.sequence_parallel=true"])
    setup = ushard.build(config, devices=jax.devices()[:4])
    from_setup = step_time.predict(setup, "h200")
    from_config = step_time.predict(config, "h200", mesh_shape={"tensor": 2, "fsdp": 2})
    assert from_setup.step_s == pytest.approx(from_config.step_s, rel=0.02)
    kinds = {(c.axis, c.kind) for c in from_setup.collectives}
    assert kinds == {("fsdp", "all-gather"), ("fsdp", "reduce-scatter"), ("tensor", "all-gather"),
                     ("tensor", "reduce-scatter")}
    tensor = [c for c in from_setup.collectives if c.axis == "tensor"]
    assert all("critical path" in c.why and c.exposed_s == c.seconds for c in tensor)
    assert 0 < from_setup.mfu < 1 and from_setup.tokens_per_s > 0
    assert "tensor" in from_setup.describe()


def test_axes_cross_hosts_outermost_first():
    s = step_time.shape_of(load_config("tiny"), {"pipeline": 2, "fsdp": 4, "tensor": 2})
    assert step_time.hosts_of(s, 8) == {"tensor": 1, "sequence": 1, "expert": 1, "fsdp": 1, "data": 1, "pipeline": 2}
    assert step_time.hosts_of(s, 4)["fsdp"] == 2
    assert step_time.hosts_of(s, 4, {"fsdp": 1})["fsdp"] == 1


def test_a_pipeline_pays_its_bubble_and_1f1b_matches_gpipe():
    config = load_config("bench_1b")
    apply_overrides(config, ["parallel.pipeline_microbatches=8", "train.batch_size=64"])
    gpipe = step_time.predict(config, "h100", mesh_shape={"pipeline": 4})
    assert gpipe.bubble_fraction == pytest.approx(3 / 11)
    apply_overrides(config, ["parallel.pipeline_schedule=circular", "parallel.pipeline_repeats=2"])
    circular = step_time.predict(config, "h100", mesh_shape={"pipeline": 4})
    assert circular.bubble_fraction == pytest.approx(3 / 19) and circular.bubble_s < gpipe.bubble_s


# --------------------------------------------------------------------------- bytes against the compiler

CPU_LAYOUTS = {
    "fsdp4": {"mesh.fsdp": 4},
    "tensor2_fsdp2": {"mesh.tensor": 2, "mesh.fsdp": 2},
    "tensor4": {"mesh.tensor": 4},
    "data2_fsdp2": {"mesh.data": 2, "mesh.fsdp": 2},
}


def cpu_view(pred: step_time.StepTime, layers: int) -> dict[str, float]:
    """The analytic bytes in the form XLA's CPU compiler emits them, which differs from GPUs in two ways:
    - a reduce-scatter is an all-reduce of the whole array (then a slice), and the gradient reductions
      over several batch axes are one all-reduce over all of them: the whole gradients once;
    - the backward pass reduces q's, k's and v's input gradients over `tensor` apart (six activation
      all-reduces a layer; GPUs' HLO has four, the two H100s' section of docs/benchmarks.md counts 70
      for 16 layers)."""
    out: dict[str, float] = {}
    grads = 0.0
    for c in pred.collectives:
        if c.what.startswith("gradients"):
            # A reduce-scatter returns 1/n of the array and sends (n-1)/n of it: the array is their sum.
            whole = c.result_bytes + c.wire_bytes if c.kind == "reduce-scatter" else c.result_bytes
            grads = max(grads, whole)
        elif c.axis == "tensor" and c.kind == "all-reduce":
            out["all-reduce"] = out.get("all-reduce", 0.0) + c.result_bytes * (6 * layers + 2) / (4 * layers + 2)
        else:
            out[c.kind] = out.get(c.kind, 0.0) + c.result_bytes
    if grads:
        out["all-reduce"] = out.get("all-reduce", 0.0) + grads
    return out


def small(**mesh):
    return small_config(**{"model.vocab_size": 512, "model.d_model": 256, "model.n_layers": 4, "model.n_heads": 8,
                           "model.n_kv_heads": 4, "model.d_ff": 512, "train.seq_len": 128, "train.batch_size": 8,
                           "parallel.reshard_after_forward": False, **mesh})


@pytest.mark.parametrize("name", ["fsdp4", pytest.param("tensor2_fsdp2", marks=pytest.mark.slow),
                                  pytest.param("tensor4", marks=pytest.mark.slow),
                                  pytest.param("data2_fsdp2", marks=pytest.mark.slow)])
def test_analytic_bytes_match_the_compiled_step(name):
    """Per kind, within 20% of `collectives_per_step` on 8 simulated CPU devices (float32, as the CPU
    compiler moves even bfloat16 collectives). Not compared: sequence parallelism (the CPU compiler
    lowers some of its all-gather / reduce-scatter pairs as all-reduces) and the ring (CPU runs XLA
    blocks differentiated by autodiff, a different program from the GPUs' fused blocks)."""
    mesh = CPU_LAYOUTS[name]
    devices = 1
    for size in mesh.values():
        devices *= size
    setup = ushard.build(small(**mesh), devices=jax.devices()[:devices])
    compiled = {k: b for k, (_, b) in collectives_per_step(compile_train_step(setup).as_text()).items()}
    analytic = cpu_view(step_time.predict(setup, "h100"), setup.model_config.n_layers)
    assert set(analytic) == set(compiled), (analytic, compiled)
    for kind, size in compiled.items():
        assert analytic[kind] == pytest.approx(size, rel=0.2), (kind, analytic, compiled)


@pytest.mark.parametrize("hardware,split,kinds", [("h200", "experts", {"all-gather", "reduce-scatter"}),
                                                  ("v5p", "experts", {"all-to-all"}),
                                                  ("v5p", "width", {"all-gather", "reduce-scatter"})])
def test_the_ragged_dispatchs_auto_exchange_is_each_platforms(hardware, split, kinds):
    """`model.moe.exchange=auto` is costed as what it runs on each platform (parallel/expert.py's
    AUTO_EXCHANGE): the all-gather exchange on GPUs, XLA's ragged all-to-all on TPUs; the experts'
    width split (parallel.expert_split="width") gathers and reduce-scatters on any platform."""
    config = load_config("bench_moe")
    apply_overrides(config, ["model.moe.dispatch=ragged", "train.batch_size=32", f"parallel.expert_split={split}"])
    predicted = step_time.predict(config, step_time.hardware(hardware, devices_per_host=4),
                                  mesh_shape={"expert": 4})
    exchanges = {"all-gather", "reduce-scatter", "all-to-all"}  # the expert axis also sums the dense weights' gradients
    assert {c.kind for c in predicted.collectives if c.axis == "expert"} & exchanges == kinds


def test_split_experts_wait_for_the_busiest_device_and_split_widths_do_not():
    """With `mesh.expert` splitting the experts the step pays the busiest device's extra rows
    (`Efficiency.expert_imbalance`); with their width split (or on one device) every device's share
    is even. The two exchanges move the same bytes, so the difference is that term alone."""
    config = load_config("bench_moe")
    apply_overrides(config, ["model.moe.dispatch=ragged", "model.moe.exchange=all_gather", "train.batch_size=32"])
    hw = step_time.hardware("h200", devices_per_host=4)
    split = step_time.predict(config, hw, mesh_shape={"expert": 4})
    apply_overrides(config, ["parallel.expert_split=width"])
    width = step_time.predict(config, hw, mesh_shape={"expert": 4})
    one = step_time.predict(config, hw, mesh_shape={"fsdp": 4})
    extra = split.compute_parts.pop("busiest expert device")
    padding = width.compute_parts.pop("expert width padding")  # bench_moe's 704 columns a device run as 768
    assert extra > 0.1 * split.step_s and 0 < padding < extra
    assert "busiest expert device" not in width.compute_parts and "busiest expert device" not in one.compute_parts
    assert split.compute_parts == width.compute_parts
    assert split.step_s - width.step_s == pytest.approx(extra - padding, rel=0.01)


def test_the_ring_moves_latent_attentions_latent_not_its_heads():
    """What a ring transfer of the step-time model holds a token (`AttentionShape.context_numbers`):
    the keys and values of the device's KV heads (llama3_8b at tensor=2: 4 heads x (128 + 128)), or
    for latent attention its latent and RoPE key (deepseek_v3: 512 + 64 numbers, whole on every
    tensor rank) instead of its 64 heads' keys and values (64 x (192 + 128))."""
    hw = step_time.hardware("h200", devices_per_host=8)
    mesh = {"sequence": 4, "tensor": 2}

    def per_token(name, *overrides):
        config = load_config(name)
        apply_overrides(config, list(overrides))
        ring = next(c for c in step_time.predict(config, hw, mesh_shape=mesh).collectives
                    if c.axis == "sequence" and c.kind == "collective-permute")
        s = step_time.shape_of(config, mesh)
        return ring.result_bytes / ring.count / (step_time._rows_per_device(s) * s.seq / 4 * s.compute_bytes)

    assert per_token("llama3_8b") == 4 * (128 + 128)
    assert per_token("deepseek_v3", "model.n_layers=4") == 512 + 64
