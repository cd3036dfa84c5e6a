"""The cost model: sanity of every term's direction, JSON round trip, and one case computed by hand."""

from __future__ import annotations

import pytest

from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy
from atorch.strategy_search.costing.analyser import ActivationStats, BlockStats, LayerStats, ModelStats
from atorch.strategy_search.costing.cost_model import Prediction, predict
from atorch.strategy_search.costing.hardware import HardwareProfile, load_profile


def _stats() -> ModelStats:
    """1000 fp32 parameters: two 250-parameter blocks and 500 outside them; 1600 activation bytes at batch 4."""
    return ModelStats(
        fingerprint="x", batch_size=4, seq_len=None, param_count=1000, trainable_param_count=1000,
        param_bytes=4000, trainable_param_bytes=4000, frozen_param_bytes=0, grad_bytes=4000, buffer_bytes=0,
        fwd_flops_per_sample=1e6, fwd_bwd_flops_per_sample=3e6, fwd_ops=100, bwd_ops=200, block_fwd_ops=60,
        fwd_lowp_ops=10, param_tensors=6, activation_bytes=1600,
        activation_bytes_outside_blocks=600,
        blocks=(BlockStats(class_path="m.Block", count=2, param_bytes=1000, activation_bytes=500,
                           param_bytes_total=2000, activation_bytes_total=1000),),
        largest_layer=LayerStats(name="head", class_path="torch.nn.Linear", param_bytes=1000),
        largest_activation=ActivationStats(module="head", shape=(4, 50), dtype="torch.float32", bytes=200),
        head_param_bytes=1000,  # the head runs after the blocks
    )


def _profile(world: int = 2) -> HardwareProfile:
    link = {"bus_bandwidth": 1e9, "latency_s": 1e-4, "size_bytes": 0}
    return HardwareProfile.from_table({
        "device_type": "cpu", "device_name": "test", "world_size": world, "local_world_size": world,
        "backend": "gloo", "torch_version": "any", "matmul_tflops": {"float32": 1.0, "bfloat16": 0.5},
        "collectives": {"all_reduce": link, "all_gather": link, "reduce_scatter": link},
        "op_latency_s": 1e-5, "memory_bytes_per_s": 4e9, "memory_per_rank": 1 << 30,
    })


def _predict(items: list, dp: int = 2, global_batch: int = 8, micro_batches: int = 1, **kw) -> Prediction:
    return predict(_stats(), Strategy.load(items), ParallelLayout.data_parallel(dp), _profile(dp), global_batch,
                   micro_batches, **kw)


def test_hand_computed_ddp_case() -> None:
    p = _predict(["parallel_mode"])
    m = p.memory
    # params 4000, grads 4000, AdamW state 2 x 4000, DDP's buckets 1 x 4000 (calibrated), activations at
    # 4 samples/rank = 1600 + 2.5 x 200 = 2100. Phases at one micro-batch: forward 2100; backward 4000 (its
    # saved activations are freed as the gradients appear: the larger of the two); optimizer: grads 4000 +
    # the step's temporaries: on a CPU torch's single-tensor AdamW holds two temporaries of the largest
    # parameter, 1.0 x 2 x 1000 = 6000. The step wins: peak = 4000 + 8000 + 4000 + 6000.
    assert (m.parameters, m.gradients, m.optimizer_state, m.activations) == (4000, 4000, 8000, 2100)
    assert (m.temporary, m.peak, m.peak_phase) == (6000, 22000, "optimizer")
    # On an accelerator foreach AdamW holds one temporary of every parameter at once: 0.5 x 2 x 4000.
    cuda = _profile(2).model_copy(update={"device_type": "cuda"})
    foreach = predict(_stats(), Strategy.load(["parallel_mode"]), ParallelLayout.data_parallel(2), cuda, 8).memory
    assert (foreach.temporary, foreach.peak, foreach.peak_phase) == (8000, 24000, "optimizer")
    # Two micro-batches of the same size: the second runs forward and backward with every gradient of the
    # first held, so forward / backward are 2100 + 4000 = 6100 and win: peak = 4000 + 8000 + 4000 + 6100.
    acc = _predict(["parallel_mode"], global_batch=16, micro_batches=2).memory
    assert (acc.activations, acc.temporary, acc.peak, acc.peak_phase) == (2100, 4000, 22100, "forward")
    t = p.time
    assert t.compute == pytest.approx(3e6 * 4 / 1e12)  # FLOPs/sample x samples per rank / 1 TFLOP/s
    # all-reduce of the gradients (2(n-1)/n = 1 at n=2, 1 bucket) and of the loss (4 bytes)
    assert t.communication == pytest.approx(4000 * 1.0 / 1e9 + 1e-4 + 4 / 1e9 + 1e-4)
    assert t.step == pytest.approx(t.compute + t.overhead + t.communication + t.optimizer)


