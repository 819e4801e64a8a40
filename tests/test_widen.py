"""`widen`: wider routed experts that compute exactly what the source's compute (docs/widen.md).

Every tiny family is widened from 48 to 80 units (80 is not a whole number of int4 groups of 32,
so the store's padding of the last group is exercised) into several small shards, and
transformers' greedy `generate` must give the source's tokens, with logits equal up to fp32
summation order. The expert store and `info` must describe the new geometry, the store's
quantised blocks of the original units must be the source's own, and every refusal is one line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from toolkit.cli import main
from toolkit.errors import SpecPrefetchError
from toolkit.models import widen as W
from toolkit.models.checkpoint import read_header
from toolkit.models.expert_layout import blob_bytes
from toolkit.models.info import info, model_info
from toolkit.models.loader import inspect_model_dir, load_model
from toolkit.models.tiny import TINY_FAMILIES
from toolkit.models.widen import WIDENED_KEY, widen_checkpoint

N = 80            # tiny experts are 48 wide
SMALL = 256 << 10  # output shards of 256 KiB: every tiny model is written as several shards


@pytest.fixture(scope="module")
def widened(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("widened")

    class Widened(dict):
        def __missing__(self, family: str) -> Path:
            widen_checkpoint(tiny_models[family], root / family, N, progress=False, shard_bytes=SMALL)
            self[family] = root / family
            return self[family]

    return Widened()


def _tensors(model: Path) -> dict[str, tuple[str, list[int]]]:
    spec = inspect_model_dir(model)
    return {k: (m["dtype"], m["shape"]) for f in spec.weight_files for k, m in read_header(f).items()}


def _load_all(model: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in inspect_model_dir(model).weight_files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _greedy(model: Path, ids: torch.Tensor):
    m = load_model(model, dtype="float32").model
    with torch.no_grad():
        g = m.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                       return_dict_in_generate=True)
    return g.sequences, torch.stack(g.logits)


def _rewrite(src: Path, dst: Path, fn) -> Path:
    """A copy of the checkpoint `src` whose tensors are fn(name, tensor) (one shard)."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    save_file({k: fn(k, v).contiguous() for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_widened_model_generates_the_source_tokens(family, tiny_models, widened):
    src, out = tiny_models[family], widened[family]
    ids = torch.tensor([[1, 17, 300, 42, 7, 999]])
    tok_a, log_a = _greedy(src, ids)
    tok_b, log_b = _greedy(out, ids)
    assert torch.equal(tok_a, tok_b)
    assert (log_a - log_b).abs().max() <= 1e-5 * max(1.0, float(log_a.abs().max()))

    # the new geometry; the source recorded; every tensor keeps its dtype; only experts change
    new, old = inspect_model_dir(out), inspect_model_dir(src)
    assert new.geometry.moe_intermediate_size == N and old.geometry.moe_intermediate_size == 48
    rec = json.loads((out / "config.json").read_text())[WIDENED_KEY]
    assert rec["path"] == str(src.resolve()) and rec["config_hash"] == old.config_hash
    assert rec["moe_intermediate_size"] == 48 and rec["family"] == old.family.name
    assert len(new.weight_files) > 1 and (out / "model.safetensors.index.json").is_file()
    ta, tb = _tensors(src), _tensors(out)
    assert ta.keys() == tb.keys() and {d for d, _ in tb.values()} == {"F16"}
    a, b = _load_all(src), _load_all(out)
    changed = {k for k in ta if ta[k][1] != tb[k][1]}
    assert changed and all(".experts." in k or ".shared_experts." in k for k in changed)
    for k in ta.keys() - changed:
        assert torch.equal(a[k], b[k]), k  # routers, attention, norms, embeddings: copied bit for bit
    assert all(torch.isfinite(t).all() for t in b.values())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    if family.startswith("deepseek"):
        # transformers sizes DeepSeek's shared experts n_shared * moe_intermediate_size: they grow the
        # same exact way (the source's units first, zero down columns after them)
        k = "model.layers.1.mlp.shared_experts."
        assert torch.equal(b[k + "gate_proj.weight"][:48], a[k + "gate_proj.weight"])
        assert torch.equal(b[k + "down_proj.weight"][:, :48], a[k + "down_proj.weight"])
        assert not b[k + "down_proj.weight"][:, 48:].any()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_store_and_info_follow_the_new_geometry(family, tiny_models, widened, tmp_path):
    from toolkit.runtime.expert_store import ExpertStore, build_store

    src, out = tiny_models[family], widened[family]
    old, new = inspect_model_dir(src), inspect_model_dir(out)
    d_old, d_new = info(str(src)), info(str(out))
    assert d_new["moe_intermediate_size"] == N and d_new["params_per_expert"] > d_old["params_per_expert"]
    for dt in ("fp16", "int8", "int4"):
        assert d_new["bytes_per_expert"][dt] == blob_bytes(new.geometry, dt) > d_old["bytes_per_expert"][dt]
    n_exp = d_old["routed_experts_total"]
    grow = n_exp * (d_new["params_per_expert"] - d_old["params_per_expert"])
    grow += len(old.geometry.moe_layers) * 3 * old.geometry.hidden_size * (new.geometry.shared_intermediate_size
                                                                          - old.geometry.shared_intermediate_size)
    assert d_new["checkpoint_bytes"] - d_old["checkpoint_bytes"] == 2 * grow  # fp16: two bytes a weight
    assert d_new["non_expert_params"] - d_old["non_expert_params"] == grow - n_exp * (
        d_new["params_per_expert"] - d_old["params_per_expert"])

    layer, i = len(old.geometry.moe_layers) - 1, 48  # the store indexes MoE layers 0..L-1
    for dt in ("int4", "int8", "fp16"):
        sa = ExpertStore(build_store(old, tmp_path / f"a-{dt}.spx", dt, progress=False), old)
        sb = ExpertStore(build_store(new, tmp_path / f"b-{dt}.spx", dt, progress=False), new)
        assert sb.blob_size == blob_bytes(new.geometry, dt) and sa.blob_size == blob_bytes(old.geometry, dt)
        for e in (0, 5):
            wa, wb = sa.weights(layer, e), sb.weights(layer, e)
            assert wb["down"].shape == (old.geometry.hidden_size, N)
            # the source's quantised blocks are intact: gate/up rows keep their inputs, and down's
            # last int4 group of 32 is padded with the added zero columns as the store pads it
            assert torch.equal(wb["gate"][:i], wa["gate"]) and torch.equal(wb["up"][:i], wa["up"])
            assert torch.equal(wb["down"][:, :i], wa["down"]) and not wb["down"][:, i:].any()
            assert wb["gate"][i:].abs().sum() > 0 and wb["up"][i:].abs().sum() > 0  # ordinary rows
            for role in ("bias_gate", "bias_up"):
                if role in wa:
                    assert torch.equal(wb[role][:i], wa[role]) and not wb[role][i:].any()
            if "bias_down" in wa:
                assert torch.equal(wb["bias_down"], wa["bias_down"])


