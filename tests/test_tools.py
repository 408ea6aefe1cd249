"""tools/: kernels of a profiled step attributed to HLO instructions (hlo_ops.py); the transfers a
schedule lets overlap compute (permute_schedule.py); the matmuls whose ceilings tools/ceilings.py
measures; the pipeline schedule drawn by tools/pipeline_schedule.py; the ring-transfer probe
(tools/p2p_overlap.py); bench.py's refusal of a variant without a label."""

import json
import os
import subprocess
import sys

import jax
import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)

import ceilings  # noqa: E402
import permute_schedule  # noqa: E402
import pipeline_schedule  # noqa: E402
from hlo_ops import HloOps, kernel_class  # noqa: E402

# A scheduled module in the form `compiled.as_text()` prints on GPUs: a Triton GEMM fusion, a cuBLAS call
# (whose kernels bear cuBLAS's names, not the instruction's) and an elementwise fusion.
MODULE = """HloModule jit_f, is_scheduled=true

%gemm_fusion_dot.1_computation (parameter_0: bf16[64,32], parameter_1: bf16[32,16]) -> bf16[64,16] {
  %parameter_0 = bf16[64,32]{1,0} parameter(0)
  %parameter_1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/jvp()/ab,bc->ac/dot_general"}
}

ENTRY %main.9 (p0: bf16[64,32], p1: bf16[32,16], p2: bf16[48,32]) -> bf16[64,48] {
  %p0 = bf16[64,32]{1,0} parameter(0), metadata={op_name="p0"}
  %p1 = bf16[32,16]{1,0} parameter(1), metadata={op_name="p1"}
  %p2 = bf16[48,32]{1,0} parameter(2), metadata={op_name="p2"}
  %gemm_fusion_dot.1 = bf16[64,16]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%gemm_fusion_dot.1_computation, metadata={op_name="jit(f)/jvp()/ab,bc->ac/dot_general"}
  %custom-call.2 = (bf16[64,48]{1,0}, s8[1024]{0}) custom-call(%p0, %p2), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/transpose(jvp())/ab,cb->ac/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["1"]}}}
  %get-tuple-element.3 = bf16[64,48]{1,0} get-tuple-element(%custom-call.2), index=0
  %loop_add_fusion.4 = bf16[64,48]{1,0} fusion(%get-tuple-element.3), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/add"}
  ROOT %loop_select_fusion.5 = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, /*index=5*/f32[4]{0}) fusion(%p0), kind=kLoop, calls=%fused_select, metadata={op_name="jit(f)/select_n"}
}
"""  # noqa: E501  (HLO lines as XLA prints them)


def test_matmul_flops_from_the_contracted_dimension():
    ops = HloOps(MODULE)
    assert ops.flops == {"gemm_fusion_dot.1": 2 * 64 * 16 * 32, "custom-call.2": 2 * 64 * 48 * 32}
    assert ops.library_calls == [("custom-call.2", "__cublas$lt$matmul")]


def test_kernels_attributed_by_name_and_library_kernels_by_schedule_order():
    # Two steps; times in microseconds.
    kernels = []
    for step in range(2):
        t = 1000 * step
        kernels += [
            {"name": "gemm_fusion_dot_1", "ts": t, "dur": 100},
            {"name": "nvjet_sm90_tst_128x128", "ts": t + 200, "dur": 300},
            {"name": "loop_add_fusion_4", "ts": t + 600, "dur": 50},
        ]
    times = HloOps(MODULE).attribute(kernels, steps=2)
    assert {name: round(ms, 6) for name, (ms, _, _) in times.items()} == {
        "gemm_fusion_dot.1": 0.1, "custom-call.2": 0.3, "loop_add_fusion.4": 0.05,
    }
    assert times["custom-call.2"][1] == 1.0  # one launch per step
    # The cuBLAS call again, as fast as 2*64*48*32 FLOP in 0.5 ns: 393 TFLOP/s, its group's line first.
    fast = [dict(e, dur=0.0005) if e["name"].startswith("nvjet") else dict(e, dur=0.0001) for e in kernels]
    first_line = HloOps(MODULE).table(fast, steps=2, top=5)[1].split()
    assert first_line[1:4] == ["1", "393", "transpose(jvp())/ab,cb->ac/dot_general"], first_line


