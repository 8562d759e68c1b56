import kimik3
from kimik3.checkpoint.hf_export import export_hf
from serve.cli import main


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
    assert main(["generate", "--model", "kimi-k9", "--prompt", "x"]) == 2
    assert "unknown preset 'kimi-k9'" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--chat"]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_mxfp4_layout_flag(tiny_models, tmp_path, capsys):
    export_hf(tiny_models["tiny"], str(tmp_path))
    args = ["generate", "--model", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "3"]
    assert main(args + ["--mxfp4-layout", "paired"]) == 0
    expect = kimik3.generate(tiny_models["tiny"], ["Hi"], max_new_tokens=3)[0]
    assert f"tokens: {expect}" in capsys.readouterr().out
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--mxfp4-layout", "paired"]) == 2
    assert "--mxfp4-layout applies to checkpoint directories" in capsys.readouterr().err


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
    assert main(args + ["--mla-cache-scale", "0.25"]) == 2
    assert "give it with --mla-cache fp8" in capsys.readouterr().err