def _logits(model: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_model(model, dtype="float32").model(ids).logits


def _same_logits(a: Path, b: Path) -> bool:
    ids = torch.tensor([[1, 17, 300, 42, 7, 999]])
    la, lb = _logits(a, ids), _logits(b, ids)
    return bool((la - lb).abs().max() <= 1e-5 * max(1.0, float(la.abs().max())))


def test_fused_experts_stored_in_out_orientation(tiny_models, tmp_path):
    """Real Qwen3-VL checkpoints store fused experts [E, in, out] (transformers transposes them on
    load); the widened checkpoint keeps that orientation and still computes the same."""
    src = _rewrite(tiny_models["qwen3_vl_moe"], tmp_path / "src",
                   lambda k, v: v.transpose(1, 2) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
    out = tmp_path / "wide"
    widen_checkpoint(src, out, N, progress=False)
    h = read_header(out / "model.safetensors")
    key = "model.language_model.layers.0.mlp.experts."
    assert h[key + "gate_up_proj"]["shape"] == [8, 64, 2 * N] and h[key + "down_proj"]["shape"] == [8, N, 64]
    assert _same_logits(src, out)
    # hidden 64 = width 64 makes down_proj square: transformers would take it as [out, in] (its own
    # layout), not as the [in, out] the source is stored in: refused, nothing written
    _refused(lambda: widen_checkpoint(src, tmp_path / "sq", 64, progress=False),
             "--moe-intermediate-size 64", "down_proj", "square")
    assert not (tmp_path / "sq").exists()
    # GPT-OSS's fused layout is fixed ([in, out], no conversion): a square down_proj is unambiguous
    widen_checkpoint(tiny_models["gpt_oss"], tmp_path / "g", 64, progress=False)
    assert (read_header(tmp_path / "g" / "model.safetensors")["model.layers.0.mlp.experts.down_proj"]["shape"]
            == [8, 64, 64])
    assert _same_logits(tiny_models["gpt_oss"], tmp_path / "g")


def test_added_units_are_seeded_ordinary_values(tiny_models, tmp_path):
    src = tiny_models["olmoe"]
    a = widen_checkpoint(src, tmp_path / "a", N, progress=False)
    widen_checkpoint(src, tmp_path / "b", N, progress=False)
    widen_checkpoint(src, tmp_path / "c", N, progress=False, seed=1)
    assert a["shards"] == ["model.safetensors"] and not (tmp_path / "a" / "model.safetensors.index.json").exists()
    one = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert one == (tmp_path / "b" / "model.safetensors").read_bytes()  # deterministic
    assert one != (tmp_path / "c" / "model.safetensors").read_bytes()  # the seed draws other rows
    s, wa, wc = _load_all(src), _load_all(tmp_path / "a"), _load_all(tmp_path / "c")
    k = "model.layers.0.mlp.experts.3.gate_proj.weight"
    old_std, new_std = s[k].float().std(), wa[k][48:].float().std()
    assert 0.7 < new_std / old_std < 1.3 and not torch.equal(wa[k][48:], wc[k][48:])
    assert torch.equal(wa[k][:48], wc[k][:48])


def test_a_bf16_source_stays_bf16(tiny_models, tmp_path):
    src = _rewrite(tiny_models["mixtral"], tmp_path / "src", lambda k, v: v.to(torch.bfloat16))
    widen_checkpoint(src, tmp_path / "wide", N, progress=False)
    assert {d for d, _ in _tensors(tmp_path / "wide").values()} == {"BF16"}
    assert model_info(inspect_model_dir(tmp_path / "wide"))["moe_intermediate_size"] == N


def _refused(fn, *fragments) -> str:
    with pytest.raises(SpecPrefetchError) as e:
        fn()
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line
    for f in fragments:
        assert str(f) in line, (f, line)
    return line


def test_refusals_are_one_line_and_write_nothing(tiny_models, tmp_path, monkeypatch):
    src = tiny_models["olmoe"]
    out = tmp_path / "out"

    def wid(source=src, n=N, o=out, **kw):
        return lambda: widen_checkpoint(source, o, n, progress=False, **kw)

    # the width must grow
    _refused(wid(n=48), "--moe-intermediate-size 48", "not larger", "(48 in", "config.json")
    _refused(wid(n=16), "--moe-intermediate-size 16")
    # not a checkpoint, as `info` refuses it
    _refused(wid(source=tmp_path / "missing"), "model directory not found")
    (tmp_path / "empty").mkdir()
    _refused(wid(source=tmp_path / "empty"), "no config.json")
    (tmp_path / "cfg").mkdir()
    shutil.copy(src / "config.json", tmp_path / "cfg" / "config.json")
    _refused(wid(source=tmp_path / "cfg"), "no *.safetensors weights found")
    # a model that is not a MoE family of the toolkit
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    _refused(wid(source=tmp_path / "llama"), "config.json", "model_type 'llama' is not a supported MoE family")
    # a MoE family's config whose every layer is dense
    shutil.copytree(tiny_models["qwen3_moe"], tmp_path / "dense")
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    (tmp_path / "dense" / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [0, 1, 2, 3]}))
    _refused(wid(source=tmp_path / "dense"), "config.json", "describes no MoE layer")
    # a family whose experts widen does not know to be gated MLPs (the table of gated families)
    monkeypatch.delitem(W.GATED, "olmoe")
    _refused(wid(), "config.json", "family olmoe's routed experts are not gated MLPs")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg", "dense", "empty", "llama"]  # nothing written

    # an existing output: --overwrite needed; then only a checkpoint widen wrote is replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    _refused(wid(o=tmp_path / "mine"), "--out", "already exists", "--overwrite")
    _refused(wid(o=tmp_path / "mine", overwrite=True), "not a specprefetch artifact")
    other = tiny_models["mixtral"]
    before = (other / "model.safetensors").read_bytes()
    _refused(wid(o=other, overwrite=True), "widen did not write", WIDENED_KEY)
    assert (other / "model.safetensors").read_bytes() == before
    # never an input
    _refused(wid(o=src, overwrite=True), "input of this command")
    _refused(wid(o=src / "sub", overwrite=True), "inside", "input of this command")
    _refused(wid(o=src.parent, overwrite=True), "holds", "input of this command")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg", "dense", "empty", "llama", "mine"]


