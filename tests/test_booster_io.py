"""The Booster's checkpoint IO (atorch/booster/checkpoint_io.py) and LoRA (atorch/booster/lora.py).

One-process tests cover the file layout, format detection and bad input; the distributed ones run
tests/workers/booster_io_worker.py on 2 real gloo processes (fsdp, zero1, DDP, pipeline parallel).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from launcher import run_json
from shard_models import TokenDataset, tiny_gpt2

from atorch.booster import checkpoint_io as io
from atorch.booster.lora import enable_lora
from atorch.checkpointing.state_io import CheckpointError
from atorch.errors import SetupError

WORKER = Path(__file__).parent / "workers" / "booster_io_worker.py"


def gpt2(seed: int, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_gpt2(layers)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ----- one process -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kwargs", [("model.bin", {}), ("model.safetensors", {}),
                                         ("weights.pt", {"use_safetensors": True})])
def test_unsharded_round_trip(tmp_path, name, kwargs):
    saved, fresh = gpt2(0), gpt2(1)
    io.save_model(saved, str(tmp_path / name), **kwargs)
    assert not same_weights(saved, fresh)
    io.load_model(fresh, str(tmp_path / name))
    assert same_weights(saved, fresh)


def test_sharded_bin_layout_loads_into_plain_model(tmp_path):
    saved = gpt2(0)
    io.save_model(saved, str(tmp_path), shard=True, size_per_shard=0.02)
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"pytorch_model-00001-of-{len(files):05d}.bin"
    assert (tmp_path / "config.json").is_file()
    state = {}
    for file in files:
        state.update(torch.load(tmp_path / file, weights_only=True))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert set(state) == set(saved.state_dict())  # clean names, every entry (tied lm_head included)
    fresh = gpt2(1)
    fresh.load_state_dict(state, strict=True)
    assert same_weights(saved, fresh)


def test_prefix_and_resave_replaces_stale_shards(tmp_path):
    io.save_model(gpt2(0), str(tmp_path), shard=True, size_per_shard=0.01, prefix="ema", use_safetensors=True)
    many = sorted(p.name for p in tmp_path.glob("model.ema-*.safetensors"))
    io.save_model(gpt2(0), str(tmp_path), shard=True, size_per_shard=100, prefix="ema", use_safetensors=True)
    assert len(many) > 1 and sorted(p.name for p in tmp_path.glob("model.ema-*")) == [
        "model.ema-00001-of-00001.safetensors"]
    fresh = gpt2(1)
    io.load_model(fresh, str(tmp_path))
    assert same_weights(gpt2(0), fresh)


def test_loads_a_save_pretrained_folder_with_tied_head(tmp_path):
    """transformers writes a tied lm_head once: it is filled from the weight it is tied to."""
    saved = gpt2(0)
    saved.save_pretrained(tmp_path)
    fresh = gpt2(1)
    io.load_model(fresh, str(tmp_path))
    assert same_weights(saved, fresh)


def test_strict_names_missing_and_unexpected(tmp_path):
    io.save_model(gpt2(0, layers=3), str(tmp_path / "three.bin"))
    io.save_model(gpt2(0, layers=1), str(tmp_path / "one.bin"))
    with pytest.raises(CheckpointError, match=r"weights this model lacks: transformer\.h\.2\.attn"):
        io.load_model(gpt2(1), str(tmp_path / "three.bin"))
    with pytest.raises(CheckpointError, match=r"no weights for transformer\.h\.1\.attn.* and \d+ more"):
        io.load_model(gpt2(1), str(tmp_path / "one.bin"))
    model = gpt2(1)
    io.load_model(model, str(tmp_path / "three.bin"), strict=False)  # the two common blocks are taken
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, gpt2(0, layers=3).transformer.h[1].mlp.c_fc.weight)


def test_shape_mismatch_is_named(tmp_path):
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(4, 6))
    io.save_model(wide, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match=r"'0.weight' is \[6, 4\] in the checkpoint, \[5, 4\] here"):
        io.load_model(torch.nn.Sequential(torch.nn.Linear(4, 5)), str(tmp_path / "w.safetensors"))


def test_two_index_files_refused(tmp_path):
    io.save_model(gpt2(0), str(tmp_path), shard=True, use_safetensors=True)
    io.save_model(gpt2(0), str(tmp_path), shard=True)
    with pytest.raises(CheckpointError, match=r"2 index files \(model\.safetensors\.index\.json, "
                                              r"pytorch_model\.bin\.index\.json\); keep one checkpoint per directory"):
        io.load_model(gpt2(1), str(tmp_path))
    io.load_model(gpt2(1), str(tmp_path / "pytorch_model.bin.index.json"))  # naming the index works


def test_missing_shard_refused(tmp_path):
    io.save_model(gpt2(0), str(tmp_path), shard=True, size_per_shard=0.02, use_safetensors=True)
    (tmp_path / "model-00002-of-00008.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names files that are not in .*model-00002-of-00008\.safetensors; "
                                              r"the checkpoint is incomplete"):
        io.load_model(gpt2(1), str(tmp_path))


class NotATensor:
    """A pickled object where a tensor should be."""


def test_pickled_bin_with_objects_refused(tmp_path):
    torch.save({"0.weight": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"refused by torch.load\(weights_only=True\)"):
        io.load_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), str(tmp_path))
    torch.save({"0.weight": "text"}, tmp_path / "strings.bin")  # allowed by weights_only, still not tensors
    with pytest.raises(CheckpointError, match="not a dict of named tensors"):
        io.load_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), str(tmp_path / "strings.bin"))


def test_nothing_to_load_and_bad_arguments(tmp_path):
    with pytest.raises(CheckpointError, match=r"no index file and none of model\.safetensors, pytorch_model\.bin"):
        io.load_model(gpt2(1), str(tmp_path))
    with pytest.raises(CheckpointError, match="size_per_shard must be a positive number"):
        io.save_model(gpt2(0), str(tmp_path), shard=True, size_per_shard=0)
    with pytest.raises(CheckpointError, match="gather_dtensor=False .* is not supported"):
        io.save_model(gpt2(0), str(tmp_path), shard=True, gather_dtensor=False)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match="writing failed"):
        io.save_model(gpt2(0), str(tmp_path / "a_file" / "model"), shard=True)


def test_index_naming_the_wrong_shard_refused(tmp_path):
    io.save_model(gpt2(0), str(tmp_path), shard=True, size_per_shard=0.02, use_safetensors=True)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["transformer.wte.weight"] = "model-00001-of-00008.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"places 'transformer.wte.weight' in model-00001-of-00008.safetensors, "
                                              "which does not hold it"):
        io.load_model(gpt2(1), str(tmp_path))


def _groups(model: torch.nn.Module) -> list[dict]:
    """Blocks, and the rest (GPT-2's lm_head is tied to wte, so it is not listed again)."""
    body = model.transformer
    rest = [*body.wte.parameters(), *body.wpe.parameters(), *body.ln_f.parameters()]
    return [{"params": list(model.transformer.h.parameters())}, {"params": rest}]


def _stepped(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = gpt2(seed)
    groups = _groups(model)
    groups[1]["lr"] = 0.02
    optim = torch.optim.AdamW(groups, lr=0.01, betas=(0.8, 0.9))
    model(**{k: v[None] for k, v in TokenDataset()[0].items()}).loss.backward()
    optim.step()
    return model, optim


@pytest.mark.parametrize("name,shard", [("optim.bin", False), ("optim.safetensors", False), ("optim", True)])
def test_plain_optimizer_round_trip(tmp_path, name, shard):
    model, optim = _stepped(0)
    io.save_optimizer(optim, str(tmp_path / name), shard=shard, size_per_shard=0.02)
    fresh = torch.optim.AdamW(_groups(model), lr=0.5)
    io.load_optimizer(fresh, str(tmp_path / name))
    assert [g["lr"] for g in fresh.param_groups] == [0.01, 0.02] and fresh.param_groups[0]["betas"] == (0.8, 0.9)
    for param in model.parameters():
        for key, value in optim.state[param].items():
            assert torch.equal(fresh.state[param][key], value)


def test_optimizer_refuses_other_class_and_model_folders(tmp_path):
    model, optim = _stepped(0)
    io.save_optimizer(optim, str(tmp_path / "o.safetensors"))
    sgd = torch.optim.SGD(_groups(model), lr=0.1)
    with pytest.raises(CheckpointError, match="the state is from AdamW, this optimizer is SGD"):
        io.load_optimizer(sgd, str(tmp_path / "o.safetensors"))
    io.save_model(model, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match="holds no optimizer description"):
        io.load_optimizer(optim, str(tmp_path / "m.safetensors"))


def test_lr_scheduler_as_json(tmp_path):
    optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, milestones=[2, 4], gamma=0.5)
    for _ in range(3):
        optim.step()
        sched.step()
    io.save_lr_scheduler(sched, str(tmp_path / "sched.json"))
    json.loads((tmp_path / "sched.json").read_text())  # plain JSON, no pickle
    other_optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    other = torch.optim.lr_scheduler.MultiStepLR(other_optim, milestones=[1])
    io.load_lr_scheduler(other, str(tmp_path / "sched.json"))
    assert other.state_dict() == sched.state_dict() and isinstance(other.milestones, Counter)
    other_optim.param_groups[0]["lr"] = 0.5  # the optimizer's own state (load_optimizer) carries the current lr
    other_optim.step()
    other.step()  # the 4th step crosses the restored milestone 4
    optim.step()
    sched.step()
    assert other.get_last_lr() == sched.get_last_lr() == [0.25]
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="not an LR scheduler state"):
        io.load_lr_scheduler(other, str(tmp_path / "bad.json"))