def test_sharding_checkpoint_zero1_and_batch_move_memory_the_right_way() -> None:
    ddp, fsdp, zero1 = _predict(["parallel_mode"]), _predict(["parallel_mode", "fsdp"]), _predict(
        ["parallel_mode", "zero1"])
    assert fsdp.memory.parameters < ddp.memory.parameters
    assert fsdp.memory.gradients < ddp.memory.gradients
    assert zero1.memory.optimizer_state == ddp.memory.optimizer_state / 2
    ckpt = _predict(["parallel_mode", "checkpoint"])
    assert ckpt.memory.activations < ddp.memory.activations
    assert ckpt.time.compute > ddp.time.compute  # one more forward
    big = _predict(["parallel_mode"], global_batch=16)
    assert big.memory.activations == 2 * ddp.memory.activations  # linear in the micro-batch
    accumulated = _predict(["parallel_mode"], global_batch=16, micro_batches=2)
    assert accumulated.memory.activations == ddp.memory.activations
    half = _predict(["parallel_mode", ("half", {"dtype": "bf16"})])
    assert half.memory.parameters == ddp.memory.parameters / 2
    sgd = _predict(["parallel_mode"], optimizer_state_factor=0)
    assert sgd.memory.optimizer_state == 0


def test_zero2_keeps_gathered_parameters_and_offload_moves_state_to_host() -> None:
    fsdp, zero2 = _predict(["parallel_mode", "fsdp"]), _predict(["parallel_mode", "zero2"])
    assert zero2.memory.parameters == fsdp.memory.parameters
    assert zero2.time.communication < fsdp.time.communication  # one all-gather per step, not two
    cuda = _profile(2).model_copy(update={"device_type": "cuda"})
    fsdp = predict(_stats(), Strategy.load(["parallel_mode", "fsdp"]), ParallelLayout.data_parallel(2), cuda, 8)
    offload = predict(_stats(), Strategy.load(["parallel_mode", ("fsdp", {"cpu_offload": True})]),
                      ParallelLayout.data_parallel(2), cuda, 8)
    assert offload.memory.peak < fsdp.memory.peak
    assert offload.memory.host_bytes == fsdp.memory.parameters + fsdp.memory.gradients + fsdp.memory.optimizer_state