def test_overwrite_replaces_a_widened_checkpoint_whole(tiny_models, tmp_path):
    src, out = tiny_models["qwen3_moe"], tmp_path / "wide"
    first = widen_checkpoint(src, out, N, progress=False, shard_bytes=SMALL)
    assert len(first["shards"]) > 1
    second = widen_checkpoint(src, out, 96, overwrite=True, progress=False)
    assert second["shards"] == ["model.safetensors"]
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    assert inspect_model_dir(out).geometry.moe_intermediate_size == 96
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wide"]  # no work directory, lock or OUT.old left


def test_overwrite_refuses_a_widened_checkpoint_saved_again(tiny_models, tmp_path):
    """A model saved from a widened one (a fine-tune) keeps config.json's record, but not widen's marker
    of its files: --overwrite refuses it and leaves it whole."""
    from transformers import AutoModelForCausalLM

    src, out = tiny_models["qwen3_moe"], tmp_path / "wide"
    widen_checkpoint(src, out, N, progress=False)
    tuned = tmp_path / "tuned"
    AutoModelForCausalLM.from_pretrained(out).save_pretrained(tuned, max_shard_size="50KB")
    shutil.copy(out / W.MARKER, tuned / W.MARKER)  # even with widen's marker copied beside its files
    before = {p.name: p.read_bytes() for p in tuned.iterdir()}
    assert W.WIDENED_KEY in json.loads((tuned / "config.json").read_text())
    _refused(lambda: widen_checkpoint(src, tuned, 96, overwrite=True, progress=False), "--out", "not as widen wrote")
    assert {p.name: p.read_bytes() for p in tuned.iterdir()} == before


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupted_widen_leaves_nothing(error, tiny_models, tmp_path, monkeypatch):
    real, calls = W._write_shard, []

    def dies_on_second(path, tensors, bar):
        calls.append(path)
        if len(calls) == 2:
            raise error("stop")
        real(path, tensors, bar)

    monkeypatch.setattr(W, "_write_shard", dies_on_second)
    with pytest.raises((error, SpecPrefetchError)):
        widen_checkpoint(tiny_models["olmoe"], tmp_path / "out" / "wide", N, progress=False, shard_bytes=SMALL)
    assert len(calls) == 2
    assert not any(tmp_path.iterdir())  # no OUT, no work directory, no lock, not even the parent made for it


def test_widen_command(tiny_models, tmp_path):
    out = tmp_path / "wide"
    r = CliRunner().invoke(main, ["widen", str(tiny_models["gpt_oss"]), "--moe-intermediate-size", "64",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "48 -> 64" in r.output and str(out) in r.output
    assert inspect_model_dir(out).geometry.moe_intermediate_size == 64
    for args, fragment in ((["--moe-intermediate-size", "64", "--out", str(out)], "already exists"),
                           (["--moe-intermediate-size", "32", "--out", str(tmp_path / "x")],
                            "--moe-intermediate-size 32"),
                           (["--moe-intermediate-size", "64", "--out", str(tiny_models["olmoe"]), "--overwrite"],
                            "widen did not write")):
        r = CliRunner().invoke(main, ["widen", str(tiny_models["gpt_oss"]), *args])
        lines = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
        assert r.exit_code == 2 and len(lines) == 1 and fragment in lines[0], r.output
        assert "Traceback" not in r.output
    r = CliRunner().invoke(main, ["widen", str(tiny_models["gpt_oss"]), "--moe-intermediate-size", "96",
                                  "--out", str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert inspect_model_dir(out).geometry.moe_intermediate_size == 96
