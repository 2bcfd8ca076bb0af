"""Serving's measurement: a step's bytes and FLOPs against a hand count for micro, int8 weight-only, the
serve-bench and profile commands. No timing is asserted: the figures live in docs/serving.md."""

import itertools
import json
from dataclasses import asdict

import pytest
import torch
from conftest import needs_kernels
from test_engine import run_cli  # noqa: F401  (the fixture)
from test_gemma3 import needs_model as needs_gemma3

from model.engine.llama import packed_weights
from model.engine.lowbit import with_weights
from model.errors import InputError
from model.serving import analysis, costs, measure, workload
from model.serving.costs import matmul_params, weight_bytes
from model.serving.engine import Engine, EngineSettings
from model.serving.request import Request


@needs_kernels
def test_step_bytes_and_flops_are_the_hand_count_for_micro(micro):
    """micro: hidden 8, MLP 16, 2 layers, 2 query heads over 1 KV head, d_head 4, vocabulary 8, LM head untied.
    Matmul weights per layer q 8×8 + k 8×4 + v 8×4 + o 8×8 + gate, up, down 8×16 each = 576; two layers and the
    LM head 8×8: 1216 weights. Packed for the decode kernels in blocks of 16 outputs, a step reads per layer q, k, v
    in one 16×8 product, o padded to 16×8, gate and up 32×8, down padded to 16×16 (768 weights), and the head padded
    to 16×8: 1664 weights, 6656 B in float32. Norms 2 × 8 per layer + 8 final = 40 × 4 = 160 B; one embedding row
    32 B per row. A cached position is 64 B (2 × 2 layers × 1 × 4 × 4 B)."""
    module = micro.module
    assert matmul_params(module) == 1216
    assert weight_bytes(module, 1) == 6656 + 160 + 32
    # two requests: prompts [1, 3] (2 positions, 3 after its first decode) and [1, 3, 4, 5] (4, then 5)
    requests = [Request(0, [1, 3], 2), Request(1, [1, 3, 4, 5], 2)]
    server = workload.slot_engine(micro, requests, 2)
    first = server.step()                       # both prefilled, each in a pass of its own over its N × N keys
    assert [p.positions for p in first.passes] == [2, 4]
    # the layers' 1152 matmul weights for each of the 6 positions, the LM head's 64 on each prompt's last one
    assert sum(costs.prefill_counts(micro, p.positions)[1] for p in first.passes) == \
        2 * 1152 * 6 + 2 * 64 * 2 + 4 * 2 * 2 * 4 * (2 * 2 + 4 * 4)
    second = server.step()                      # one decode row each over 3 and 5 keys
    decode_flops, decode_bytes = analysis.decode_counts(server, second.passes[0])
    assert decode_flops == 2 * (2 * 1216) + 4 * 2 * 2 * 4 * (3 + 5)                # 5376
    assert decode_bytes == 6656 + 160 + 2 * 32 + 3 * 64 + 5 * 64                 # 7392


def test_positions_to_pass_is_the_fewest_whose_prefill_reaches_the_ridge(small):
    """The Serving page's sentence on the prefill point: the smallest n whose prefill's FLOPs per byte (the
    counting formulas) reach the ridge, by brute force over small's context; None past every prefill it can do."""
    intensities = [costs.prefill_intensity(small, n) for n in range(1, small.info.context_length + 1)]
    assert all(a < b for a, b in itertools.pairwise(intensities))  # the search relies on it growing with n
    for ridge in (intensities[0], 3.0, intensities[40], intensities[-1]):
        assert costs.positions_to_pass(small, ridge) == next(n + 1 for n, i in enumerate(intensities)
                                                                   if i >= ridge)
    assert costs.positions_to_pass(small, intensities[-1] * 1.01) is None