def test_kernel_classes_by_the_names_a_gpu_profile_shows():
    # Names from an H200 profile of bench_1b: every Mosaic GPU kernel launches under one name.
    assert kernel_class("entry_mosaic_gpu_kernel") == "pallas"
    assert kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3") == "attention"
    assert kernel_class("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT") == "matmul"
    assert kernel_class("loop_convert_fusion_15") == "other"


def test_tuple_shapes_past_five_elements_and_trace_op_names_are_read():
    ops = HloOps(MODULE)
    assert ops.op_name["loop_select_fusion.5"] == "jit(f)/select_n"  # XLA prints /*index=5*/ inside
    events = [{"name": "some_kernel", "ts": 0, "dur": 40, "args": {"hlo_op": "loop_select_fusion.5"}}]
    assert dict(ops.attribute(events, steps=1))["loop_select_fusion.5"][0] == 0.04


def test_cublas_kernels_that_do_not_match_the_calls_keep_their_names(capsys):
    # Two kernels for one call in one step (a split-K reduction, say): no guessing which is which.
    events = [{"name": "nvjet_a", "ts": 0, "dur": 10}, {"name": "nvjet_b", "ts": 20, "dur": 10}]
    assert set(HloOps(MODULE).attribute(events, steps=1)) == {"nvjet_a", "nvjet_b"}
    assert "2 cuBLAS kernels for 1 calls" in capsys.readouterr().err


PERMUTES = """HloModule m, is_scheduled=true

%matmul (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8] parameter(0)
  ROOT %d = f32[8,8] dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8] parameter(0)
  %beside = (f32[8,8], f32[8,8], u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %mm = f32[8,8] fusion(%x), kind=kOutput, calls=%matmul
  %got = f32[8,8] collective-permute-done(%beside)
  %alone = (f32[8,8], f32[8,8], u32[], u32[]) collective-permute-start(%got), source_target_pairs={{0,1},{1,0}}
  %sum = f32[8,8] add(%mm, %mm)
  %got2 = f32[8,8] collective-permute-done(%alone)
  ROOT %out = f32[8,8] add(%got2, %sum)
}
"""


def test_a_permute_counts_as_beside_compute_when_a_matmul_runs_between_its_start_and_done(tmp_path, capsys):
    # An elementwise add is not compute that hides a transfer.
    assert permute_schedule.permutes_beside_compute(PERMUTES) == (1, 2)
    (tmp_path / "step.hlo.txt").write_text(PERMUTES)
    permute_schedule.main([str(tmp_path / "step.hlo.txt")])
    assert capsys.readouterr().out == (
        "collective-permutes with compute scheduled between start and done: 1 of 2 in the program's text\n")


@pytest.mark.parametrize("fused", [False, True])
def test_ceilings_times_every_matmul_of_the_model(fused):
    from conftest import small_config
    from ushard.models.config import ModelConfig
    from ushard.models.definition import ModelDef

    cfg = small_config(**{"model.fused_mlp": fused, "model.n_kv_heads": 2}).model
    per_layer = sum(k * n for _, k, n in ceilings.layer_matmuls(cfg))
    matmul_params = ModelDef(ModelConfig.from_config(cfg)).num_matmul_params()
    assert cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size == matmul_params
    out_shapes = {}
    for form, ((lhs, rhs), (lhs_c, rhs_c)) in ceilings.matmul_forms(tokens=8, k=3, n=5).items():
        dims = ((lhs_c, rhs_c), ((), ()))
        operands = jax.ShapeDtypeStruct(lhs, "float32"), jax.ShapeDtypeStruct(rhs, "float32")
        out_shapes[form] = jax.eval_shape(lambda a, b, d=dims: jax.lax.dot_general(a, b, d), *operands).shape
    # activations [tokens, n], their gradient [tokens, k], the weight's gradient [k, n]
    assert out_shapes == {"forward": (8, 5), "input grad": (8, 3), "weight grad": (3, 5)}