def test_without_resharding_the_blocks_backward_starts_with_every_block_gathered() -> None:
    """Under recompute the activations are small: FSDP2 peaks late in backward, at the last block's gradient
    reduction (all gradient shards, and the unit's reduce-scatter input in fp32 with, on gloo, a whole copy of it:
    2 x the 1000-byte block) with the block before it gathered: fsdp's backward prefetch gathered it as the last
    block's backward began, zero2 never resharded it. Without resharding, with two micro-batches, the peak is
    where the blocks' backward starts (every block still gathered, two blocks of 1000 bytes, besides the held
    unsharded gradients) or, larger here, at the last block's reduction with those gradients still held."""
    fsdp = _predict(["parallel_mode", "fsdp", "checkpoint"]).memory
    zero2 = _predict(["parallel_mode", "zero2", "checkpoint"]).memory
    assert fsdp.activations == zero2.activations < fsdp.gradients == 2000  # sharded: 4000 / 2
    # the root unit gathered (its 2000 bytes) and the head's gradients, held from the start of backward (1000 bytes)
    kept = fsdp.parameters + fsdp.optimizer_state + 3000
    assert (fsdp.peak - kept, fsdp.peak_phase) == (max(fsdp.activations, 2000) + 2 * 1000 + 1000, "backward")
    assert zero2.peak == fsdp.peak  # at one micro-batch the reduction outgrows the gathered blocks (1430 + 2000)
    # with two micro-batches every block stays gathered between them, besides the held (whole) gradients: the
    # backward's start holds activations + 4000 + 2000; the last block's reduction frees its recomputed 500 bytes
    # and adds the reduction's 2 x 1000 to the other block, still gathered
    acc = _predict(["parallel_mode", "zero2", "checkpoint"], global_batch=16, micro_batches=2).memory
    assert acc.peak - kept == (acc.activations - 500) + 4000 + 2 * 1000 + 1000 > acc.activations + 4000 + 2000


def test_more_data_parallel_ranks_less_compute_per_step() -> None:
    two, four = _predict(["parallel_mode", "fsdp"], dp=2), _predict(["parallel_mode", "fsdp"], dp=4)
    assert four.time.compute == pytest.approx(two.time.compute / 2)
    assert four.memory.optimizer_state < two.memory.optimizer_state
    overlapped = _predict(["parallel_mode", "fsdp"], overlap=0.5)
    assert overlapped.time.communication == pytest.approx(two.time.communication / 2)
    amp = _predict(["parallel_mode", ("amp_native", {"dtype": "bf16"})])
    assert amp.time.compute == pytest.approx(2 * _predict(["parallel_mode"]).time.compute)  # 0.5 TFLOP/s bf16


def test_cluster_table_uses_the_same_formulas() -> None:
    profile = load_profile("a100_80gb_8x_nvlink")
    stats = _stats()
    strategy = Strategy.load(["parallel_mode", "fsdp", ("amp_native", {"dtype": "bf16"})])
    p = predict(stats, strategy, ParallelLayout.data_parallel(8), profile, 64)
    assert p.time.compute == pytest.approx(3e6 * 8 / 312e12)
    gathered = 4000 * 0.5 * 2  # 16-bit parameters, gathered in forward and again in backward
    link = profile.collectives
    expected = (gathered * 7 / 8 / link["all_gather"].bus_bandwidth + 2 * 3 * link["all_gather"].latency_s
                + 4000 * 7 / 8 / link["reduce_scatter"].bus_bandwidth + 3 * link["reduce_scatter"].latency_s
                + 4 * 2 * 7 / 8 / link["all_reduce"].bus_bandwidth + link["all_reduce"].latency_s)  # the loss
    assert p.time.communication == pytest.approx(expected)
    assert p.memory.parameters == 4000 / 8


def test_prediction_json_round_trip_and_bad_input() -> None:
    p = _predict(["parallel_mode", "zero2", "checkpoint"])
    assert Prediction.model_validate_json(p.model_dump_json()) == p
    with pytest.raises(ValueError, match="divisible"):
        _predict(["parallel_mode"], global_batch=7)
    with pytest.raises(ValueError, match="overlap"):
        _predict(["parallel_mode"], overlap=2.0)