@needs_kernels
def test_int8_weights_are_a_quarter_and_close(small):
    """int8 packs every matrix once in int8 (q, k, v in one product, gate and up in one, the tied head whose rows the
    embedding reads), a quarter of the bytes; each weight within half a step of its output's scale."""
    int8 = with_weights(small, "int8")
    products = packed_weights(int8.module)
    assert len(products) == 4 * 4 + 1 and all(p.matrix.flat.dtype == torch.int8 for p in products)
    assert all(p.matrix.flat.dtype == torch.float32 for p in packed_weights(small.module))  # the shared model untouched
    assert int8.module.model.embed_tokens.packed is int8.module.lm_head.packed
    float32_bytes, int8_bytes = weight_bytes(small.module, 1), weight_bytes(int8.module, 1)
    assert int8_bytes <= 0.3 * float32_bytes
    # per output channel: each row dequantises to within half a step of its own scale
    original, quantized = small.module.model.layers[0].mlp.up_proj, int8.module.model.layers[0].mlp.up_proj
    scale = quantized.packed.matrix.scale[quantized.packed.outputs[0]:][:quantized.out_features, None]
    assert bool(((quantized.dense_weight() - original.dense_weight()).abs() <= scale / 2 + 1e-7).all())
    accuracy = measure.accuracy(small, int8, "int8")
    assert accuracy.greedy_total == measure.ACCURACY_PROMPTS * measure.ACCURACY_NEW_TOKENS
    assert 0 < accuracy.max_abs_logit_diff < 1 and accuracy.agreement >= 0.9


@needs_kernels
@pytest.mark.parametrize(("weights", "kv"), [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                             ("int8", torch.float32)])
def test_the_pool_holds_the_models_kv_dtype_named_on_its_info(weights, kv, small):
    """int8 weights keep float32 activations and cache; bfloat16 weights make all of them bfloat16. The pool's dtype
    is that named fact (ModelInfo.kv_dtype), not read off the stand-in that packing leaves for a weight."""
    model = with_weights(small, weights)
    assert model.info.kv_dtype == str(kv).removeprefix("torch.") and model.kv_dtype == kv
    server = Engine(model, [Request(0, [1, 5, 73], 2)], EngineSettings(budget_bytes=2**20))
    assert server.cache.keys.dtype == server.cache.values.dtype == kv


def test_unknown_dtype_and_a_bad_batch_are_one_sentence(small):
    with pytest.raises(InputError) as unknown:
        with_weights(small, "int4")
    assert unknown.value.code == "unknown_dtype" and "int8" in unknown.value.message("en")
    with pytest.raises(InputError) as zero:
        measure.checked_batch(small, 0, 64)
    assert zero.value.code == "serving_slots"