def test_pipeline_schedule_cells_say_which_microbatch_each_stage_runs():
    cells = pipeline_schedule.schedule_cells
    # 1F1B: the last stage turns each microbatch round within its tick
    assert cells("1f1b", 2, 2) == [[["F0"], ["F1"], ["B0"], ["B1"]], [[], ["F0", "B0"], ["F1", "B1"], []]]
    # GPipe: the forward loop, then autodiff's backward over the same ticks in reverse
    assert cells("gpipe", 2, 2) == [[["F0"], ["F1"], [], [], ["B1"], ["B0"]], [[], ["F0"], ["F1"], ["B1"], ["B0"], []]]
    assert cells("circular", 2, 2, 2)[0][:4] == [["F0.0"], ["F1.0"], ["F0.1"], ["F1.1"]]


def test_pipeline_schedule_draws_what_a_config_chose(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "schedule.png"
    pipeline_schedule.main(["--config", "tiny", "--config.mesh.pipeline=4", "--config.parallel.pipeline_schedule=1f1b",
                            "--microbatches", "16", "--out", str(out)])
    assert "1f1b: 4 stages, 16 microbatches\nbubble 15.8%; a stage holds up to 7 " in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_a_variant_without_a_label():
    """A --variant without LABEL= is one sentence and exit 2 (it was a traceback), before any run starts."""
    bench = os.path.join(TOOLS, "bench.py")
    result = subprocess.run([sys.executable, bench, "--variant", "fsdp2"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "has no label" in result.stderr and "Traceback" not in result.stderr


def test_p2p_overlap_times_a_ring_of_every_device():
    import p2p_overlap

    r = p2p_overlap.measure(rows=1, tokens=16, heads=2, head_dim=8, hops=2, matmul=16)
    assert r["devices"] == len(jax.devices()) > 1
    for key in ("ppermute_ms", "ppermute_gb_s", "two_way_gb_s", "matmul_ms", "both_ms", "all_gather_gb_s"):
        assert 0 < r[key] < float("inf"), key
    assert abs(r["hidden"]) < float("inf")


def test_p2p_overlap_runs_as_one_process_per_device():
    """`--processes 2`: two local processes joined by jax.distributed make one ring of their devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "p2p_overlap.py"), "--processes", "2", "--rows", "1",
                          "--tokens", "16", "--heads", "2", "--head-dim", "8", "--hops", "2", "--matmul", "16"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 devices in 2 process(es): ppermute" in out.stdout


def test_p2p_overlap_in_torch_makes_a_ring_where_each_device_gets_its_neighbours_block():
    """The PyTorch peer of the probe, as 3 CPU processes (gloo): it exits non-zero if any device receives
    another block than its previous neighbour's."""
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "p2p_overlap_torch.py"), "--cpu", "3", "--rows", "1",
                          "--tokens", "16", "--heads", "2", "--head-dim", "8", "--hops", "2", "--matmul", "16"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("3 devices, gloo send/recv ring, one process each: ")


@pytest.mark.slow  # the suite's time; one-process variants are in the default tier
def test_bench_runs_a_variant_as_one_process_per_device():
    """`--processes 2`: the variant trains as two processes of one device each, and process 0 reports
    a step over both (tokens/s of the global batch)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "bench.py"), "--config", "configs/tiny.py",
                          "--steps", "1", "--warmup", "1", "--processes", "2",
                          "--variant", "fsdp2=--config.mesh.fsdp=2"],
                         cwd=os.path.dirname(TOOLS), env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert result["name"] == "fsdp2" and "error" not in result
    assert result["devices"].startswith("2 x ") and result["tokens_per_s"] > 0


@pytest.mark.slow  # the suite's time
def test_plan_check_times_the_layouts_the_planner_recommends():
    """tools/plan_check.py: the planner's first choice for two devices, timed by bench.py beside its prediction."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "plan_check.py"), "--config", "configs/tiny.py",
                          "--hardware", "h100", "--top", "1", "--steps", "1", "--warmup", "1"],
                         cwd=os.path.dirname(TOOLS), env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("plan1"))
    predicted, measured = (float(x) for x in row.split()[1:3])
    assert predicted > 0 and measured > 0 and "--config.mesh.fsdp=" in row