def test_per_operation_overhead() -> None:
    """Operations x the profile's latency: per micro-batch (whatever its size), recompute adds the blocks'
    forward operations, autocast adds casts, FSDP adds operations per unit and collective."""
    from atorch.strategy_search.costing import cost_model as cm

    ddp = _predict(["parallel_mode"])
    optimizer_ops = cm.OPTIMIZER_OPS[0] + cm.OPTIMIZER_OPS[1] * 2  # AdamW: 2 states
    assert ddp.time.ops == 100 + 200 + optimizer_ops
    assert ddp.time.overhead == pytest.approx(ddp.time.ops * 1e-5)
    assert _predict(["parallel_mode"], global_batch=16).time.overhead == pytest.approx(ddp.time.overhead)
    accumulated = _predict(["parallel_mode"], global_batch=16, micro_batches=2)
    assert accumulated.time.ops == 2 * (100 + 200) + optimizer_ops
    assert _predict(["parallel_mode", "checkpoint"]).time.ops == ddp.time.ops + 60
    amp = _predict(["parallel_mode", ("amp_native", {"dtype": "bf16"})])
    assert amp.time.ops == ddp.time.ops + cm.AMP_CAST_OPS * 10
    fsdp = _predict(["parallel_mode", "fsdp"])  # 2 block units + the root, gathered twice, reduced once
    assert fsdp.time.ops == ddp.time.ops + 3 * (cm.FSDP_UNIT_OPS * 3 + cm.FSDP_PARAM_OPS * 6)
    assert ddp.time.step == pytest.approx(ddp.time.compute + ddp.time.overhead + ddp.time.communication
                                          + ddp.time.optimizer)
    # The update's passes over the owned parameter bytes at the profile's memory bandwidth, plus DDP's
    # copies of the gradients into and out of its buckets.
    passes = cm.OPTIMIZER_PASSES[0] + cm.OPTIMIZER_PASSES[1] * 2
    assert ddp.time.optimizer == pytest.approx((passes * 4000 + 2 * 4000) / 4e9)


def test_checkpoint_keeps_the_blocks_inputs_and_cpu_offload_stays_on_a_cpu_device() -> None:
    """With the analyser's block inputs, recompute keeps exactly them (plus what is outside the blocks and
    one block's activations during its recompute); on a CPU device, offloaded state is still device memory."""
    from atorch.strategy_search.costing.analyser import BlockStats

    stats = _stats()
    with_inputs = stats.model_copy(update={"blocks": (BlockStats(
        class_path="m.Block", count=2, param_bytes=1000, activation_bytes=500, param_bytes_total=2000,
        activation_bytes_total=1000, input_bytes_total=160),)})
    strategy = Strategy.load(["parallel_mode", "checkpoint"])
    p = predict(with_inputs, strategy, ParallelLayout.data_parallel(2), _profile(2), 8)
    assert p.memory.activations == 600 + 160 + 500 + round(1.5 * 200)  # outside + inputs + one block + loss
    cuda = _profile(2).model_copy(update={"device_type": "cuda"})
    offload = Strategy.load(["parallel_mode", ("fsdp", {"cpu_offload": True})])
    on_cpu = predict(stats, offload, ParallelLayout.data_parallel(2), _profile(2), 8)
    on_cuda = predict(stats, offload, ParallelLayout.data_parallel(2), cuda, 8)
    assert on_cpu.memory.host_bytes == 0 and on_cuda.memory.host_bytes > 0
    plain = predict(stats, Strategy.load(["parallel_mode", "fsdp"]), ParallelLayout.data_parallel(2), _profile(2), 8)
    assert on_cpu.memory == plain.memory and on_cuda.memory.peak < on_cpu.memory.peak


def test_a_recomputed_attention_block_holds_one_gradient_of_its_largest_saved_tensor() -> None:
    """Under checkpoint, an attention block's backward holds its recomputed activations (one block's, counted in
    the activations) and the gradient of the largest tensor it saved, not as many bytes again as the block saved:
    that over-predicted the held-out Swin's two-layer stages by 43% (bench/README.md, run O)."""
    from atorch.strategy_search.costing.analyser import BlockStats

    def peak(attention: bool, largest: int) -> tuple[int, str]:
        block = BlockStats(class_path="m.Block", count=2, param_bytes=1000, activation_bytes=50_000,
                           param_bytes_total=2000, activation_bytes_total=100_000, input_bytes_total=160,
                           attention=attention, largest_saved_bytes=largest)
        stats = _stats().model_copy(update={"blocks": (block,), "activation_bytes": 100_600})
        m = predict(stats, Strategy.load(["parallel_mode", "checkpoint"]), ParallelLayout.data_parallel(2),
                    _profile(2), 8).memory
        return m.peak, m.peak_phase

    (conv, _), (small, phase), (large, _) = peak(False, 12_000), peak(True, 120), peak(True, 12_000)
    assert phase == "backward"  # the recomputed block's 50,000 bytes outweigh the step's temporaries
    assert small - conv == 120 and large - conv == 12_000  # the gradient of the largest saved tensor, once


