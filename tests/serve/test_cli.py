import argparse
import json
import os
import re
import subprocess
import sys

import pytest

import kimik3
from kimik3 import compilation_cache
from kimik3.checkpoint.hf_export import export_hf
from serve.cli import DEFAULT_MODEL, build_parser, main
from tests import paths

ROOT = str(paths.ROOT)


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    """main() turns JAX's persistent cache on: keep these in-process runs out of the user's cache."""
    monkeypatch.setenv(compilation_cache.ENV, "off")


def _one_line(err: str) -> str:
    """The whole of stderr, which must be one line and no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if the CLI builds or loads a model (flags must be refused before that)."""
    def refuse(*a, **k):
        raise AssertionError("a model was built before the flags were checked")
    monkeypatch.setattr(kimik3, "init", refuse)
    monkeypatch.setattr(kimik3, "load", refuse)


def test_generate_from_a_preset(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "Hello", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "model tiny (random weights, seed 0)" in out and "4 tokens in" in out


def test_generate_from_a_checkpoint_directory(tiny_models, tmp_path, capsys):
    export_hf(tiny_models["tiny-linear"], str(tmp_path))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    expect = kimik3.generate(tiny_models["tiny-linear"], ["Hi"], max_new_tokens=3)[0]
    assert f"tokens: {expect}" in out


def test_bad_model_and_prompt(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--chat"]) == 2
    assert "no chat template" in _one_line(capsys.readouterr().err)


def test_mxfp4_layout_flag(tiny_models, tmp_path, capsys):
    export_hf(tiny_models["tiny"], str(tmp_path))
    args = ["generate", "--model", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "3"]
    assert main(args + ["--mxfp4-layout", "paired"]) == 0
    expect = kimik3.generate(tiny_models["tiny"], ["Hi"], max_new_tokens=3)[0]
    assert f"tokens: {expect}" in capsys.readouterr().out


def test_mla_cache_flag(tiny_models, tmp_path, capsys):
    """--mla-cache fp8 runs the model with an fp8 MLA cache: generate's tokens with that config."""
    export_hf(tiny_models["tiny"], str(tmp_path))
    args = ["generate", "--model", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "3"]
    assert main(args + ["--mla-cache", "fp8"]) == 0
    fp8 = tiny_models["tiny"].replace(cfg=tiny_models["tiny"].cfg.replace(mla_cache_dtype="fp8"))
    expect = kimik3.generate(fp8, ["Hi"], max_new_tokens=3)[0]
    assert f"tokens: {expect}" in capsys.readouterr().out
    # --mla-cache-scale sets Config.mla_cache_scale; alone it is refused
    assert main(args + ["--mla-cache", "fp8", "--mla-cache-scale", "0.25"]) == 0
    fp8s = fp8.replace(cfg=fp8.cfg.replace(mla_cache_scale=0.25))
    expect = kimik3.generate(fp8s, ["Hi"], max_new_tokens=3)[0]
    assert f"tokens: {expect}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["generate", "--prompt", "x", "--max-new-tokens", "2.5"], "--max-new-tokens: expected an integer >= 1"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature: must be >= 0"),
    (["generate", "--prompt", "x", "--top-p", "0"], "--top-p: must be > 0 and <= 1"),
    (["generate", "--prompt", "x", "--top-k", "-2"], "--top-k: must be >= 0"),
    (["generate", "--prompt", "x", "--tensor", "0"], "--tensor: must be >= 1"),
    (["generate", "--prompt", "x", "--mla-cache-scale", "0"], "--mla-cache-scale: must be > 0"),
    (["generate", "--prompt", "x", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["generate"], "the following arguments are required: --prompt"),
    (["batch", "--input", "a", "--output", "b", "--max-batch", "0"], "--max-batch: must be >= 1"),
    (["batch", "--input", "a", "--output", "b", "--host-cache-gb", "-1"], "--host-cache-gb: must be >= 0"),
    (["batch", "--input", "a", "--output", "b", "--cache-memory-gb", "0"], "--cache-memory-gb: must be > 0"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_flags_are_one_line_before_the_model_is_built(argv, message, capsys, no_model_built):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in _one_line(capsys.readouterr().err)


def test_bad_paths_and_flag_combinations_before_the_model_is_built(tmp_path, capsys, no_model_built):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": 1, "prompt": "hi"}) + "\n")
    cases = [
        (["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"],
         f"no such checkpoint directory: {tmp_path / 'nope'}"),
        (["generate", "--model", "kimi-k9", "--prompt", "x"], "no such checkpoint directory: kimi-k9 (nor a preset"),
        (["generate", "--model", str(prompts), "--prompt", "x"], "not a directory"),
        (["generate", "--model", "tiny", "--prompt", "x", "--mxfp4-layout", "paired"],
         "--mxfp4-layout applies to checkpoint directories"),
        (["generate", "--prompt", "x", "--mla-cache-scale", "0.25"], "give it with --mla-cache fp8"),
        (["generate", "--prompt", "x", "--tensor", "64"], "mesh needs 64 devices"),
        (["batch", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.jsonl")],
         "--input " + str(tmp_path / "missing.jsonl") + ": no such file"),
        (["batch", "--input", str(prompts), "--output", str(tmp_path / "no" / "o.jsonl")], "no such directory"),
        (["batch", "--input", str(prompts), "--output", str(tmp_path)], "is a directory"),
        (["batch", "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--dcp", "4", "--page-size", "6"],
         "multiple of the DCP size 4"),
        # several processes: settings are checked before joining (tests/test_multiprocess.py joins)
        (["generate", "--prompt", "x", "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
         "coordinator address 'localhost' must be HOST:PORT"),
        (["generate", "--prompt", "x", "--coordinator", "127.0.0.1:1", "--num-processes", "2"],
         "needs --process-id I as well"),
        (["batch", "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--num-processes", "2",
          "--process-id", "3", "--coordinator", "127.0.0.1:1"], "process id 3 is outside 0..1"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in _one_line(capsys.readouterr().err), argv


def test_batch_cache_flags(tiny_models, tmp_path, capsys):
    """--no-prefix-cache turns the cache off, --cache-block sets its match unit: prompts sharing a
    32-token prefix hit with it on and not with it off, with the same tokens; a block that is not
    a multiple of the page is one line."""
    prefix = list(range(1, 33))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": prefix + [40 + i, 50 + i]}) + "\n" for i in range(6)))
    base = ["batch", "--model", "tiny", "--input", str(prompts), "--max-batch", "2", "--max-seq-len", "128",
            "--page-size", "8", "--max-new-tokens", "3", "--quiet"]
    runs = {}
    for name, extra in (("on", ["--cache-block", "8"]), ("off", ["--no-prefix-cache"])):
        assert main(base + ["--output", str(tmp_path / f"{name}.jsonl")] + extra) == 0
        hit = re.search(r"prefix cache: (\d+) of (\d+) prompt tokens hit", capsys.readouterr().err)
        runs[name] = int(hit.group(1)), sorted((r["id"], r["tokens"]) for r in map(
            json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines()))
    assert runs["on"][0] >= 4 * 32 and runs["off"][0] == 0
    assert runs["on"][1] == runs["off"][1]
    for bad, message in ((["--cache-block", "12"], "--cache-block 12 must be a multiple of --page-size 8"),
                         (["--no-prefix-cache", "--host-cache-gb", "1"], "drop it or drop --no-prefix-cache")):
        assert main(base + ["--output", str(tmp_path / "bad.jsonl")] + bad) == 2
        assert message in _one_line(capsys.readouterr().err)


def test_bad_checkpoints_are_one_line(tiny_models, tmp_path, capsys):
    """A broken config or checkpoint: one line and a non-zero exit; --debug raises with the traceback."""
    good = tmp_path / "good"
    export_hf(tiny_models["tiny-linear"], str(good))
    config = json.loads((good / "config.json").read_text())

    def broken(name, edit):
        d = tmp_path / name
        d.mkdir()
        for f in os.listdir(good):
            (d / f).write_bytes((good / f).read_bytes())
        edit(d)
        return ["generate", "--model", str(d), "--prompt", "x", "--max-new-tokens", "1"]

    def truncate(d):
        f = next(d / f for f in sorted(os.listdir(d)) if f.endswith(".safetensors"))
        f.write_bytes(f.read_bytes()[:-100])

    cases = {
        "no_field": broken("no_field", lambda d: (d / "config.json").write_text(
            json.dumps({k: v for k, v in config.items() if k != "num_hidden_layers"}))),
        "not_json": broken("not_json", lambda d: (d / "config.json").write_text("{oops")),
        "truncated": broken("truncated", truncate),
        "empty": ["generate", "--model", str(tmp_path / "empty"), "--prompt", "x"],
    }
    (tmp_path / "empty").mkdir()
    for name, argv in cases.items():
        assert main(argv) != 0, name
        line = _one_line(capsys.readouterr().err)
        assert line.startswith("kimik3: "), (name, line)
    with pytest.raises(Exception):
        main(cases["no_field"] + ["--debug"])


def test_version_and_help_on_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    from importlib import metadata
    assert capsys.readouterr().out.strip() == f"kimik3 {metadata.version('kimik3')}"
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"generate", "batch"} <= set(subparsers.choices)
    for name, sub in [("kimik3", parser), *subparsers.choices.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings)
    for name in ("generate", "batch"):  # the same default model everywhere
        assert subparsers.choices[name].get_default("model") == DEFAULT_MODEL


def test_generate_stop_and_mesh_flags(tiny_models, capsys):
    """--stop cuts the text where a stop text starts, as the engine does; --tensor 2 --dcp 2 gives the
    one-device tokens."""
    model = tiny_models["tiny"]
    tok = kimik3.default_tokenizer(model.cfg)
    full = kimik3.generate(model, ["Hello"], max_new_tokens=8)[0]
    text = tok.decode(full)
    # a stop text past the start that first occurs there, of whole characters (random weights)
    at, stop = [(i, text[i:i + n]) for n in (2, 1) for i in range(1, len(text) - n + 1)
                if "\ufffd" not in text[i:i + n] and text.index(text[i:i + n]) == i][0]
    args = ["generate", "--model", "tiny", "--prompt", "Hello", "--max-new-tokens", "8"]
    assert main(args + ["--stop", stop, "--stop", "never said"]) == 0
    out = capsys.readouterr().out
    assert f"text:   {text[:at]!r}" in out
    assert main(args + ["--tensor", "2", "--dcp", "2"]) == 0
    out = capsys.readouterr().out
    assert f"tokens: {full}" in out and "mesh tensor=2 dcp=2" in out


def test_a_second_init_compiles_nothing(tiny_models):
    """kimik3.init keeps its compiled program per config: another seed of a built preset only runs it."""
    import jax
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if event == BACKEND_COMPILE_EVENT else None)
    model = kimik3.init(kimik3.Config.preset("tiny"), seed=1)
    jax.block_until_ready(model.params)
    assert compiles == []
    assert not all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(model.params),
                                                       jax.tree.leaves(tiny_models["tiny"].params)))


def test_compilation_cache_directory(monkeypatch, tmp_path):
    for name in (compilation_cache.ENV, "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_dir() == str(tmp_path / "kimik3" / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compilation_cache.default_dir() == str(tmp_path / "jax")
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "mine"))
    assert compilation_cache.default_dir() == str(tmp_path / "mine")
    monkeypatch.setenv(compilation_cache.ENV, "off")
    assert compilation_cache.default_dir() is None


def test_second_run_loads_its_programs_from_the_cache(tmp_path):
    """The CLI keeps compiled programs under $XDG_CACHE_HOME/kimik3/jax: a second run prints the same
    and adds no cache entry (every program it needs was found there: min compile time 0 caches all)."""
    env = {k: v for k, v in os.environ.items() if k not in (compilation_cache.ENV, "JAX_COMPILATION_CACHE_DIR")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path))
    cmd = [sys.executable, "-m", "serve.cli", "generate", "--model", "tiny-linear", "--prompt", "Hi",
           "--max-new-tokens", "2"]
    cache = tmp_path / "kimik3" / "jax"
    runs = []
    for _ in range(2):
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        runs.append((res.stdout.splitlines()[1], sorted(os.listdir(cache))))
    assert runs[0][1] and runs[1] == runs[0]