def test_attention_bench_runs_each_kernel_and_sweep_on_tiny_shapes(monkeypatch, capsys):
    """tools/attention_bench.py's code paths (the device check of ours, the timings, every kernel's
    block sweep) on a tiny shape, ours in Pallas's interpreter: a GPU call must not be the first to
    run them."""
    import attention_bench
    from ushard.kernels import flash

    monkeypatch.setitem(attention_bench.SHAPES, "tiny", (1, 128, 2, 1, 64))
    monkeypatch.setitem(flash.TUNING, 64, flash.Tuning(*(flash.Blocks(32, 32, 4, 1),) * 3))
    monkeypatch.setattr(attention_bench, "SWEEP", {k: [(32, 64, 4, 1)] for k in attention_bench.SWEEP})
    monkeypatch.setattr(attention_bench, "timed", lambda fn, *args, **_: (jax.block_until_ready(fn(*args)), 1e-3)[1])
    rows = attention_bench.bench("tiny", 2, ["xla", "ours"], sweep=True)
    printed = capsys.readouterr().out
    assert printed.count("-> ok") == 1  # ours against float32 attention
    assert [r[1] for r in rows][:2] == ["xla", "ours"]
    assert sum("best" in r[1] for r in rows) == 3 and len(rows) == 2 + 3  # a best per swept kernel
    # On Hopper the sweep also times the Mosaic GPU backward kernels' candidates (stand-ins here).
    calls = []
    for module, kernel in ((attention_bench.flash_hopper, "forward"), (attention_bench.flash_hopper_backward, "dkdv"),
                           (attention_bench.flash_hopper_backward, "dq")):
        monkeypatch.setattr(module, kernel,
                            lambda *args, kernel=kernel, **options: calls.append((kernel, options)) or args[0])
    monkeypatch.setattr(attention_bench, "on_hopper", lambda q, k: True)
    attention_bench.bench("tiny", 0, ["ours"], sweep=True)
    sizes = {kernel: len(candidates) for kernel, candidates in attention_bench.HOPPER_SWEEP.items()}
    assert [c[0] for c in calls] == [kernel for kernel, n in sizes.items() for _ in range(n)]
    assert capsys.readouterr().out.count("sweep mosaic") == sum(sizes.values())


@pytest.mark.slow  # the suite's time: the tool's run of each kernel and sweep is the default tier's
def test_attention_bench_adopts_the_swept_blocks_with_a_window_and_checks_them(monkeypatch, capsys):
    """--block-sweep --adopt-sweep's path (a window, documents): the sweep's three bests become the
    tuning of the rest of the run, checked against float32 and timed as a row of their own, and
    later cases time the shipped blocks (`ours_table`) beside them."""
    import attention_bench
    from ushard.kernels import flash

    monkeypatch.setitem(attention_bench.SHAPES, "tiny", (1, 128, 2, 1, 64))
    monkeypatch.setitem(flash.TUNING, 64, flash.Tuning(*(flash.Blocks(32, 32, 4, 1),) * 3))
    monkeypatch.setattr(attention_bench, "TABLE", dict(flash.TUNING))
    monkeypatch.setattr(attention_bench, "SWEEP", {k: [(32, 64, 4, 1)] for k in attention_bench.SWEEP})
    monkeypatch.setattr(attention_bench, "timed", lambda fn, *args, **_: (jax.block_until_ready(fn(*args)), 1e-3)[1])
    rows = attention_bench.bench("tiny", 2, ["ours", "ours_table"], sweep=True, window=48, adopt=True)
    assert flash.TUNING[64] == flash.Tuning(*(flash.Blocks(32, 64, 4, 1),) * 3)
    assert [r[1] for r in rows][0] == "ours" and rows[-1][0].endswith("(swept blocks)") and len(rows) == 1 + 3 + 1
    assert capsys.readouterr().out.count("-> ok") == 2  # the shipped blocks, then the swept ones
    rows = attention_bench.bench("tiny", 2, ["ours", "ours_table"], sweep=False, check=False, adopt=True)
    assert [r[1] for r in rows] == ["ours", "ours_table"]
    assert capsys.readouterr().out.count("-> ok") == 1  # adopted blocks are checked even without check


