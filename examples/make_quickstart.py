"""Writes examples/quickstart.ipynb (kept as code here so the notebook's source is reviewable).
Run: python examples/make_quickstart.py"""
import os

import nbformat as nbf

cells = [
    ("md", "# kimik3 quickstart\nLoad the tiny model, generate, look inside one layer's KDA state and MLA cache, "
           "switch kernel backends, and time a decode step. Runs on CPU."),
    ("code", "import time\nimport numpy as np\nimport jax, jax.numpy as jnp\nimport kimik3\n"
             "cfg = kimik3.Config.preset('tiny')\nmodel = kimik3.init(cfg, seed=0)\n"
             "print(cfg.layer_types, kimik3.param_count(cfg))"),
    ("md", "## Generate\nGreedy by default; `temperature`, `top_k`, `top_p` and `seed` for sampling."),
    ("code", "tok = kimik3.default_tokenizer(cfg)\n"
             "out = kimik3.generate(model, ['Hello, Kimi', 'AttnRes'], max_new_tokens=12)\n"
             "for o in out:\n    print(o, repr(tok.decode(o)))\n"
             "sampled = kimik3.generate(model, ['Hello, Kimi'], max_new_tokens=12, temperature=0.8, top_p=0.9, seed=1)\n"
             "print(sampled)"),
    ("md", "## Inside the cache\nPrefill fills every layer's cache entry: KDA layers keep an fp32 state "
           "[B, H, K, V] and a conv state; MLA layers keep the latent (kv_lora_rank) + shared key (rope) per token."),
    ("code", "prompt = tok.encode('The cache holds', add_bos=True)\n"
             "last, cache = kimik3.prefill(model, [prompt], max_seq_len=64)\n"
             "kda_layer = cfg.kda_layers[0]; mla_layer = cfg.mla_layers[0]\n"
             "state = cache.layers[kda_layer]['state']\n"
             "latent = cache.layers[mla_layer]['latent']\n"
             "print('KDA state', state.shape, state.dtype, 'norm per head', jnp.linalg.norm(state[0], axis=(-2, -1)))\n"
             "print('MLA cache', latent.shape, 'rows written', int(cache.lengths[0]),\n"
             "      'nonzero rows', int((jnp.abs(latent[0]).sum(-1) > 0).sum()))"),
    ("md", "## Backends\nEvery kernel entry point takes `backend=`: `reference` (plain JAX), `pallas` (GPU, Triton "
           "lowering) or `interpret` (the Pallas kernel run by the interpreter on CPU). Compare the chunked KDA "
           "kernel against the reference on the layer's real inputs shape."),
    ("code", "import kernels_pallas as kp\n"
             "ks = jax.random.split(jax.random.key(0), 5)\nB, T, H, K = 1, 80, 2, 32\n"
             "q, k, v = (jax.random.normal(ks[i], (B, T, H, K)) for i in range(3))\n"
             "g = kp.kda_gate(jax.random.normal(ks[3], (B, T, H, K)), jnp.zeros(H), jnp.zeros(H * K), lower_bound=-5.0)\n"
             "beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))\n"
             "o_ref, s_ref = kp.kda_chunk(q, k, v, g, beta, use_qk_l2norm=True, backend='reference')\n"
             "o_int, s_int = kp.kda_chunk(q, k, v, g, beta, use_qk_l2norm=True, backend='interpret')\n"
             "print('max |diff| output', float(jnp.abs(o_ref - o_int).max()), 'state', float(jnp.abs(s_ref - s_int).max()))"),
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
             "print(eng.generate(['a', 'bb', 'ccc'], max_new_tokens=5))"),
]
nb = nbf.v4.new_notebook()
nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src) for kind, src in cells]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, os.path.join(os.path.dirname(os.path.abspath(__file__)), "quickstart.ipynb"))
