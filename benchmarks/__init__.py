"""Device benchmarks against named peers, one tool: `python -m benchmarks <name> [flags]`.

Each benchmark runs its peer (FLA, torch, cuDNN) or its limit (copy bandwidth, dense matmul
peak) in the same process on identical inputs and writes OUT/<name>.json: date, device,
commit, command, the table rows and the details. `python -m benchmarks report` renders
BENCHMARKS.md from the committed results in benchmarks/results/. `--smoke` runs a benchmark's
code paths on the CPU at tiny shapes (interpret-mode kernels, no peer): what the tests run.
"""