def test_deepspeed_keeps_whole_parameters_a_master_shard_and_a_bucket() -> None:
    ds = _predict(["parallel_mode", ("zero2", {"implementation": "deepspeed"})])
    fsdp2 = _predict(["parallel_mode", ("zero2", {"implementation": "fsdp2"})])
    assert ds.memory.parameters == 4000 and fsdp2.memory.parameters == 2000
    assert ds.memory.optimizer_state == fsdp2.memory.optimizer_state == 4000
    # Parameters, state, master shard and bucket (4000 + 4000 + 2000 + 4000), then the reduction at the end of
    # the backward (DeepSpeed 0.19's stage_1_and_2.py): allreduce_bucket's flattened copy of the bucket (4000)
    # and grads_in_partition (2000); that is above the step (gradient partition + its temporary: 4000).
    assert (ds.memory.peak, ds.memory.peak_phase, ds.memory.temporary) == (20000, "epilogue", 12000)
    # Under accumulation ZeRO-2 reduces every micro-batch; the previous one's partition lives until Python's cycle
    # collector runs: one or two partitions, predicted as 1.5 (2000 x 1.5).
    acc = _predict(["parallel_mode", ("zero2", {"implementation": "deepspeed"})], global_batch=16, micro_batches=2)
    assert (acc.memory.peak, acc.memory.peak_phase) == (21000, "epilogue")
    # ZeRO-1 reduces once per step, at the boundary: one partition.
    zero1 = _predict(["parallel_mode", ("zero1", {"implementation": "deepspeed"})])
    assert (zero1.memory.peak, zero1.memory.peak_phase) == (20000, "epilogue")


def test_deepspeed_grads_in_partition_holds_the_parameters_straddling_a_partition_whole() -> None:
    # DeepSpeed's get_partition_info: a parameter belongs to a rank's partition if it starts in it or straddles its
    # start, and grads_in_partition holds each of them whole. 1000 + 6000 + 1000 bytes over 2 ranks (4000 each):
    # rank 0 holds the first two (7000), rank 1 the straddling one and the last (7000), not 4000.
    stats = _stats().model_copy(update={"trainable_tensor_bytes": (1000, 6000, 1000), "trainable_param_bytes": 8000,
                                        "param_bytes": 8000})
    ds = Strategy.load(["parallel_mode", ("zero1", {"implementation": "deepspeed"})])
    pred = predict(stats, ds, ParallelLayout.data_parallel(2), _profile(2), 8).memory
    # parameters 8000, state 8000, fp32 shard 4000, bucket 8000; the reduction: bucket copy 8000 + 7000
    assert (pred.peak, pred.peak_phase) == (43000, "epilogue")
    even = predict(stats.model_copy(update={"trainable_tensor_bytes": (4000, 4000)}), ds,
                   ParallelLayout.data_parallel(2), _profile(2), 8).memory
    assert even.peak == 40000


def _layout_predict(dims: list, items: list, micro_batches: int = 1) -> Prediction:
    strategy = Strategy.load([("parallel_mode", {"dims": dims}), *items])
    return predict(_stats(), strategy, strategy.layout(2), _profile(2), 8, micro_batches)