@needs_kernels
def test_serve_bench_json_has_a_row_per_setting(run_cli):  # noqa: F811
    out = run_cli("serve-bench", "--model", "micro", "--batch", "1,2", "--context", "4,8", "--dtype",
                  "float32,int8", "--steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = report["rows"]
    assert [(r["dtype"], r["context"], r["batch"]) for r in rows] == [
        (d, c, b) for d in ("float32", "int8") for c in (4, 8) for b in (1, 2)]
    for r in rows:
        assert set(r) >= {"batch", "context", "dtype", "step_ms", "tokens_per_s", "bytes_read", "achieved_gb_s",
                          "flops", "machine_gb_s"}
        assert set(r["step_ms"]) == {"p50", "p95", "p99"}
    assert report["machine"]["copy_gb_s"] > 0 and report["machine"]["matmul_gflops"] > 0
    assert report["accuracy"][0]["dtype"] == "int8"


def test_serve_bench_samples_with_its_flags(run_cli):  # noqa: F811
    out = run_cli("serve-bench", "--model", "micro", "--batch", "2", "--context", "4", "--dtype", "float32",
                  "--steps", "2", "--temperature", "0.8", "--top-k", "3", "--top-p", "0.9", "--seed", "4", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["sampling"] == {"temperature": 0.8, "top_k": 3, "top_p": 0.9, "seed": 4}
    assert "sampled (temperature 0.8, top-k 3, top-p 0.9, row r with seed 4 + r)" in report["conditions"]
    bad = run_cli("serve-bench", "--model", "micro", "--top-p", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


@needs_gemma3
def test_serve_bench_runs_gemma3_with_its_sliding_layers(run_cli):  # noqa: F811
    """Gemma 3 270M at 600 positions, past its 512-position window: a row's cache bytes are 3 full layers × 601 +
    15 sliding layers × 512 positions of 2,048 B; its attention FLOPs 4 × 4 heads × 256 × (3 × 601 + 15 × 512)."""
    out = run_cli("serve-bench", "--model", "gemma3", "--batch", "1,2", "--context", "600", "--dtype", "float32",
                  "--steps", "1", "--json")
    assert out.returncode == 0, out.stderr
    one, two = json.loads(out.stdout)["rows"]
    assert two["bytes_read"] - one["bytes_read"] == (3 * 601 + 15 * 512) * 2048 + 640 * 4  # and one embedding row
    assert two["flops"] - one["flops"] == one["flops"] and one["bytes_read"] > 0


def test_serve_bench_refuses_an_unknown_dtype(run_cli):  # noqa: F811
    out = run_cli("serve-bench", "--model", "micro", "--dtype", "float32,fp4")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "fp4" in out.stderr


def test_serve_bench_refuses_an_unknown_dtype_naming_dtype_before_the_model_loads(capsys, monkeypatch):
    """faults 2026-12-04 #17: `serve-bench --dtype foo` loaded the model first (seconds for a real one, a model
    that cannot load said instead), then refused foo."""
    from model.tools import cli, serve_bench

    loads = []
    monkeypatch.setattr(serve_bench, "load_model", lambda *args, **kwargs: loads.append(args))
    code = cli.main(["serve-bench", "--model", "no-such-model", "--dtype", "foo"])
    err = capsys.readouterr().err
    assert code == 2 and loads == [] and err.count("\n") == 1
    assert err.startswith("--dtype: unknown number format foo; pick one of: float32, bfloat16, bfloat16-weights, "
                          "int8"), err


def test_profile_writes_a_chrome_trace(run_cli, tmp_path):  # noqa: F811
    trace = tmp_path / "trace.json"
    out = run_cli("profile", "--model", "small", "--steps", "2", "--batch", "2", "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name", "").startswith("decode step") for e in events) == 2
    assert "aten::" in out.stdout


def test_low_bits_and_batching_need_the_native_llama(small):
    """A model on transformers (here a stand-in with only its facts) has no native path for int8, nor for batching."""
    class OnTransformers:
        info = small.info
    with pytest.raises(InputError) as low:
        with_weights(OnTransformers(), "int8")
    assert low.value.code == "lowbit_needs_native"
    with pytest.raises(InputError) as batched:
        measure.checked_batch(OnTransformers(), 2, 16)
    assert batched.value.code == "serving_needs_native"


def test_on_a_gpu_the_ops_are_ranked_and_timed_by_their_time_on_the_device():
    """op_shares: on a GPU the kernels and copies rank and time the table by their own time on the device (an op's
    CPU time there is its launch), as torch's table adds them up, the CPU's events and the step marks left out; on
    a CPU, every op by its own CPU time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device_type, cpu_us, device_us, count, annotation=False):
        return SimpleNamespace(key=key, device_type=device_type, is_user_annotation=annotation,
                               self_cpu_time_total=cpu_us, self_device_time_total=device_us, count=count)

    events = [event("aten::mm", DeviceType.CPU, 900, 0, 6), event("cudaLaunchKernel", DeviceType.CPU, 600, 0, 9),
              event("gemv_kernel", DeviceType.CUDA, 0, 3000, 6), event("copy_kernel", DeviceType.CUDA, 0, 1000, 3),
              event("decode step 0", DeviceType.CUDA, 0, 4000, 1, annotation=True),
              event("decode step 0", DeviceType.CPU, 1600, 0, 1, annotation=True)]
    on_gpu = [(o.name, o.ms_per_step, o.share, o.calls_per_step, o.clock)
              for o in measure.op_shares(events, 3, "device")]
    assert on_gpu == [("gemv_kernel", 1.0, 0.75, 2.0, "device"), ("copy_kernel", 1 / 3, 0.25, 1.0, "device")]
    on_cpu = [(o.name, o.share, o.clock) for o in measure.op_shares(events, 3, "cpu")]
    assert on_cpu[:2] == [("aten::mm", 0.6, "cpu"), ("cudaLaunchKernel", 0.4, "cpu")]
    # on a CPU the decode kernels' ops (a decode step's layer, the products) are marks of their own, and kept
    kernel_ops = [event("decode_lab::decode_out", DeviceType.CPU, 3000, 0, 6, annotation=True),
                  event("decode_lab::matmul_float32", DeviceType.CPU, 1000, 0, 3, annotation=True)]
    kernel_ops.append(event("aten::silu", DeviceType.CPU, 1000, 0, 3))
    on_cpu = [(o.name, o.share) for o in measure.op_shares(events[-1:] + kernel_ops, 3, "cpu")]
    assert on_cpu == [("decode_lab::decode_out", 0.6), ("decode_lab::matmul_float32", 0.2), ("aten::silu", 0.2)]


def test_pass_costs_draw_a_line_and_the_estimate_reads_the_queue():
    """Two timed passes of each kind give a straight line (never falling); the estimate's first step prefills the
    queue's first `slots` prompts: seed 0 draws prompts of 8, 7, 6 and 4 from 3 to 9."""
    costs = workload.PassCosts(prefill_ms=(100.0, 400.0), decode_ms=(150.0, 120.0))
    assert [costs.prefill(n) for n in (1, 4, 10)] == [100.0, 400.0, 1000.0]
    assert costs.decode(32) == 150.0
    estimate = workload.estimate_steps(costs, 2, 4, (3, 9), (2, 5))
    assert (estimate.prompts, estimate.positions, estimate.first_ms, estimate.rows, estimate.decode_ms) == \
        (2, 15, 1500.0, 2, 150.0)
    assert workload.estimate_steps(costs, 8, 4, (3, 9), (2, 5)).positions == 8 + 7 + 6 + 4


@needs_kernels
def test_the_roofs_of_int8_weights_are_their_kernels():
    machine = measure.Machine("cpu", 1, 10.0, 12.0, 50.0)
    int8 = measure.with_matmul_peak(machine, "int8")
    assert (int8.copy_gb_s, int8.dtype) == (10.0, "int8") and int8.matmul_gflops > 0
    assert "by 1024×1024 int8 matmul" in int8.how and "1024×1024 float32 matmul" in machine.how


def test_the_sweep_and_the_profiler_report_between_their_passes(small):
    """A caller may stop the sweep or the profiler there (the Serving page's Stop): the sweep reports before each
    measurement, after each layer of its untimed prefill (small: 4) and after each timed step (a warm-up and 2);
    the profiler after the prefill's and the warm-up's layers and after each profiled step."""
    reports = []
    measure.sweep(small, [1, 2], [8], repeats=2, report=lambda *said: reports.append(said))
    assert reports == [(0, 2, 1, 8)] * (1 + 4 + 3) + [(1, 2, 2, 8)] * (1 + 4 + 3)
    ticks = []
    measure.profile_steps(small, 2, 8, 3, tick=lambda: ticks.append(1))
    assert len(ticks) == 4 + 4 + 3


def test_serve_bench_rows_carry_the_read_roof_bench_measures(run_cli, monkeypatch):  # noqa: F811
    """Each row's machine_read_gb_s is timing.read_bandwidth, the function `python -m model bench` calls (pinned here
    to 20 GB/s: a second copy of the measurement would not see the pin), and the text prints achieved / read."""
    from model.serving import measure

    monkeypatch.setattr(measure, "read_bandwidth", lambda device: 20e9)
    out = run_cli("serve-bench", "--model", "micro", "--batch", "1", "--context", "4", "--dtype", "float32",
                  "--steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    [row] = report["rows"]
    assert row["machine_read_gb_s"] == 20.0 == report["machine"]["read_gb_s"]
    text = run_cli("serve-bench", "--model", "micro", "--batch", "1", "--context", "4", "--dtype", "float32",
                   "--steps", "2").stdout
    assert "of read" in text and "20.00 GB/s read" in text


@pytest.mark.parametrize(("flags", "said"), [
    (frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"}),
     dict(avx512_bf16=True, amx_bf16=True, amx_tile=True, avx512_vnni=True, avx_vnni=False)),
    (frozenset({"avx2", "fma", "avx_vnni"}),
     dict(avx512_bf16=False, amx_bf16=False, amx_tile=False, avx512_vnni=False, avx_vnni=True)),
])
def test_the_cpu_features_are_the_flags_linux_lists(flags, said):
    """A Sapphire Rapids' flags and an Alder Lake's, as another machine's /proc/cpuinfo would list them."""
    from model.engine.kernels import cpu_features

    features = asdict(cpu_features(flags))
    assert {k: v for k, v in features.items() if k != "vector"} == said


def test_this_cpus_features_are_read_from_proc_cpuinfo():
    from pathlib import Path

    from model.engine.kernels import cpu_features

    listed = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), None)
    if listed is None:
        pytest.skip("no x86 flags line in /proc/cpuinfo on this machine")
    flags = set(listed.partition(":")[2].split())
    assert cpu_features().avx512_bf16 is ("avx512_bf16" in flags)
    assert cpu_features().avx512_vnni is ("avx512_vnni" in flags)
