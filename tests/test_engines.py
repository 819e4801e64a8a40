"""`toolkit.engines.run`, the one path of `specprefetch run` for every engine: --check's default and its
missing-source error, the JSON's shape (policy and the engine's header before the runs), and the one
mismatch rule (the JSON and the decision log written first; then an error for an exact engine, a note
for the others). Fake engines (a generate that returns fixed tokens) isolate the rule from the runners,
whose own tests check their tokens against transformers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from export.session import ModelSource
from toolkit.engines import Engine, run
from toolkit.errors import SpecPrefetchError


class Tok:
    decode = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def _runs(prompts, tokens):
    return [{"prompt": p, "tokens": list(tokens), "text": "", "ttft_ms": 1.0, "tpot_ms": 1.0, "tpot_p95_ms": 1.0,
             "stall_ms_per_token": 0.0, "hit_rate": 1.0, "mib_read": 0.0, "peak_pool_bytes": 0, "budget_bytes": 1,
             "matches_unmodified_model": None} for p in prompts]


def engine(tmp_path, *, exact: bool, ours=(1, 2, 3), ref=(1, 2, 3), source: Path | None = None, extra=None,
           resolved: list | None = None) -> Engine:
    class Source(ModelSource):
        @property
        def model(self):
            if resolved is not None:
                resolved.append("model")
            return source

    def generate(prompts, encoded, n, events):
        return _runs(prompts, ours), dict(extra or {}), "# log\n" if events else None

    return Engine(name="fake", policy="on-demand+lru", label="fake-model", exact=exact, mismatch="WHY",
                  tokenizer=Tok(), generate=generate, summary=lambda r: "summary", source=Source("fake", source),
                  check_shipped=False, reference=lambda encoded, n: [list(ref) for _ in encoded])


def test_matching_tokens_and_the_json_shape(tmp_path, capsys):
    out = tmp_path / "r.json"
    e = engine(tmp_path, exact=True, source=tmp_path, extra={"engine": "native-host", "policy": "fate+lru", "x": 1})
    r = run(e, ["ab", "cd"], 3, check=True, json_out=out, events_out=tmp_path / "ev.log")
    j = json.loads(out.read_text())
    assert [k for k in j if k != "specprefetch_report"][:3] == ["policy", "engine", "runs"]
    assert j["policy"] == "fate+lru" and j["x"] == 1 and r["runs"][0]["matches_unmodified_model"] is True
    assert (tmp_path / "ev.log").read_text() == "# log\n"
    assert "summary, tokens match the unmodified model" in capsys.readouterr().out


def test_an_exact_engine_fails_after_writing_the_evidence(tmp_path):
    out, ev = tmp_path / "r.json", tmp_path / "ev.log"
    with pytest.raises(SpecPrefetchError, match=r"fake: tokens differ .* for 2 of 2 prompt\(s\), first 'ab' .*WHY"):
        run(engine(tmp_path, exact=True, ours=(1, 2, 4), source=tmp_path), ["ab", "cd"], 3, check=True,
            json_out=out, events_out=ev)
    j = json.loads(out.read_text())
    assert [x["matches_unmodified_model"] for x in j["runs"]] == [False, False] and ev.is_file()


def test_other_engines_note_a_difference_and_succeed(tmp_path, capsys):
    out = tmp_path / "r.json"
    run(engine(tmp_path, exact=False, ours=(1, 2, 4), source=tmp_path), ["ab"], 3, check=True, json_out=out,
        events_out=None)
    assert json.loads(out.read_text())["runs"][0]["matches_unmodified_model"] is False
    err = capsys.readouterr().err
    assert "note: fake-model (fake) decodes other tokens than the unmodified model for prompt 'ab' (WHY)" in err


def test_check_needs_the_source_and_no_check_never_resolves_it(tmp_path):
    with pytest.raises(SpecPrefetchError, match="--check: the unmodified model of fake is not on this machine"):
        run(engine(tmp_path, exact=True, source=None), ["ab"], 3, check=True, json_out=tmp_path / "r.json",
            events_out=None)
    assert not (tmp_path / "r.json").exists()          # refused before anything ran
    resolved: list = []
    run(engine(tmp_path, exact=True, ours=(9,), source=None, resolved=resolved), ["ab"], 3, check=False,
        json_out=tmp_path / "r2.json", events_out=None)
    assert resolved == []                               # --no-check: the source (a bundle's hashing) untouched
    assert json.loads((tmp_path / "r2.json").read_text())["runs"][0]["matches_unmodified_model"] is None


def test_an_empty_prompt_is_refused(tmp_path):
    with pytest.raises(SpecPrefetchError, match="--prompt '' is empty after tokenisation"):
        run(engine(tmp_path, exact=False), [""], 3, check=False, json_out=tmp_path / "r.json", events_out=None)


def test_the_python_engine_resolves_its_source_only_for_check(tmp_path):
    """python_engine over a session: building it and `run --no-check` never resolve the source (for a
    bundle that hashes every weight shard); the default check resolves it."""
    from types import SimpleNamespace

    from toolkit.engines import python_engine

    resolved: list = []

    class Source(ModelSource):
        @property
        def model(self):
            resolved.append("model")
            return None

    gen = SimpleNamespace(tokens=[1], to_json=lambda: _runs(["x"], [1])[0])
    s = SimpleNamespace(label="b", kind="bundle", notes=[], tokenizer=Tok(), source=Source("b", None),
                        runner=SimpleNamespace(store=SimpleNamespace(dtype="int4"), run=lambda ids, n, events: gen))
    s.tokenizer.decode = lambda t, skip_special_tokens=False: ""
    e = python_engine(s, "on-demand+lru")
    assert resolved == []
    run(e, ["ab"], 1, check=False, json_out=tmp_path / "r.json", events_out=None)
    assert resolved == []
    run(e, ["ab"], 1, check=None, json_out=tmp_path / "r2.json", events_out=None)
    assert resolved                                     # the shipped-model default looked at it