def test_tensor_and_pipeline_parallel_split_the_blocks_by_hand() -> None:
    ddp = _layout_predict([("data", -1)], [])
    # 2000 block bytes split 2 ways, the 2000 outside them (embedding, head) kept whole: 3000 per rank.
    tp = _layout_predict([("tensor", 2), ("data", -1)], ["tensor_parallel"])
    assert (ddp.memory.parameters, tp.memory.parameters) == (4000, 3000)
    # 8 samples on the one model replica; block activations (1000 at 4 samples) keep 10/34 whole and split
    # the rest: 1000 x 2 x (10/34 + 24/34 / 2) = 1294.1; plus outside 600 x 2 and the loss's 2.5 x 200 x 2.
    assert tp.memory.activations == round(2 * 1000 * (10 / 34 + 12 / 34) + 1200 + 1000)
    assert tp.time.communication > 0  # data size 1: only the blocks' all-reduces over the tensor group
    # pipeline 2 with 4 schedule micro-batches of 2: 1f1b holds 2 in flight of each stage's half of the blocks
    # (= the whole blocks at one micro-batch), gpipe all 4; filling and draining idles a stage (4 + 2 - 1) / 4.
    pp = _layout_predict([("pipeline", 2), ("data", -1)], [("pipeline_parallel", {"micro_batches": 4})])
    gpipe = _layout_predict([("pipeline", 2), ("data", -1)],
                            [("pipeline_parallel", {"micro_batches": 4, "schedule": "gpipe"})])
    assert pp.memory.parameters == 3000
    assert pp.samples_per_rank == 2
    assert pp.memory.activations == round(1000 / 2 + 600 / 2 + 2.5 * 200 / 2)  # micro-batch of 2 samples
    assert gpipe.memory.activations - pp.memory.activations == round(2 * 1000 / 2 / 2)  # 2 more in flight
    dualpipev = _layout_predict([("pipeline", 2), ("data", -1)],
                                [("pipeline_parallel", {"micro_batches": 4, "schedule": "dualpipev"})])
    assert dualpipev.memory.activations - pp.memory.activations == round(1000 / 2 / 2)  # one more (PP + 1)
    no_bubble = 3e6 * 8 * 3000 / 4000 / 1e12  # FLOPs of this rank's share, 1 TFLOP/s
    assert pp.time.compute == pytest.approx(no_bubble * 5 / 4)
    # The busiest stage: half the blocks' operations (60 of the 100 forward ones are in blocks: 60% of the 300)
    # and all 40% outside them, x 5/4 for the fill and drain, per micro-batch; + AdamW's 10 foreach operations.
    assert pp.time.ops == round(300 * (0.4 + 0.6 / 2) * 5 / 4 * 4 + 10)


def test_tensor_parallel_pays_dtensor_dispatch_per_split_layer_and_parameter() -> None:
    """Each layer the plan splits costs the profile's DTensor figure per micro-batch (its forward's part once more
    under checkpoint: the recompute), each of its parameters the update's figure once per step (AdamW: x1)."""
    stats = _stats().model_copy(update={"tp_split_layers": 4, "tp_split_params": 8})
    costs = {"tensor_parallel_linear_s": 2e-3, "tensor_parallel_linear_forward_s": 5e-4, "dtensor_param_step_s": 1e-4}
    priced = _profile(2).model_copy(update=costs)

    def overhead(items: list, profile: HardwareProfile, micro_batches: int = 1, factor: float = 2.0) -> float:
        strategy = Strategy.load([("parallel_mode", {"dims": [("tensor", 2), ("data", -1)]}), "tensor_parallel",
                                  *items])
        return predict(stats, strategy, strategy.layout(2), profile, 8, micro_batches,
                       optimizer_state_factor=factor).time.overhead

    assert overhead([], priced) - overhead([], _profile(2)) == pytest.approx(4 * 2e-3 + 8 * 1e-4)
    assert overhead([], priced, micro_batches=2) - overhead([], _profile(2), micro_batches=2) == pytest.approx(
        2 * 4 * 2e-3 + 8 * 1e-4)
    assert overhead(["checkpoint"], priced) - overhead(["checkpoint"], _profile(2)) == pytest.approx(
        4 * (2e-3 + 5e-4) + 8 * 1e-4)
    # SGD with momentum (one state): 2 + 4 foreach operations against AdamW's 2 + 8
    assert overhead([], priced, factor=1.0) - overhead([], _profile(2), factor=1.0) == pytest.approx(
        4 * 2e-3 + 8 * 1e-4 * 6 / 10)
    # data parallel alone has no DTensor
    plain = Strategy.load(["parallel_mode"])
    assert predict(stats, plain, plain.layout(2), priced, 8).time == predict(stats, plain, plain.layout(2),
                                                                            _profile(2), 8).time


