"""Writes examples/quickstart.ipynb (kept as code here so the notebook's source is reviewable).
Run: python examples/make_quickstart.py"""
import os

import nbformat as nbf

cells = [
    ("md", "# kimik3 quickstart\nLoad the shipped trained tiny model (`tiny-code`: K3's architecture at a few "
           "million parameters, byte-level, trained on the Python standard library's source), generate, measure "
           "its loss along a held-out file, look inside one layer's KDA state and MLA cache, compare the Pallas "
           "kernels (interpreted) with the plain-JAX reference, and time a decode step. Runs on CPU."),
    ("code", "import time\nimport numpy as np\nimport jax, jax.numpy as jnp\nimport matplotlib.pyplot as plt\n"
             "import kimik3\nfrom kimik3 import stdlib_corpus\n"
             "model = kimik3.load('tiny-code')   # an HF directory in the package: bf16 weights, MXFP4 experts\n"
             "cfg = model.cfg\nprint(cfg.layer_types, kimik3.param_count(cfg))"),
    ("md", "## Generate\nGreedy by default; `temperature`, `top_k`, `top_p` and `seed` for sampling."),
    ("code", "tok = kimik3.default_tokenizer(cfg)\n"
             "prompt = 'import os\\nimport sys\\n\\n\\ndef main():\\n'\n"
             "out = kimik3.generate(model, [prompt], max_new_tokens=40)[0]\n"
             "print(prompt + tok.decode(out))\n"
             "sampled = kimik3.generate(model, [prompt], max_new_tokens=40, temperature=0.8, top_p=0.9, seed=1)[0]\n"
             "print(prompt + tok.decode(sampled))"),
    ("md", "## Loss along a held-out file\nFiles whose path hashes to 0 mod 20 were never trained on "
           "(`kimik3/stdlib_corpus.py`). Bits spent on each byte of the first 512 bytes of one:"),
    ("code", "window = stdlib_corpus.heldout_sample(window=512, max_windows=1)\n"
             "inputs = np.concatenate([[[cfg.bos_token_id]], window[:, :-1]], axis=1)\n"
             "bits = stdlib_corpus.byte_nll(kimik3.forward(model, inputs), window)[0]\n"
             "print(f'{bits.mean():.3f} bits per byte (8 for a model that knows nothing)')\n"
             "fig, ax = plt.subplots(figsize=(12, 3))\nax.plot(bits, lw=0.8)\n"
             "ax.set_xlabel('byte'); ax.set_ylabel('bits'); ax.set_title('per-byte loss, held-out file')\nplt.show()\n"
             "text = bytes(window[0].astype(np.uint8)).decode('utf-8', 'replace')\n"
             "worst = np.argsort(bits)[-5:]\n"
             "print('most surprising bytes:', [(int(i), text[max(0, i - 12):i + 1]) for i in sorted(worst)])"),
    ("md", "## Inside the cache\nPrefill fills every layer's cache entry: KDA layers keep an fp32 state "
           "[B, H, K, V] and a conv state; MLA layers keep the latent (kv_lora_rank) + shared key (rope) per token."),
    ("code", "ids = tok.encode(prompt, add_bos=True)\n"
             "last, cache = kimik3.prefill(model, [ids], max_seq_len=64)\n"
             "kda_layer = cfg.kda_layers[0]; mla_layer = cfg.mla_layers[0]\n"
             "state = cache.layers[kda_layer]['state']\n"
             "latent = cache.layers[mla_layer]['latent']\n"
             "print('KDA state', state.shape, state.dtype, 'norm per head', jnp.linalg.norm(state[0], axis=(-2, -1)))\n"
             "print('MLA cache', latent.shape, 'rows written', int(cache.lengths[0]),\n"
             "      'nonzero rows', int((jnp.abs(latent[0]).sum(-1) > 0).sum()))\n"
             "fig, axes = plt.subplots(1, 2, figsize=(12, 3))\n"
             "axes[0].imshow(np.asarray(state[0, 0]), cmap='RdBu'); axes[0].set_title(f'KDA state, layer {kda_layer}, head 0')\n"
             "axes[1].imshow(np.asarray(latent[0, :len(ids)]).T, aspect='auto', cmap='RdBu')\n"
             "axes[1].set_title(f'MLA cache, layer {mla_layer}: one column per token'); plt.show()"),
    ("md", "## Backends\nEvery kernel entry point takes `backend=`: `reference` (plain JAX), `pallas` (GPU, Triton "
           "lowering) or `interpret` (the Pallas kernel run by the interpreter on CPU). The whole model on the "
           "prompt, both ways: the KDA chunk kernel and the MXFP4 grouped-matmul kernel against their references."),
    ("code", "x = np.asarray([ids])\n"
             "ref = kimik3.forward(model, x, backend='reference')\n"
             "interp = kimik3.forward(model, x, backend='interpret')\n"
             "print('max |diff| output logits', float(jnp.abs(ref - interp).max()), 'of max |logit|', float(jnp.abs(ref).max()))\n"
             "print('same greedy next bytes:', bool((ref.argmax(-1) == interp.argmax(-1)).all()))"),
    ("md", "## Time a decode step"),
    ("code", "tokens = np.array([int(jnp.argmax(last[0]))])\n"
             "logits, cache = kimik3.decode_step(model, cache, tokens)  # compiles once\n"
             "t = time.perf_counter(); n = 10\n"
             "for _ in range(n):\n    logits, cache = kimik3.decode_step(model, cache, np.asarray(jnp.argmax(logits, -1)))\n"
             "jax.block_until_ready(logits)\n"
             "print(f'{(time.perf_counter() - t) / n * 1e3:.2f} ms per decode step on {jax.default_backend()}')"),
    ("md", "## The engine\nContinuous batching with a paged cache, as the batch script uses it."),
    ("code", "from serve import Engine\n"
             "eng = Engine(model, max_batch=4, max_seq_len=64, page_size=8)\n"
             "for o in eng.generate(['import ', 'def ', 'class '], max_new_tokens=12):\n    print(repr(tok.decode(o)))"),
]
nb = nbf.v4.new_notebook()
nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src) for kind, src in cells]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, os.path.join(os.path.dirname(os.path.abspath(__file__)), "quickstart.ipynb"))