def test_enable_lora_arguments(tmp_path):
    from peft import LoraConfig, PeftModel

    with pytest.raises(SetupError, match="needs lora_config .* or pretrained_dir"):
        enable_lora(gpt2(0))
    with pytest.raises(SetupError, match="must be a peft config"):
        enable_lora(gpt2(0), lora_config={"r": 4})
    model = enable_lora(gpt2(0), lora_config=LoraConfig(r=4, target_modules=["c_attn"]))
    with pytest.raises(SetupError, match="adds them once"):
        enable_lora(model, lora_config=LoraConfig(r=4, target_modules=["c_attn"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    io.save_lora_as_pretrained(model, str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.bin").is_file()
    again = enable_lora(gpt2(0), pretrained_dir=str(tmp_path / "adapter"))
    assert isinstance(again, PeftModel) and any(p.requires_grad for n, p in again.named_parameters() if "lora_" in n)
    assert same_weights(again, model)
    with pytest.raises(CheckpointError, match="no LoRA adapters"):
        io.save_lora_as_pretrained(gpt2(0), str(tmp_path / "none"))


# ----- 2 processes -------------------------------------------------------------------------------------------
def _ok(report: dict) -> None:
    failed = {name: entry["error"] for name, entry in report.items() if "error" in entry}
    assert not failed, failed


def test_model_checkpoints_across_strategies_and_the_documented_booster_loop(tmp_path):
    report = run_json(WORKER, "model", str(tmp_path), nproc=2)
    _ok(report)
    for name, layers in (("fsdp->plain,ddp", 2), ("pp2->plain,fsdp,pp2", 4)):
        entry = report[name]
        shards = [f for f in entry["files"] if f.endswith(".safetensors")]
        assert len(shards) > 1 and "model.safetensors.index.json" in entry["files"] and "config.json" in entry["files"]
        # GPT-2: 4 tensors per embedding/head side (wte, wpe, ln_f.weight/bias, lm_head) + 12 per block
        assert entry["names"] == 5 + 12 * layers
        assert entry["plain_differs"] == [] and entry["pretrained_differs"] == []  # bitwise equal weights
        for key, reload in entry.items():
            if key.startswith("reload["):
                assert reload["differs_before"] > 0 and reload["differs"] == [], (name, key, reload)
    # Colossal-AI's documented Booster loop with its checkpoint calls: the sharded safetensors folder loads into a
    # fresh plain model, and a fresh boosted run that loads model, optimizer and scheduler continues bit for bit.
    # (the data-parallel plugins; HybridParallel's tp2 / pp2 layouts are the tp2 and pp2 round trips above)
    for plugin in ("TorchDDPPlugin", "TorchFSDPPlugin", "LowLevelZeroPlugin[stage1]", "LowLevelZeroPlugin[stage2]",
                   "GeminiPlugin[offload]"):
        entry = report[f"doc[{plugin}]"]
        assert entry["shards"] > 1 and entry["plain_differs"] == [] and entry["loaded_differs"] == [], plugin
        assert entry["resumed"] == entry["next"], plugin
    lora = report["doc_lora[TorchDDPPlugin]"]
    assert {"adapter_config.json", "adapter_model.bin"} <= set(lora["files"])
    assert len(lora["changed"]) == 4 and all("lora_" in n for n in lora["changed"])  # base weights bitwise equal
    assert lora["max_logit_diff"] <= 1e-5  # bitwise-equal weights, the same fp32 forward (see the LoRA test below)
    errors = report["errors"]
    assert "does not exist" in errors["missing"]
    assert "weights this model lacks: transformer.h.2" in errors["other_model"]
    assert "not an optimizer checkpoint" in errors["optimizer_from_model"]
    assert len(errors["after"]) == 1  # the ranks are still in step after the errors


def test_optimizer_scheduler_lora_tensor_parallel_and_half(tmp_path):
    report = run_json(WORKER, "optim", str(tmp_path), nproc=2)
    _ok(report)
    for name in ("resume[fsdp, sharded]", "resume[zero1]", "resume[ddp]", "resume[pp2]"):
        entry = report[name]
        # Same strategy, same data: the loaded weights, moments, step counts and LR are bit-for-bit those saved,
        # and the same operations run on them, so the losses are equal exactly.
        assert entry["b"] == entry["a"], name
        assert entry["lr_loaded"] == 0.01 * 0.5**2 and entry["lr_b"] == entry["lr_a"]
    sharded = report["resume[fsdp, sharded]"]
    assert sharded["files"][-1] == "optimizer.safetensors.index.json"
    # keyed by the user's parameter names (recorded on result.optim when it is built), not by position
    assert "state.transformer.h.0.attn.c_attn.weight.exp_avg" in sharded["keys"]
    assert "state.transformer.wte.weight.exp_avg_sq" in sharded["keys"]
    assert "transformer.h.1.mlp.c_proj.bias" in sharded["groups"][0]
    tied = report["tied state ddp->pp2"]  # the last stage's copy of the tied weight takes the tied weight's state
    assert tied["ddp_names"] == [f"state.transformer.wte.weight.{k}" for k in ("exp_avg", "exp_avg_sq", "step")]
    assert "state.lm_head.weight.exp_avg" in tied["pp2_names"] and tied["equal"] and tied["all_equal"]
    control = report["resume[ddp]"]["without_optimizer_state"]
    assert control[0] == report["resume[ddp]"]["a"][0] and control[1] != report["resume[ddp]"]["a"][1]
    # fsdp -> DDP: at 2 ranks both reduce a gradient as one fp32 sum of two values (commutative, so the same
    # bits) and apply the same elementwise AdamW update; allow a few ulps of the loss (~5) for kernel order.
    cross = report["resume[fsdp->ddp]"]
    assert cross["b"] == pytest.approx(cross["a"], rel=1e-6, abs=0)
    tp = report["llama tp2->plain,fsdp"]  # tensor-parallel DTensors gathered: plain load and from_pretrained agree
    assert tp["plain_differs"] == [] and tp["pretrained_differs"] == [] and tp["reload[fsdp]"]["differs"] == []
    half = report["half[bf16]"]  # saved in the model's dtype; bf16 -> fp32 is exact, so the checksums are equal
    assert half["dtypes"] == ["torch.bfloat16"] and half["file_differs"] == []
    assert half["fp32_dtypes"] == ["torch.float32"] and half["fp32_differs"] == []
    for name in ("lora[fsdp]",):  # (DDP: the Booster's LoRA in the other launch)
        entry = report[name]
        assert entry["changed"] == entry["lora_names"] and len(entry["lora_names"]) == 4  # base weights bitwise equal
        assert "adapter_config.json" in entry["files"] and "adapter_model.safetensors" in entry["files"]
        assert entry["loaded_differs"] == []
        # The loaded adapter and base weights are bitwise those trained, and the forward is the same fp32 code on
        # the same batch: outputs agree to rounding of a different kernel order at most (logits ~1: 1e-5 is ~80 ulp).
        assert entry["max_logit_diff"] <= 1e-5


def test_booster_without_plugin_saves_plain_objects(tmp_path):
    """plugin=None: boost passes the objects through, and the Booster's checkpoint calls take them as they are."""
    from toy_models import mlp

    from atorch.booster import Booster

    booster = Booster()
    model, optimizer, *_ = booster.boost(mlp(0), torch.optim.SGD(mlp(0).parameters(), lr=0.1))
    booster.save_model(model, str(tmp_path / "model"), shard=True, use_safetensors=True, size_per_shard=0.002)
    assert len(list((tmp_path / "model").glob("model-*.safetensors"))) > 1
    fresh = mlp(1)
    booster.load_model(fresh, str(tmp_path / "model"))
    assert same_weights(model, fresh)


def test_names_are_clean_of_wrappers(tmp_path):
    """Activation-checkpoint wrappers (as the checkpoint method puts around blocks) leave no part in the names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = gpt2(0)
    wrapped.transformer.h[0] = checkpoint_wrapper(wrapped.transformer.h[0])
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    io.save_model(wrapped, str(tmp_path / "w.safetensors"))
    fresh = gpt2(1)
    io.load_model(fresh, str(tmp_path / "w.safetensors"))  # strict: every name matches the plain model's
    assert same_weights(gpt2(0), fresh)