def test_compute_uses_the_rate_measured_at_the_model_s_matmul_size() -> None:
    """The stats' average forward matmul at 4 samples a rank: 1e6 x 4 / 10 matmuls = 4e5 FLOPs, a cube of side
    (2e5)^(1/3) = 58: below the smallest size measured, whose rate applies; tensor parallel halves each matmul."""
    sized = _profile(2).model_copy(update={"matmul_tflops_by_size": {"float32": {128: 0.25, 1024: 1.0}}})
    p = predict(_stats(), Strategy.load(["parallel_mode"]), ParallelLayout.data_parallel(2), sized, 8)
    assert p.time.compute == pytest.approx(3e6 * 4 / 0.25e12)  # not the best size's 1 TFLOP/s
    plain = _predict(["parallel_mode"])
    assert p.time.compute == pytest.approx(4 * plain.time.compute)


def test_zero1_across_a_tensor_dimension_is_predicted_as_zero2() -> None:
    """atorch runs zero1 next to a tensor dimension as zero2 (FSDP2 over the data dimension, zero1.py): the same
    prediction, with gradients sharded too (below what ZeroRedundancyOptimizer's zero1 keeps)."""
    layout = ParallelLayout((("tensor", 2), ("data", 2)))

    def memory(*methods: object) -> object:
        strategy = Strategy.load([("parallel_mode", {"dims": [["tensor", 2], ["data", 2]]}), "tensor_parallel",
                                  *methods])
        return predict(_stats(), strategy, layout, _profile(4), 8).memory

    assert memory("zero1") == memory("zero2")
    assert memory("zero1").gradients < memory().gradients


def test_a_16_bit_step_measured_against_fp32_moves_the_prediction_by_that_ratio() -> None:
    """A profile that measured bf16's step against fp32's (``dtype_step_ratio``, at the model's matmul size: 58 here,
    below the one size given): a bf16 candidate's matmuls and forward/backward operations cost fp32's times the
    ratio, in place of the bf16 matmul rate and the cast operations; memory, communication and the update are
    unchanged. A profile without it (a table, an older cache) predicts as before."""
    from atorch.strategy_search.costing import cost_model as cm

    measured = _profile(2).model_copy(update={"dtype_step_ratio": {"bfloat16": {64: 3.0}, "bfloat16:half": {64: 2.0}}})
    fp32, amp_items = ["parallel_mode"], ["parallel_mode", ("amp_native", {"dtype": "bf16"})]
    before = _predict(amp_items)
    after = predict(_stats(), Strategy.load(amp_items), ParallelLayout.data_parallel(2), measured, 8)
    plain = _predict(fp32)
    assert after.time.compute == pytest.approx(3.0 * plain.time.compute)
    optimizer_ops = cm.OPTIMIZER_OPS[0] + cm.OPTIMIZER_OPS[1] * 2
    assert after.time.ops == 3 * (100 + 200) + optimizer_ops  # no cast operations: the ratio holds them
    assert after.time.communication == before.time.communication and after.memory == before.memory
    assert after.time.step > plain.time.step  # bf16 predicted slower than fp32, as measured
    half = predict(_stats(), Strategy.load(["parallel_mode", ("half", {"dtype": "bf16"})]),
                   ParallelLayout.data_parallel(2), measured, 8)
    assert half.time.compute == pytest.approx(2.0 * plain.time.compute)  # cast to the dtype: its own ratio
    assert predict(_stats(), Strategy.load(fp32), ParallelLayout.data_parallel(2), measured, 8) == plain
    assert measured.dtype_ratio_at("bfloat16", False, 30) == 3.0 and measured.dtype_ratio_at("float16", False) is None
