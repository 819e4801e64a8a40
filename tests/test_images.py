"""Image prompts through the runners (export/images.py, toolkit/runtime/images.py): M-RoPE positions and
rotary tables against transformers, `run --image` against transformers' own generate with the same
pixels (a model directory in make test, an ExecuTorch bundle with its vision method in the slow tier),
and one-line refusals of bad images and of models that take none."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import cli
from toolkit.errors import SpecPrefetchError

PROMPT = "a picture of"


def _png(path: Path, h: int, w: int, seed: int) -> Path:
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def vl(tiny_models):
    return tiny_models["qwen3_vl_moe"]


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("pictures")
    return [_png(d / "a.png", 80, 70, 1), _png(d / "b.png", 50, 70, 0), _png(d / "c.png", 64, 40, 7)]


def test_rope_rows_are_transformers_positions(vl):
    """Two images of different grids between text runs: every position's (t, h, w) and the delta equal
    the model's own get_rope_index."""
    from toolkit.models.loader import load_model
    from toolkit.runtime.images import rope_rows

    lm = load_model(vl)
    cfg = lm.model.config
    vs, pad, ve = cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id
    grids = [(1, 4, 6), (1, 2, 4)]  # merged: 2x3 and 1x2
    ids = [20, 21, vs, *[pad] * 6, ve, 30, vs, *[pad] * 2, ve, 40, 41, 42]
    starts = [3, 12]
    mm = torch.tensor([[int(t == pad) for t in ids]])
    want, delta = lm.model.model.get_rope_index(torch.tensor([ids]), mm, torch.tensor(grids))
    got, d = rope_rows(ids, starts, [(g[1] // 2, g[2] // 2) for g in grids])
    assert torch.equal(got, want[:, 0]) and d == int(delta)
    assert d < 0  # an image takes fewer rotary steps than tokens
    text, _ = rope_rows([1, 2, 3], [], [])
    assert torch.equal(text, torch.arange(3).expand(3, -1))


def test_mrope_layer_tables_are_transformers_exactly(vl):
    """The layer graph's M-RoPE gather from the 1-D tables equals the model's rotary module bit for bit."""
    from export.graphs import StepModel, text_model
    from toolkit.models.loader import inspect_model_dir, load_dense_model

    spec = inspect_model_dir(vl)
    model = load_dense_model(spec)
    steps = StepModel(spec, model, max_seq=64)
    assert sorted(set(steps.mrope_axes.tolist())) == [0, 1, 2]
    g = steps.graphs("buffer")["layer_0"]
    pos = torch.tensor([[3, 4, 4, 4, 4, 8, 9], [3, 4, 4, 5, 5, 8, 9], [3, 4, 5, 4, 5, 8, 9]])
    mine = g._rope(None, None, pos)
    ref = text_model(model).rotary_emb(torch.zeros(1, 7, 1), pos.view(3, 1, 7))
    for a, b in zip(mine, ref):
        assert torch.equal(a, b.float())
    assert len(steps.example_inputs("layer_0", "buffer")) == 3  # hidden, cache position, M-RoPE positions
    # io mode (QNN): the cache position's one-hot, and last the M-RoPE positions as a one-hot row per axis,
    # whose rows (a matmul with the tables, combined by 0/1 channel masks) are transformers' exactly too
    io = steps.example_inputs("layer_0", "io")
    assert len(io) == 6 and io[1].shape == (1, 64) and io[-1].shape == (3, 1, 64)
    gio = steps.graphs("io")["layer_0"]
    mine = gio._rope(None, None, None, torch.nn.functional.one_hot(pos, 64).float())
    for a, b in zip(mine, ref):
        assert torch.equal(a, b.float())


def test_run_image_model_directory_matches_transformers(vl, pictures, tmp_path):
    """`run MODEL --image A --image B --check`: the image prompt through the streamed experts gives
    transformers' greedy tokens for the same pixels, for several predictors at one pool; another image
    gives other tokens."""
    from toolkit.traces.data import open_image
    from export.session import open_session, reference_tokens
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.runner import RunConfig

    code, out = cli("run", vl, "--prompt", PROMPT, "--image", pictures[0], "--image", pictures[1],
                    "--max-new-tokens", 6, "--policy", "on-demand+lru", "--check", "--json", tmp_path / "r.json")
    assert code == 0, out
    r = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert r["matches_unmodified_model"] is True and r["images"] == [str(p) for p in pictures[:2]]
    from toolkit.models.loader import load_image_processor

    proc = load_image_processor(vl)  # each image its processor's own grid: merged patches + 2 markers
    grids = [proc(images=[open_image(p)], return_tensors="pt")["image_grid_thw"][0] for p in pictures[:2]]
    assert r["image_tokens"] == sum(int(g.prod()) // 4 + 2 for g in grids)
    s = open_session(vl, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=0.25), max_seq=96,
                     predictors=["on-demand", "next-gate", "previous-token", "oracle"])
    text = s.encode(PROMPT)
    ip = s.image_prompt([pictures[2]], text)
    ref = reference_tokens(vl, ip.ids, 6, images=[pictures[2]], vision=s.vision)
    for pol in ("on-demand+lru", "next-gate+prediction", "previous-token+lru", "oracle+belady"):
        s.runner.configure(policy=Policy.parse(pol))
        assert s.runner.run(ip.ids, 6, images=ip).tokens == ref, pol
    other = s.image_prompt([pictures[0]], text)
    s.runner.configure(policy=Policy("on-demand", "lru"))
    assert s.runner.run(other.ids, 6, images=other).tokens != ref
    # without the image rows (the image tokens' own embeddings) the tokens are not the model's
    assert s.runner.run(ip.ids, 6).tokens != ref


def test_bad_images_are_refused_in_one_line(vl, pictures, tmp_path, tiny_models):
    from toolkit.traces.data import open_image

    d = tmp_path
    (d / "text.png").write_text("not an image")
    data = pictures[0].read_bytes()
    (d / "cut.png").write_bytes(data[:len(data) // 2])
    big = d / "big.png"  # 20000 x 20000: refused from its header (a few KiB of zeros, never decoded)
    from PIL import Image
    Image.new("L", (20000, 20000)).save(big, compress_level=1)
    Image.new("RGB", (8, 8)).save(d / "pic.gif")
    for path, msg in ((d / "text.png", "not a readable PNG, JPEG or PPM image"),
                      (d / "cut.png", "not a readable PNG, JPEG or PPM image"),
                      (big, "20000x20000 pixels, over the 64 megapixels"),
                      (d / "pic.gif", "a GIF image; PNG, JPEG and PPM are taken"),
                      (d / "missing.png", "no such file"), (d, "a directory, not an image file")):
        with pytest.raises(SpecPrefetchError) as e:
            open_image(path)
        assert str(e.value).startswith(f"--image {path}: ") and msg in str(e.value), e.value
        assert "\n" not in str(e.value)
    assert open_image(_png(d / "one.png", 1, 1, 3)).size == (1, 1)  # resized up by the processor's rule
    # a camera's multi-picture JPEG (MPO) is a JPEG: its first picture
    first = Image.open(_png(d / "m1.png", 24, 32, 8)).convert("RGB")
    first.save(d / "photo.jpg", format="MPO", save_all=True, append_images=[Image.new("RGB", (24, 32))])
    assert Image.open(d / "photo.jpg").format == "MPO"
    want = np.asarray(Image.open(d / "photo.jpg").convert("RGB"))
    assert np.array_equal(np.asarray(open_image(d / "photo.jpg")), want)
    code, out = cli("run", vl, "--prompt", PROMPT, "--image", d / "cut.png", "--policy", "on-demand+lru",
                    "--json", d / "r.json")
    assert code != 0 and f"--image {d / 'cut.png'}: not a readable" in out and not (d / "r.json").exists()
    code, out = cli("run", vl, "--prompt", PROMPT, "--image", d / "one.png", "--max-new-tokens", 2,
                    "--policy", "on-demand+lru", "--json", d / "one.json")
    assert code == 0, out  # a 1x1 image is upscaled to the processor's smallest grid
    code, out = cli("run", tiny_models["qwen3_moe"], "--prompt", PROMPT, "--image", pictures[0],
                    "--policy", "on-demand+lru", "--json", d / "t.json")
    assert code != 0 and "takes no images: a text-only model" in out, out


def _image_runs(bundle: Path, pictures: list[Path], tmp_path: Path):
    """A two-image prompt through `bundle` (Python engine) gives transformers' tokens for four predictors at
    one pool; then both engines, on text and on the two images (the native runner decodes and preprocesses
    them itself, src/image.cpp), give equal tokens and decision logs, the unmodified model's.
    Returns (session, image prompt, transformers' tokens)."""
    from export.session import open_session, reference_tokens
    from toolkit.runtime.events import decisions
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.runner import RunConfig

    s = open_session(bundle, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=0.06),
                     predictors=["on-demand", "next-gate", "previous-token", "oracle"])
    ip = s.image_prompt([pictures[1], pictures[2]], s.encode(PROMPT))
    ref = reference_tokens(s.source_model, ip.ids, 6, images=[pictures[1], pictures[2]], vision=s.vision)
    for pol in ("on-demand+lru", "next-gate+prediction", "previous-token+lru", "oracle+belady"):
        s.runner.configure(policy=Policy.parse(pol))
        assert s.runner.run(ip.ids, 6, images=ip).tokens == ref, pol
    for tag, imgs in (("text", ()), ("images", (pictures[1], pictures[2]))):
        for engine in ("python", "native"):
            args = [a for img in imgs for a in ("--image", img)]
            code, out = cli("run", bundle, "--engine", engine, "--prompt", PROMPT, *args, "--max-new-tokens", 6,
                            "--policy", "next-gate+prediction", "--pool-mib", "0.06", "--check", "--read-budget-kib",
                            "off", "--json", tmp_path / f"{tag}-{engine}.json",
                            "--events", tmp_path / f"{tag}-{engine}.ev")
            assert code == 0, out
        py, nat = (json.loads((tmp_path / f"{tag}-{e}.json").read_text())["runs"][0] for e in ("python", "native"))
        assert py["tokens"] == nat["tokens"] and nat["matches_unmodified_model"] is True, tag
        assert decisions((tmp_path / f"{tag}-python.ev").read_text().splitlines()) == \
            decisions((tmp_path / f"{tag}-native.ev").read_text().splitlines()), tag
        if imgs:
            assert nat["image_tokens"] == 2 * (4 + 2) and nat["prompt_ids"][:6] == ip.ids[:6]
            assert nat["tokens"] == ref  # the same image prompt as the predictors' loop above
    return s, ip, ref


# -- an ExecuTorch bundle with its vision method (conftest: vl_bundle) ------------------------------------

@pytest.mark.slow  # an ExecuTorch export, ~45 s on two cores
def test_bundle_vision_method_and_image_runs(vl_bundle, pictures, tmp_path):
    """The bundle's vision method matches the eager tower (parity.json), the manifest carries the
    preprocessing, and `run BUNDLE --image` gives transformers' tokens for the same resized pixels, for
    several predictors; the native runner still runs its text prompts as the Python engine does."""

    m = json.loads((vl_bundle / "manifest.json").read_text())
    v = m["graphs"]["vision"]
    assert v["image_size"] == [64, 64] and v["grid_thw"] == [1, 4, 4] and v["tokens"] == 4
    assert v["preprocess"]["image_mean"] == [0.5] * 3 and v["preprocess"]["resize"] == "bicubic"
    assert m["kv"]["rope"] == "mrope" and "vision" in m["graphs"]["methods"]
    p = json.loads((vl_bundle / "parity.json").read_text())
    assert p["vision"]["passed"] and p["vision"]["max_rel_diff"] < 1e-5
    code, out = cli("run", vl_bundle, "--prompt", PROMPT, "--image", pictures[0], "--max-new-tokens", 6,
                    "--policy", "on-demand+lru", "--check", "--json", tmp_path / "r.json")
    assert code == 0, out
    r = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert r["matches_unmodified_model"] is True and r["image_tokens"] == 4 + 2
    _image_runs(vl_bundle, pictures, tmp_path)
    code, out = cli("run", vl_bundle, "--engine", "native", "--prompt", PROMPT, "--image", tmp_path / "none.png",
                    "--json", tmp_path / "bad.json")
    assert code != 0 and f"{tmp_path / 'none.png'}" in out and "\n" not in out.strip(), out
    # the runner itself never writes over an --image input
    import subprocess

    from android_runner.build import build, command

    img = tmp_path / "keep.png"
    img.write_bytes(pictures[0].read_bytes())
    r = subprocess.run([*command(build(vl_bundle, "host"), "host"), str(vl_bundle), "--prompt", PROMPT, "--image",
                        str(img), "--json", str(img)], capture_output=True, text=True)
    assert r.returncode != 0 and f"--json {img}: the same file as --image {img}" in r.stderr, r.stderr
    assert img.read_bytes() == pictures[0].read_bytes()


# -- a QNN bundle with its vision graph (conftest: vl_qnn_bundle) ---------------------------------------

@pytest.mark.slow  # a QNN export (~11 s) and the QNN runner's build
def test_qnn_bundle_vision_graph_and_image_runs(vl_qnn_bundle, pictures, tmp_path):
    """A QNN bundle carries the vision tower as an fp16 HTP graph (parity on the simulator) and M-RoPE layer
    graphs (rope_onehot); `run --image` gives transformers' tokens for every predictor at one pool, and the
    native runner's QNN backend gives the Python engine's tokens and decisions for text and two images."""
    from export.session import reference_tokens
    from toolkit.runtime.policy import Policy

    m = json.loads((vl_qnn_bundle / "manifest.json").read_text())
    v = m["graphs"]["vision"]
    assert v["precision"] == "fp16" and v["grid_thw"] == [1, 4, 4] and v["tokens"] == 4
    assert m["kv"]["rope"] == "mrope" and "vision" in m["graphs"]["files"] and "vision" in m["graphs"]["binaries"]
    p = json.loads((vl_qnn_bundle / "parity.json").read_text())
    assert p["passed"] and p["vision"]["passed"] and 0 < p["vision"]["max_rel_diff"] < 2e-2  # fp16 on the HTP
    s, ip, ref = _image_runs(vl_qnn_bundle, pictures, tmp_path)
    other = s.image_prompt([pictures[0]], s.encode(PROMPT))  # another image: transformers' tokens for it
    s.runner.configure(policy=Policy.parse("on-demand+lru"))
    assert s.runner.run(other.ids, 6, images=other).tokens == \
        reference_tokens(s.source_model, other.ids, 6, images=[pictures[0]], vision=s.vision)

@pytest.mark.slow  # a QNN a16w8 export (~15 s)
def test_qnn_qdq_bundle_keeps_the_vision_tower_fp16(vl, pictures, tmp_path):
    """--quant a16w8: the layer graphs (their rope_onehot input included) are calibrated on text prompts,
    which never reach the tower, so the vision graph is compiled in fp16 as it is; it passes the fp16 vision
    parity and an image prompt runs. (The tiny random model's near-uniform logits need the text bounds
    relaxed for 8-bit weights, as test_export's QDQ test does; the vision bound is not relaxed.)"""
    from export.bundle import ExportConfig, export_bundle

    tol = {"max_abs_logit_diff": 10.0, "max_rel_logit_diff": 2.0, "max_median_logit_diff": 10.0,
           "min_topk_agreement": 0.0, "min_next_token_agreement": 0.0, "min_free_token_match": 0.0}
    b = tmp_path / "b"
    m = export_bundle(vl, b, ExportConfig(target="qnn", quant="a16w8", max_seq=64, image_size=(64, 64),
                                          parity_prompts=1, prompt_tokens=10, decode_tokens=3, calibration_prompts=2,
                                          tolerance=tol, progress=False))
    assert m["quantization"]["dense"] == "a16w8" and m["graphs"]["vision"]["precision"] == "fp16"
    assert m["kv"]["rope"] == "mrope" and any(k.startswith("prefill_") for k in m["graphs"]["files"])
    p = json.loads((b / "parity.json").read_text())
    assert p["vision"]["passed"] and p["vision"]["tolerance"] == 2e-2 and p["vision"]["max_rel_diff"] < 2e-2
    code, out = cli("run", b, "--prompt", PROMPT, "--image", pictures[0], "--max-new-tokens", 3,
                    "--policy", "next-gate+prediction", "--json", tmp_path / "r.json")
    assert code == 0, out
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["image_tokens"] == 4 + 2


@pytest.mark.slow
def test_a_qnn_vision_block_is_checked_by_both_engines(vl_qnn_bundle, tmp_path):
    """A QNN bundle's graphs.vision: its method must be one of graphs.files, its precision fp32 or fp16, and it
    needs M-RoPE layer graphs; each damage refused by both engines, naming the field."""
    import shutil
    import subprocess

    from android_runner.build import build, command
    from export.manifest import validate_bundle

    b = Path(shutil.copytree(vl_qnn_bundle, tmp_path / "b"))
    good = json.loads((b / "manifest.json").read_text())
    runner = [*command(build(vl_qnn_bundle, "host"), "host"), str(b), "--prompt", PROMPT]
    for change, py_msg, cpp_msg in (
            (lambda m: m["graphs"]["vision"].update(method="visionx"), "method one of graphs.methods (graphs.files",
             "is not one of the graphs of graphs.files"),
            (lambda m: m["graphs"]["vision"].update(precision="int4"), 'graphs.vision.precision is "int4"',
             "graphs.vision.precision 'int4': expected fp32 or fp16"),
            (lambda m: m["kv"].update(rope="1d"), "graphs.vision is present but kv.rope is '1d'",
             "graphs.vision is present but kv.rope is not")):
        m = json.loads(json.dumps(good))
        change(m)
        (b / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(SpecPrefetchError, match=re.escape(py_msg)):
            validate_bundle(b, hash_store=False)
        r = subprocess.run(runner, capture_output=True, text=True)
        assert r.returncode != 0 and cpp_msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_vision_block_needs_mrope(vl_bundle, tmp_path):
    """A manifest whose graphs.vision comes without M-RoPE layer graphs is refused by both engines; so are
    damaged vision blocks, each by the field at fault."""
    import shutil

    from export.manifest import validate_bundle

    b = Path(shutil.copytree(vl_bundle, tmp_path / "b"))
    good = json.loads((b / "manifest.json").read_text())

    def altered(change) -> dict:
        m = json.loads(json.dumps(good))
        change(m)
        (b / "manifest.json").write_text(json.dumps(m))
        return m

    for change, msg in (
            (lambda m: m["graphs"]["vision"]["preprocess"].pop("min_pixels"),
             "graphs.vision.preprocess.min_pixels is null, expected an integer in 1..1099511627776 (a bundle exported "
             "before this field existed: export it again)"),
            (lambda m: m["graphs"]["vision"]["preprocess"].update(image_std=[0.5, 0, 0.5]), "image_std must list 3 "
             "finite numbers, none zero"),
            (lambda m: m["graphs"]["vision"]["preprocess"].update(rescale_factor=0), "rescale_factor must be a finite"),
            (lambda m: m["graphs"]["vision"].update(tokens=5), "image_size, grid_thw, patch and merge sizes, tokens"),
            (lambda m: m["graphs"]["vision"].update(method="visionx"), "method one of graphs.methods"),
            (lambda m: m["kv"].update(rope="3d"), 'kv.rope is "3d"')):
        altered(change)
        with pytest.raises(SpecPrefetchError, match=re.escape(msg)):
            validate_bundle(b, hash_store=False)
    import subprocess

    from android_runner.build import build, command

    runner = [*command(build(vl_bundle, "host"), "host"), str(b), "--prompt", PROMPT]
    for change, msg in ((lambda m: m["graphs"]["vision"]["preprocess"].update(image_std=[0.5, 0, 0.5]),
                         "image_std nonzero"),
                        (lambda m: m["graphs"]["vision"]["preprocess"].update(rescale_factor=0),
                         "rescale_factor must be above 0"),
                        (lambda m: m["graphs"]["vision"].update(tokens=5), "tokens and the pixel bounds disagree")):
        altered(change)  # the runner's own checks of the same damage (it is run without the Python side here)
        r = subprocess.run(runner, capture_output=True, text=True)
        assert r.returncode != 0 and msg in r.stderr, r.stderr
    altered(lambda m: m["kv"].update(rope="1d"))
    with pytest.raises(SpecPrefetchError, match="graphs.vision is present but kv.rope is '1d'"):
        validate_bundle(b, hash_store=False)
    r = subprocess.run(runner, capture_output=True, text=True)  # the runner built for the bundle, on the altered copy
    assert r.returncode != 0 and "graphs.vision is present but kv.rope is not" in r.stderr, r.stderr


@pytest.mark.slow
def test_image_size_refusals(vl, tiny_models, tmp_path):
    from export.bundle import ExportConfig, export_bundle

    for size, msg in (((60, 64), "must be positive multiples of 32"), ((128, 128), "outside the image processor's")):
        with pytest.raises(SpecPrefetchError, match=msg):
            export_bundle(vl, tmp_path / "b", ExportConfig(target="executorch", image_size=size, progress=False))
    with pytest.raises(SpecPrefetchError, match="--image-size: a text-only model takes no images"):
        export_bundle(tiny_models["qwen3_moe"], tmp_path / "b", ExportConfig(image_size=(64, 64), progress=False))
    with pytest.raises(SpecPrefetchError, match="images are exported for --target executorch and qnn, not qai-hub"):
        export_bundle(vl, tmp_path / "b", ExportConfig(target="qai-hub", image_size=(64, 64), progress=False))
    assert not (tmp_path / "b").exists()
    code, out = cli("export", vl, "--image-size", "64by64", "--out", tmp_path / "c")
    assert code == 2 and "expected HEIGHTxWIDTH" in out


@pytest.mark.slow  # a trace of the tiny VLM (~4 s); eval's image-token split
def test_eval_reports_image_tokens_apart(vl, tmp_path):
    """`eval` on a vision-language trace: recall on the held-out image tokens beside the decode tokens'
    (the oracle's is exact on both), in the JSON and the table."""
    from toolkit.predictors.evaluate import evaluate, markdown
    from toolkit.traces.capture import TraceSettings, run_trace

    rows = []
    for i in range(6):
        _png(tmp_path / f"p{i}.png", 40 + 8 * i, 64, 20 + i)
        rows.append({"text": f"Picture {i}: a chart of the tide at hour {i}.", "image": f"p{i}.png"})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = TraceSettings(prompt_tokens=16, decode_tokens=3, heldout_frac=0.5, hidden_sample=1.0)
    trace = run_trace(vl, [tmp_path / "pairs.jsonl"], tmp_path / "t", s, progress=False)
    r = evaluate(trace, predictors=["next-gate", "previous-token", "oracle"], progress=False)
    assert r["image_tokens"] > 0 and r["decode_tokens"] > 0
    for n in ("next-gate", "previous-token", "oracle"):
        im = r["predictors"][n]["image_tokens"]
        assert set(im["recall_at_k"]) == {"1", "2"} and all(0 <= v <= 1 for v in im["recall_at_k"].values())
    assert r["predictors"]["oracle"]["image_tokens"]["recall_at_k"]["1"] == 1.0
    assert r["predictors"]["next-gate"]["image_tokens"]["recall_at_k"]["1"] < 1.0
    assert f"Held-out image tokens (prompt positions of images, apart from the text): {r['image_tokens']}" \
        in markdown(r)


@pytest.mark.slow  # writes pictures (~1 s)
def test_picture_pairs(tmp_path):
    """The synthetic picture/caption pairs: each caption names the colour and the shape of its picture, the
    JSONL is what `trace --data` reads, an existing directory is refused."""
    from PIL import Image

    from toolkit.embedded.pictures import COLOURS, SHAPES, caption, write_pairs
    from toolkit.traces.data import read_records

    pairs = write_pairs(tmp_path / "p", n=12, seed=3)
    recs = read_records([pairs], allow_images=True)
    assert len(recs) == 12
    for line in pairs.read_text().splitlines():
        row = json.loads(line)
        img = np.asarray(Image.open(pairs.parent / row["image"]))
        # the one colour that covers at least 3% of the picture (the field's noise is darker than every colour)
        named = [c for c, rgb in COLOURS.items() if (img == rgb).all(-1).mean() > 0.03]
        shape = [s for s in SHAPES if f" {s}." in row["text"]]
        assert len(named) == 1 and len(shape) == 1 and caption(named[0], shape[0]) in row["text"], row
    with pytest.raises(SpecPrefetchError, match="already exists"):
        write_pairs(tmp_path / "p", n=1)


@pytest.mark.slow  # ~8 s: every policy x pool over image prompts
def test_bench_cpu_image_prompts(vl, pictures, tmp_path):
    """`bench cpu --image`: image prompts in every round, checked against transformers on the same pixels
    first; the simulator (text) left out with the reason."""
    code, out = cli("bench", "cpu", vl, "--image", pictures[0], "--policies", "on-demand+lru,oracle+belady",
                    "--pool-mib", "0.1", "--prompts", 2, "--prompt-tokens", 12, "--new-tokens", 4, "--rounds", 1,
                    "--json", tmp_path / "b.json")
    assert code == 0, out
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["checked_against_unmodified_model"] is True and r["images"] == [str(pictures[0])]
    assert r["image_tokens_per_prompt"] > 2 and "image prompts" in r["simulated_skipped"]
    assert r["points"][0]["policies"]["oracle+belady"]["hit_rate"] == 1.0


def test_trace_data_refuses_an_image_the_runners_do_not_take(tmp_path):
    """`trace --data`: a GIF (or a 20000x20000 PNG) in the JSONL is refused from its header when the data is
    read, naming FILE:LINE, before any model loads."""
    from PIL import Image

    from toolkit.traces.data import read_records

    Image.new("RGB", (8, 8)).save(tmp_path / "a.gif")
    Image.new("L", (20000, 20000)).save(tmp_path / "big.png", compress_level=1)
    for name, msg in (("a.gif", "a GIF image; PNG, JPEG and PPM are taken"), ("big.png", "20000x20000 pixels")):
        (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x", "image": name}) + "\n")
        with pytest.raises(SpecPrefetchError) as e:
            read_records([tmp_path / "d.jsonl"], allow_images=True)
        assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'}:1: image ") and msg in str(e.value), e.value