def test_attention_bench_mosaic_256_times_each_block_shape_against_triton(monkeypatch, capsys):
    """--mosaic-256's path with a stand-in for the Mosaic GPU forward: a line per candidate, its out
    compared with the Triton forward's (here the same kernel: error 0)."""
    import attention_bench
    from ushard.kernels import flash

    monkeypatch.setitem(attention_bench.SHAPES, "tiny", (1, 128, 2, 1, 256))
    monkeypatch.setitem(flash.TUNING, 256, flash.Tuning(*(flash.Blocks(32, 32, 4, 1),) * 3))
    monkeypatch.setattr(attention_bench, "MOSAIC_256", [(64, 32, 2), (64, 64, 1)])
    monkeypatch.setattr(attention_bench, "timed", lambda fn, *args, **_: (jax.block_until_ready(fn(*args)), 1e-3)[1])

    def stand_in(q, k, v, causal, q_segments, k_segments, *, blocks, window):
        return flash.forward(q, k, v, causal, q_segments, k_segments, window, tuning=flash.TUNING[256])

    monkeypatch.setattr(attention_bench.flash_hopper, "forward", stand_in)
    attention_bench.mosaic_256("tiny", 2, 48)
    printed = capsys.readouterr().out
    assert printed.count("out vs triton 0.0e+00") == 2, printed


def test_attention_bench_under_load_times_each_kernel_after_a_matmul_and_sustained(monkeypatch):
    """--under-load's path on a tiny shape (ours interpreted): a row per kernel that runs here, the
    matmul's time taken out of the loaded one, the sustained rounds' first and last."""
    import attention_bench
    from ushard.kernels import flash

    monkeypatch.setitem(attention_bench.SHAPES, "tiny", (1, 128, 2, 1, 64))
    monkeypatch.setitem(flash.TUNING, 64, flash.Tuning(*(flash.Blocks(32, 32, 4, 1),) * 3))
    times = iter([1.0e-3, 2.0e-3, 3.5e-3, 4.0e-3, 6.0e-3])  # matmul; xla alone, loaded; ours alone, loaded
    monkeypatch.setattr(attention_bench, "timed",
                        lambda fn, *args, **_: (jax.block_until_ready(fn(*args)), next(times))[1])
    rows = attention_bench.under_load("tiny", ["xla", "cudnn_rows", "ours"], matmul_size=64, calls=2, rounds=2)
    assert [r[1] for r in rows] == ["xla", "ours"]  # cuDNN's rows need documents: skipped
    assert [round(r[2], 3) for r in rows] == [2.0, 4.0] and [round(r[3], 3) for r in rows] == [2.5, 5.0]
    assert all(r[4] > 0 and r[5] > 0 for r in rows)


def test_attention_check_passes_our_kernels_and_fails_a_wrong_one(monkeypatch, capsys):
    """tools/attention_check.py on tiny cases (ours in Pallas's interpreter): within tolerance, and a
    kernel whose gradients are off by 5% is caught with a non-zero exit."""
    import attention_check
    from ushard.kernels import flash

    monkeypatch.setitem(flash.TUNING, 64, flash.Tuning(*(flash.Blocks(32, 32, 4, 1),) * 3))
    monkeypatch.setattr(attention_check, "CASES", {"ragged, grouped": (1, 128, 2, 1, 64, True, "ragged"),
                                                   "not causal": (1, 128, 2, 2, 64, False, None)})
    assert attention_check.main([]) == 0
    assert capsys.readouterr().out.count("-> ok") == 2

    right = flash.attention

    @jax.custom_vjp
    def scaled(x):
        return x

    scaled.defvjp(lambda x: (x, None), lambda _, g: (1.05 * g,))
    monkeypatch.setattr(flash, "attention", lambda q, *a: right(scaled(q), *a))
    assert attention_check.main([]) == 1
    assert "cases beyond" in capsys.readouterr().out
